"""Where one decode step's time goes: kernels per step, grouped, with their GPU time.

    python -m fastgemma.bench.profile --variants graph_triton_merged,compiled_triton_merged

Builds E4B synthetic bf16 weights once, then for each ladder variant (bench.ladder.VARIANTS)
captures the step as the engine runs it and profiles `--steps` replays with the CUDA profiler
(kernels inside a CUDA graph are traced one by one). Per variant it prints: kernels per step, the sum
of kernel times, the replayed step's wall time (the difference is launch / dependency gaps), and the
kernel groups (GEMV, attention, fused elementwise, ...) with count and microseconds per step, then
the `--top` kernels. --out writes one JSON line per variant.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import time

import torch

from ..engine.cache import KVCache
from ..engine.steps import GraphStep
from ..model.config import preset
from ..weights.synthetic import synthetic_model
from .ladder import apply_variant, decode_bytes

# kernel name pattern -> group; first match wins
GROUPS = [
    ("attention", re.compile(r"^_split_kernel$|^_combine_kernel$|decode_attn|_attn_|flash|fmha|sdpa", re.I)),
    ("bf16 gemv (ours)", re.compile(r"_dense_gemv_kernel|_prefetch_gemv_kernel|_fused_gemv_kernel")),
    ("int4 gemv", re.compile(r"_fused_w4a16_kernel|_gemv_kernel|_mma_kernel|_mma_w4a16_kernel|splitk_reduce", re.I)),
    ("head argmax", re.compile(r"argmax|sparse", re.I)),
    ("gemv/gemm (cuBLAS)", re.compile(r"gemv|gemm|xmma|cutlass|sm90|ampere|splitK|cublas", re.I)),
    ("fused elementwise / reductions", re.compile(r"^triton_|fused", re.I)),
    ("torch elementwise", re.compile(r"elementwise|vectorized|unrolled|reduce_kernel|index|scatter|gather|copy|cat", re.I)),
]


def group_of(name: str) -> str:
    return next((g for g, pat in GROUPS if pat.search(name)), "other")


def profile_calls(fn, steps: int):
    """Kernel events of `steps` calls of fn(): {name: (count, total_us)}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name != "CUDA" or "Memcpy" in e.name or "Memset" in e.name:
            continue
        out[e.name][0] += 1
        out[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return out


def profile_step(step, steps: int):
    """Kernel events of `steps` decode steps: {name: (count, total_us)}."""
    state = {"tok": step.out_tok if isinstance(step, GraphStep) else torch.tensor([[5]], device="cuda")}

    def one():
        state["tok"] = step(state["tok"])

    return profile_calls(one, steps)


def summarize_kernels(kern, steps: int, top: int) -> dict:
    """Per call: kernels, kernel time, groups {group: {n, us}}, the `top` kernels by time."""
    groups = collections.defaultdict(lambda: [0.0, 0.0])
    for k, (c, t) in kern.items():
        g = groups[group_of(k)]
        g[0] += c / steps
        g[1] += t / steps
    return dict(kernels_per_step=sum(c for c, _ in kern.values()) / steps,
                kernel_us=sum(t for _, t in kern.values()) / steps,
                groups={k: dict(n=v[0], us=v[1]) for k, v in sorted(groups.items(), key=lambda kv: -kv[1][1])},
                top=[dict(name=k[:90], n=c / steps, us=t / steps) for k, (c, t) in
                     sorted(kern.items(), key=lambda kv: -kv[1][1])[:top]])


def print_kernels(row: dict) -> None:
    print("| group | kernels/step | us/step | us/kernel |")
    print("|---|---|---|---|")
    for g, v in row["groups"].items():
        print(f"| {g} | {v['n']:.0f} | {v['us']:.0f} | {v['us'] / max(v['n'], 1):.2f} |")
    print("| top kernel | n/step | us/step |\n|---|---|---|")
    for r in row["top"]:
        print(f"| {r['name']} | {r['n']:.0f} | {r['us']:.0f} |")


def wall_ms(step, steps: int = 200) -> float:
    tok = step.out_tok if isinstance(step, GraphStep) else torch.tensor([[5]], device="cuda")
    for _ in range(10):
        tok = step(tok)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        tok = step(tok)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


@torch.inference_mode()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma4_e4b")
    ap.add_argument("--variants", default="graph_triton_merged,compiled_triton_merged")
    ap.add_argument("--context", type=int, default=300, help="position the profiled steps decode at")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.profile needs a CUDA device")
    cfg = preset(a.model)
    model = synthetic_model(cfg, "cuda", torch.bfloat16, seed=0)
    rows = []
    state = {}
    for name in a.variants.split(","):
        cls, compiled = apply_variant(model, name, state)
        cache = KVCache(cfg, 1, a.context + 256, device="cuda", dtype=torch.bfloat16)
        step = cls(model, cache) if cls.__name__ == "EagerStep" else cls(model, cache, compile=compiled)
        step.prepare()
        step.begin(a.context)
        ms = wall_ms(step)
        step.begin(a.context)
        kern = profile_step(step, a.steps)
        row = dict(variant=name, step_ms=ms, **summarize_kernels(kern, a.steps, a.top),
                   weight_gb=decode_bytes(model) / 1e9)
        row["gap_us"] = ms * 1e3 - row["kernel_us"]
        rows.append(row)
        print(f"\n## {name}: step {ms:.3f} ms, {row['kernels_per_step']:.0f} kernels/step, kernel time "
              f"{row['kernel_us']:.0f} us, gaps {row['gap_us']:.0f} us, weights read {row['weight_gb']:.2f} GB")
        print_kernels(row)
        del step, cache
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
