"""The body GEMVs of one decode step, alone, chained, in one CUDA graph: what the weights cost
with no other work in between, per GEMV launch style.

    python -m fastgemma.bench.chain --variants cublas,plain,prefetch,pdl

Every layer of the model (E4B by default; merged q|k|v and gate|up, as the fast path runs them)
contributes its GEMVs in step order: q|k|v (q on KV-shared layers), o, gate|up, down, PLE gate,
PLE projection. Each reads the previous one's output (sliced to its K), so the chain has the
step's true dependencies. Variants: `cublas` (F.linear), and our GEMV launched `plain`,
`prefetch` (all weight blocks loaded before x) or `pdl` (prefetch + programmatic dependent
launch: the next GEMV's weights stream in while the previous one finishes). The final outputs of
our three launch styles must be bit-identical (same arithmetic; a race under PDL would show).
Prints one JSON line per variant (--out: JSONL) and a markdown table last.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from ..model.config import preset


def chain_shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, N, K) of every body GEMV of one decode step, in order."""
    out = []
    h = cfg.hidden_size
    for s in cfg.layer_specs():
        q = cfg.num_heads * s.head_dim
        kv = 2 * s.num_kv_heads * s.head_dim if s.stores_kv else 0
        out += [("qkv" if kv else "q", q + kv, h), ("o", h, q),
                ("gate|up", 2 * s.intermediate_size, h), ("down", h, s.intermediate_size)]
        if cfg.ple_dim:
            out += [("ple_gate", cfg.ple_dim, h), ("ple_proj", h, cfg.ple_dim)]
    return out


def build_chain(cfg, device, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(n, k, device=device, dtype=dtype, generator=g) * k ** -0.5
            for _, n, k in chain_shapes(cfg)]


def run_chain(weights, x0, linear):
    """x0 [1, K0] through every weight; linear(x, w) -> [1, N]."""
    x = x0
    for w in weights:
        x = linear(x[:, : w.shape[1]], w)
    return x


def linear_for(variant: str):
    if variant == "cublas":
        return F.linear
    from ..kernels.gemv import gemv

    return lambda x, w: gemv(x, w, launch=variant)


def time_graph(fn, reps: int) -> tuple[float, torch.Tensor]:
    """Capture fn once, replay: median ms per replay (CUDA events) and the output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out.clone()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma4_e4b")
    ap.add_argument("--variants", default="cublas,plain,prefetch,pdl")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fastgemma.bench.chain times CUDA graphs; no CUDA device here")
    cfg = preset(a.model)
    dev = torch.device("cuda")
    weights = build_chain(cfg, dev)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    x0 = torch.randn(1, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    gpu = torch.cuda.get_device_name()
    print(f"{gpu} | {cfg.name} body GEMV chain: {len(weights)} GEMVs, {nbytes / 1e9:.2f} GB bf16", flush=True)
    rows, outs = [], {}
    for v in a.variants.split(","):
        lin = linear_for(v)
        ms, out = time_graph(lambda: run_chain(weights, x0, lin), a.reps)
        outs[v] = out
        row = dict(variant=v, gpu=gpu, model=cfg.name, gemvs=len(weights), gb=nbytes / 1e9, ms=ms,
                   tb_s=nbytes / ms / 1e9, us_per_gemv=1e3 * ms / len(weights))
        if "plain" in outs and v != "cublas":
            row["bitwise_equal_plain"] = bool(torch.equal(out, outs["plain"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    base = rows[0]["ms"]
    print(f"\n{cfg.name} body GEMV chain in one CUDA graph, M=1, {nbytes / 1e9:.2f} GB bf16; {gpu}")
    print("| variant | ms | TB/s | us per GEMV | vs first | equal to plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['ms']:.3f} | {r['tb_s']:.2f} | {r['us_per_gemv']:.2f} | "
              f"{base / r['ms']:.2f}x | {r.get('bitwise_equal_plain', '')} |")


if __name__ == "__main__":
    main()
