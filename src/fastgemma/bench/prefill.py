"""Prefill (time to first token) on one GPU, in one process: TTFT per prompt length for each prefill
path, on the int4 stack of bench.spec (merged projections, int4 g128 body, the given head, fused
argmax). Same synthetic weights for all rows.

    python -m fastgemma.bench.prefill --prompt-lens 64,256,1024 --profile

Variants: eager (the forward as is), compiled (torch.compile, dynamic=True), graph (the prompt padded
in front to a multiple of --bucket and replayed from one CUDA graph per padded length, as
graphs=cuda_graph does), compiled_graph (both, as graphs=compiled graphs.compile_prefill=true does), layers /
layers_graph (each decoder layer's regions compiled instead: graphs=compiled's default). A row times
`Generator.prefill` + the sampler's first token (what TTFT counts), median of --repeats after
--warmup calls of the same length (the first call of a variant compiles or captures: `first call s`); each row's
prompt output is then compared with the eager, unpadded forward's (the last hidden state's max abs difference, and
the first token). --profile also traces one prefill per length: kernels,
kernel time by group and the top kernels; wall minus kernel time is what the host adds (launches,
Python). Prints one JSON line per row (--out: JSONL), then a markdown table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..engine.cache import KVCache
from ..engine.generator import Generator
from ..engine.steps import PREFILL_BUCKET
from ..model.config import preset
from .spec import build_stack, sync


def time_prefill(gen: Generator, ids: torch.Tensor, repeats: int, warmup: int) -> list[float]:
    """Seconds per prefill + first token, `repeats` times after `warmup` untimed calls."""
    out = []
    for i in range(warmup + repeats):
        sync()
        t = time.perf_counter()
        h = gen.prefill(ids)
        gen.sampler(gen.model, h)
        sync()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    return out


def prefill_output(gen: Generator, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's last hidden state (fp32) and first token, copied out of any captured graph's buffers."""
    h = gen.prefill(ids)
    return h.float().clone(), gen.sampler(gen.model, h)[0].clone()


def against(out: tuple, ref: tuple) -> dict:
    """A variant's prefill output against the eager forward's: max abs difference of the last hidden state
    (with the reference's own max abs, for scale) and whether the first token is the same."""
    (h, tok), (rh, rtok) = out, ref
    return dict(hidden_max_diff=(h - rh).abs().max().item(), hidden_max=rh.abs().max().item(),
                first_token_same=bool(torch.equal(tok, rtok)))


# name -> (torch.compile the forward, pad and capture per padded length)
VARIANTS = {"eager": (False, False), "compiled": (True, False), "graph": (False, True), "compiled_graph": (True, True),
            "layers": ("layers", False), "layers_graph": ("layers", True)}  # name: (compile_prefill, captured)


def set_variant(gen: Generator, name: str, bucket: int = PREFILL_BUCKET) -> None:
    """The generator's prompt path for variant `name` (captured graphs of another path are dropped)."""
    compiled, captured = VARIANTS[name]
    gen.set_prefill(compiled, bucket if captured else 0)


PREFILL_SHAPES = ("qkv", "qkv_full", "o", "o_full", "gate|up", "down", "ple_proj", "w_plm")  # E4B_SHAPES at M = T


def tile_tables(which: list[str], sweep_m: int) -> dict:
    """{name: CONFIGS entries for prompt chunks}: table (as imported), per_group (the table without
    its long-chunk entries), first (the first tl.dot kernel's default tiles), sweep (bench_shapes'
    best per shape at M = sweep_m, timed now). The long-chunk entries ((DEQUANT_MIN_M, N, K): W
    dequantized once, then cuBLAS) are the table's only: the others drop them (None)."""
    from ..kernels import w4a16_table
    from ..kernels.w4a16_bench import bench_shapes

    shapes = {k: w4a16_table.E4B_SHAPES[k] for k in PREFILL_SHAPES}
    bucket = w4a16_table.m_bucket(w4a16_table.MAX_DECODE_M + 1)
    keys = [(bucket, N, K) for N, K in shapes.values()]
    long_keys = [(w4a16_table.DEQUANT_MIN_M, N, K) for N, K in shapes.values()]
    out = {}
    for name in which:
        if name == "table":
            out[name] = {k: w4a16_table.CONFIGS.get(k) for k in keys + long_keys}
        elif name == "per_group":  # the table without its long-chunk (dequantize once) entries
            out[name] = {k: w4a16_table.CONFIGS.get(k) for k in keys}
        elif name == "first":
            out[name] = {k: w4a16_table.default_config(w4a16_table.MAX_DECODE_M + 1, k[1], k[2]) for k in keys}
        elif name == "sweep":
            rows = bench_shapes(ms=(sweep_m,), shapes=shapes, sweep=True, graph=False, rep_ms=10,
                                per_group_only=False)
            out[name] = {(bucket, r["N"], r["K"]): r["best_config"] for r in rows}
        else:
            raise SystemExit(f"unknown tiles {name!r}: table, per_group, first, sweep")
        out[name].update({k: out[name].get(k) for k in long_keys})
    return out


def use_tiles(table: dict) -> None:
    from ..kernels import w4a16_table

    for k, cfg in table.items():
        if cfg is None:
            w4a16_table.CONFIGS.pop(k, None)
        else:
            w4a16_table.CONFIGS[k] = cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma4_e4b")
    ap.add_argument("--prompt-lens", default="64,256,1024")
    ap.add_argument("--head", default="pruned:12288", help="full, int8, int4 or pruned:N")
    ap.add_argument("--window", default="188", help="native or a number of keys")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="eager (the forward as is), compiled (torch.compile dynamic=True), graph (padded to "
                         "--bucket, one CUDA graph per padded length: graphs=cuda_graph), compiled_graph "
                         "(both: graphs=compiled graphs.compile_prefill=true), layers / layers_graph (each decoder "
                         "layer's regions compiled instead of the whole forward: graphs=compiled's default)")
    ap.add_argument("--bucket", type=int, default=PREFILL_BUCKET, help="padding multiple of the graph variants")
    ap.add_argument("--tiles", default="table",
                    help="int4 tiles of the prompt chunks, comma-separated: table, per_group (the table "
                         "without its dequantize-once entries for chunks of 256+ rows), first (the first "
                         "tl.dot kernel's default), sweep (bench_shapes' best at --sweep-m, timed first)")
    ap.add_argument("--sweep-m", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="trace one prefill per length: kernels by group")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the script's logic on torch twins (smoke test)")
    a = ap.parse_args(argv)
    dev = a.device
    cuda = dev.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("fastgemma.bench.prefill times a GPU; no CUDA device here")
    lens = [int(x) for x in a.prompt_lens.split(",") if x]
    if not lens or min(lens) < 1:
        raise SystemExit(f"--prompt-lens {a.prompt_lens!r}: positive integers, comma-separated")
    variants = [v for v in a.variants.split(",") if v]
    if not variants or set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants {a.variants!r}: {', '.join(VARIANTS)}")
    if a.bucket < 1:
        raise SystemExit(f"--bucket must be >= 1, got {a.bucket}")
    from torch._dynamo.utils import counters as dynamo_counters

    cfg = preset(a.model)
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.time()
    model, sampler, stack = build_stack(cfg, dev, a.head, dtype, fuse=True)
    window = None if a.window == "native" else int(a.window)
    cache = KVCache(cfg, 1, max(lens) + 16, window=window, device=dev, dtype=dtype)
    # one generator per forward (eager / compiled: one compilation, kept across rows), the bucket
    # switched per row
    fwd = {c: Generator(model, cache, sampler=sampler, prefill_chunk=a.chunk, compile_prefill=c, prefill_bucket=0)
           for c in dict.fromkeys(VARIANTS[v][0] for v in variants)}
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{gpu} | {cfg.name} synthetic | stack built in {time.time() - t0:.1f}s", flush=True)
    tables = tile_tables([t for t in a.tiles.split(",") if t], a.sweep_m) if cuda else {"table": {}}
    g = torch.Generator().manual_seed(0)
    prompts = {L: torch.randint(10, cfg.vocab_size, (1, L), generator=g).to(dev) for L in lens}
    rows = []
    reference = Generator(model, cache, sampler=sampler, prefill_chunk=a.chunk, compile_prefill=False,
                          prefill_bucket=0)  # each row's output is checked against this eager, unpadded one
    for tname, table in tables.items():
        use_tiles(table)
        ref = {L: prefill_output(reference, ids) for L, ids in prompts.items()}
        for v in variants:
            gen = fwd[VARIANTS[v][0]]
            set_variant(gen, v, a.bucket)  # drops graphs captured with other tiles
            t = time.perf_counter()
            time_prefill(gen, prompts[lens[0]], 0, 1)  # the first call compiles (compiled)
            first_s = time.perf_counter() - t
            for L, ids in prompts.items():
                s = time_prefill(gen, ids, a.repeats, a.warmup)
                ms = statistics.median(s) * 1e3
                row = dict(variant=v, tiles=tname, prompt_len=L, padded_len=gen.padded_length(L) or L, ttft_ms=ms, ttft_ms_min=min(s) * 1e3,
                           prefill_tps=L / ms * 1e3, first_call_s=first_s, gpu=gpu, model=cfg.name, head=a.head,
                           window=window or cfg.sliding_window, chunk=a.chunk,
                           dynamo_graphs=dynamo_counters["stats"]["unique_graphs"],  # compilations so far
                           **against(prefill_output(gen, ids), ref[L]))
                if a.profile and cuda:
                    from .profile import print_kernels, profile_calls, summarize_kernels

                    prof = summarize_kernels(profile_calls(lambda: sampler(model, gen.prefill(ids)), 1), 1, 12)
                    row.update(kernels=prof["kernels_per_step"], kernel_ms=prof["kernel_us"] / 1e3,
                               host_ms=ms - prof["kernel_us"] / 1e3, groups=prof["groups"], top=prof["top"])
                    print(f"\n### {v}, {tname} tiles, prompt {L}: {prof['kernels_per_step']:.0f} kernels, kernel "
                          f"time {prof['kernel_us'] / 1e3:.2f} ms of {ms:.2f} ms", flush=True)
                    print_kernels(prof)
                rows.append(row)
                print(json.dumps(row, default=str), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps({"stack": stack}) + "\n")
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
    print(f"\n{cfg.name} synthetic, int4 g128 body + {a.head} head, window {window or cfg.sliding_window}, "
          f"chunk {a.chunk}; {gpu}")
    print("| variant | int4 tiles | prompt | padded | TTFT ms | min ms | prefill tok/s | first call s | compiled graphs "
          "| vs eager: hidden max diff (of max) | first token | kernels | kernel ms | host ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        prof = [f"{r[key]:.{nd}f}" if key in r else "" for key, nd in (("kernels", 0), ("kernel_ms", 2), ("host_ms", 2))]
        print(f"| {r['variant']} | {r['tiles']} | {r['prompt_len']} | {r['padded_len']} | {r['ttft_ms']:.2f} | {r['ttft_ms_min']:.2f} | "
              f"{r['prefill_tps']:.0f} | {r['first_call_s']:.1f} | {r['dynamo_graphs']} | "
              f"{r['hidden_max_diff']:.3g} ({r['hidden_max']:.3g}) | {'same' if r['first_token_same'] else 'DIFFERS'} | "
              f"{' | '.join(prof)} |")

if __name__ == "__main__":
    main()
