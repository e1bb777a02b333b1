"""GPTQ's rounding of a model's linears, per shape: the column loop as torch ops (the twin: a handful of launches a
column) against kernels/gptq_columns.py (one launch a block of 128 columns), in one process.

    python -m fastgemma.bench.gptq [--model gemma4_e4b] [--tokens 8192] [--group-size 128] [--no-act-order]

Each distinct (N, K) the engine quantizes (q|k|v or q, o, gate|up, down, the PLE projection per layer; the PLE
model projection once) gets a random weight and the Hessian of random inputs whose columns differ in scale, then
gptq_int4 runs on it with each column loop (Cholesky, permutation and all), its codes, scales and zeros checked
equal between the two. Times one call each (on a GPU after a warm-up call of each loop on the first shape); the
model's total is each shape's time times how many linears have it. Prints one JSON line per shape (--out: JSONL)
and a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import Counter

import torch

from ..kernels import gptq_columns
from ..model.config import ModelConfig, preset
from ..transforms import gptq


def linear_shapes(cfg: ModelConfig) -> Counter:
    """{(kind, N, K): how many} for the linears quant.method=gptq rounds in a fused-projection model."""
    h, shapes = cfg.hidden_size, Counter()
    for s in cfg.layer_specs():
        q, kv = cfg.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        shapes[("qkv_proj", q + 2 * kv, h) if s.stores_kv else ("q_proj", q, h)] += 1
        shapes[("o_proj", h, q)] += 1
        shapes[("gate_up_proj", 2 * s.intermediate_size, h)] += 1
        shapes[("down_proj", h, s.intermediate_size)] += 1
        if cfg.ple_dim:
            shapes[("per_layer_projection", h, cfg.ple_dim)] += 1
    if cfg.ple_dim:
        shapes[("per_layer_model_projection", cfg.num_layers * cfg.ple_dim, h)] += 1
    return shapes


LOOPS = {"torch": gptq_columns.columns_torch, "triton": gptq_columns.columns_triton}  # name: column loop, on a GPU


def _case(N: int, K: int, tokens: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, device=device, generator=g) * 0.02
    x = torch.randn(tokens, K, device=device, generator=g) * torch.linspace(0.1, 3.0, K, device=device)
    return w.to(torch.bfloat16), x.t() @ x / tokens


def _timed(fn, sync) -> tuple[float, object]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def bench_gptq(cfg: ModelConfig, tokens: int = 8192, group_size: int = 128, act_order: bool = True,
               device: str = "cuda", loops=None, out=None) -> list[dict]:
    """One dict per shape: its count, seconds per call of each loop, whether their codes agree."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    loops = loops or LOOPS
    shapes = sorted(linear_shapes(cfg).items())
    bad = [f"{kind} ({N} x {K})" for (kind, N, K), _ in shapes if K % group_size]
    if bad:
        raise ValueError(f"group size {group_size} does not divide the K of {cfg.name}'s {', '.join(bad)}")
    rows = []
    for i, ((kind, N, K), count) in enumerate(shapes):
        w, H = _case(N, K, tokens, dev, seed=i)
        row = {"kind": kind, "N": N, "K": K, "count": count}
        results = []
        for name, fn in loops.items():
            run = lambda: gptq.gptq_int4(w, H, group_size, act_order=act_order, loop=fn)  # noqa: E731
            if dev.type == "cuda" and i == 0:
                run()  # warm-up, on the first shape only: the kernel's builds (every K is a multiple of a
                # block, so these are all of them), the solvers' and allocator's first calls
            row[f"{name}_s"], res = _timed(run, sync)
            results.append(res)
        row["codes_equal"] = all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
    return rows


def table(rows: list[dict], names) -> str:
    head = "| linear | N x K | in the model | " + " | ".join(f"{n} s" for n in names) + " | codes equal |"
    lines = [head, "|" + "---|" * (4 + len(names))]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['N']} x {r['K']} | {r['count']} | "
                     + " | ".join(f"{r[f'{n}_s']:.3f}" for n in names) + f" | {r['codes_equal']} |")
    totals = [sum(r["count"] * r[f"{n}_s"] for r in rows) for n in names]
    lines.append(f"| the model's {sum(r['count'] for r in rows)} linears | | | "
                 + " | ".join(f"**{t:.1f}**" for t in totals) + f" | {all(r['codes_equal'] for r in rows)} |")
    return "\n".join(lines)


def _or_exit(fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        raise SystemExit(f"bench.gptq: {e}") from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma4_e4b", help="a preset's name (model/config.py)")
    ap.add_argument("--tokens", type=int, default=8192, help="calibration rows behind each Hessian")
    ap.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128))
    ap.add_argument("--no-act-order", action="store_true", help="columns left to right, ranges as groups start")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="JSONL file for the rows")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.gptq times the GPU's column loops: no CUDA device here (--device cpu for the twin)")
    if a.tokens < 1:
        raise SystemExit(f"--tokens must be >= 1, got {a.tokens}")
    loops = LOOPS if a.device == "cuda" else {"torch": gptq_columns.columns_torch}
    with open(a.out, "w") if a.out else contextlib.nullcontext() as out:
        cfg = _or_exit(preset, a.model)
        rows = _or_exit(bench_gptq, cfg, a.tokens, a.group_size, not a.no_act_order, a.device, loops, out)
    print(table(rows, list(loops)))


if __name__ == "__main__":
    main()
