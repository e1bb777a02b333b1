"""A layer's int4 GEMVs with the next kernels' weights asked into the L2 from a side branch of the graph.

    python -m fastgemma.bench.l2_ahead [--plans none down@gu "down@gu,qkv+1@down,o+1@down"] [--layers 16]

The frontier step's one-row tensor-core GEMVs stream their weights at 0.7-2.8 TB/s of ~4.2 (each a
few waves behind a boundary): can a launch beside them (kernels/l2_prefetch.py, on a side stream,
forked into the CUDA graph) pull the next kernel's weights into the L2 with the bandwidth they leave,
so that kernel reads them from there? Each layer here is the store layer's four int4 GEMVs at E4B
shapes and the table's one-row configs (qkv 3072x2560, o 2560x2048, gu: gate|up 20480x2560 with
GeGLU, down 2560x10240), PDL launches, each layer on its own copy of the weights (--layers copies, more
than the L2). A plan is a list of TARGET[+1]@PHASE: before PHASE's launch, ask TARGET's weights (+1:
the next layer's) into the L2 from the side stream; `none` asks nothing. Every plan's outputs are
checked bit for bit against `none`'s (a prefetch is a hint), then the layers are timed in one CUDA
graph. Prints one JSON line per plan (--out: JSONL) and a table last: us a layer and what each plan
saves against the first.
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch

PHASES = {"qkv": ("q|k|v", "none"), "o": ("o", "none"), "gu": ("gate|up", "geglu"), "down": ("down", "none")}


def parse_plan(text: str) -> dict[str, list[tuple[str, int]]]:
    """'down@gu,qkv+1@down' -> {PHASE: [(TARGET, layer offset 0 or 1)]}; 'none' -> {}."""
    plan: dict[str, list[tuple[str, int]]] = {}
    if text == "none":
        return plan
    for item in text.split(","):
        target, sep, phase = item.partition("@")
        nxt = target.endswith("+1")
        target = target[:-2] if nxt else target
        if not sep or target not in PHASES or phase not in PHASES:
            raise ValueError(f"plan entry {item!r}: TARGET[+1]@PHASE with TARGET and PHASE of "
                             f"{', '.join(PHASES)} (e.g. down@gu, qkv+1@down), or the plan 'none'")
        plan.setdefault(phase, []).append((target, int(nxt)))
    return plan


def build_layers(n: int, device, group_size: int = 128, shapes: dict | None = None, seed: int = 0):
    """n copies of a layer's four MmaWeights (random codes, scales and zeros), the one-row configs of
    kernels/mma_table.py (shapes: {PHASE: (N, K)} instead of E4B's, with `default_mma_config`), and one
    input row per phase."""
    from ..kernels.fused_w4a16 import E4B_CASES
    from ..kernels.mma_table import default_mma_config, mma_config, settle_cuda_entries
    from ..kernels.mma_w4a16 import MmaWeight

    dev = torch.device(device)
    if not shapes:
        for line in settle_cuda_entries(dev):  # the CUDA gate|up built, or its Triton entry where it cannot run
            print(f"  {line}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    layers = [{} for _ in range(n)]
    cfgs, xs = {}, {}
    for p, (case, epi) in PHASES.items():
        N, K = shapes[p] if shapes else E4B_CASES[case][:2]
        cfg = (None if shapes else mma_config(N, K, 1, epi)) or default_mma_config(N, K, group_size, epi)
        q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
        sc = torch.rand(K // group_size, N, generator=gen) * 0.01 + 0.001  # int4_pack's [K/G, N], w = q s + z
        zr = (-7.5 * sc).to(torch.bfloat16)
        sc = sc.to(torch.bfloat16)
        w = MmaWeight.from_codes(q.to(dev), sc.to(dev), zr.to(dev), group_size, pairs=cfg.pairs)
        for i, layer in enumerate(layers):
            layer[p] = w if i == 0 else MmaWeight(w.words.clone(), w.sz.clone(), N, K, group_size, w.pairs)
        cfgs[p] = cfg
        xs[p] = (torch.randn(1, K, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    return layers, cfgs, xs


def run_layers(layers, cfgs, xs, plan, ahead, pdl: bool = True) -> dict:
    """Every layer's four GEMVs in order, the plan's prefetches forked before their phases; joins the
    side stream at the end. Returns the last layer's outputs by phase."""
    from ..kernels.mma_w4a16 import mma_w4a16

    outs = {}
    n = len(layers)
    for i, layer in enumerate(layers):
        for p, (_, epi) in PHASES.items():
            for target, nxt in plan.get(p, ()):
                w = layers[(i + nxt) % n][target]
                ahead.fork((w.words, w.sz))
            outs[p] = mma_w4a16(xs[p], layer[p], epi, cfgs[p], pdl)
    ahead.join()
    return outs


def bench_plans(plans: list[str], layers: int = 16, timer=None, device: str = "cuda", shapes: dict | None = None,
                chunk: int | None = None, out=None) -> list[dict]:
    """One dict per plan: us a layer (the timed pass over `layers` copies / layers), MB a layer; every
    plan's last outputs equal the first plan's bit for bit (else RuntimeError)."""
    from ..kernels.bench_util import timer_or_graphs
    from ..kernels.l2_prefetch import CHUNK, Ahead
    from ..kernels.mma_table import format_config

    timer = timer_or_graphs(timer, "bench.l2_ahead")
    parsed = [(p, parse_plan(p)) for p in plans]
    ws, cfgs, xs = build_layers(layers, device, shapes=shapes)
    ahead = Ahead(device, chunk or CHUNK)
    mb = sum(w.words.numel() * 4 + w.sz.numel() * w.sz.element_size() for w in ws[0].values()) / 1e6
    rows, first = [], None
    for text, plan in parsed:
        got = run_layers(ws, cfgs, xs, plan, ahead)
        if first is None:
            first = got
        elif any(not torch.equal(got[p], first[p]) for p in PHASES):
            raise RuntimeError(f"plan {text!r}: outputs differ from plan {parsed[0][0]!r}'s (a prefetch changed a "
                               f"result?)")
        us = timer(lambda plan=plan: run_layers(ws, cfgs, xs, plan, ahead)) / layers
        rows.append(dict(plan=text, layers=layers, mb_layer=mb, us_layer=us, prefetch=ahead.on,
                         configs={p: format_config(c) for p, c in cfgs.items()}))
        if out is not None:
            out.write(json.dumps(rows[-1]) + "\n")
            out.flush()
    return rows


def table(rows) -> str:
    """Markdown: one line per plan, with its saving against the first plan's us a layer."""
    lines = ["| plan | MB a layer | us a layer | vs first | TB/s |", "|---|---|---|---|---|"]
    for r in rows:
        d = r["us_layer"] - rows[0]["us_layer"]
        lines.append(f"| {r['plan']} | {r['mb_layer']:.2f} | {r['us_layer']:.2f} | {d:+.2f} | "
                     f"{r['mb_layer'] / r['us_layer']:.2f} |")  # MB / us = TB/s
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="+", default=["none", "down@gu", "down@o", "qkv+1@down,o+1@down",
                                                   "down@gu,qkv+1@down,o+1@down", "gu@qkv",
                                                   "gu@qkv,down@gu,qkv+1@down,o+1@down"],
                    help="plans, each TARGET[+1]@PHASE,... (phases: qkv, o, gu, down) or 'none'")
    ap.add_argument("--layers", type=int, default=16, help="copies of the layer's weights, timed as one pass")
    ap.add_argument("--chunk-kb", type=int, default=16, help="KB a lane asks for with one bulk prefetch")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    a = ap.parse_args(argv)
    try:
        for p in a.plans:
            parse_plan(p)
    except ValueError as e:
        ap.error(f"--plans: {e}")
    if a.layers < 1 or a.chunk_kb < 1:
        ap.error("--layers and --chunk-kb must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("bench.l2_ahead times CUDA graphs: it needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}: {a.layers} layers' int4 GEMVs, plans {a.plans}, {a.chunk_kb} KB a lane")
    with open(a.out, "a") if a.out else contextlib.nullcontext() as f:
        rows = bench_plans(a.plans, a.layers, chunk=a.chunk_kb << 10, out=f)
    for r in rows:
        print(json.dumps(r))
    print(table(rows))


if __name__ == "__main__":
    main()
