"""A decode step's chain of dependent phases at its own shapes: the floor under a step of one launch
per op, measured instead of summed from single phases.

    python -m fastgemma.bench.floor_step [--layer 96:4.2,64:0,...] [--layers 42] [--styles pdl,pdl_ahead]

Each entry of --layer is one launch of a layer, PROGRAMS:MB (the MB of weights it streams, 0: none), in
launch order, and the layer repeats --layers times (kernels/phase_floor.phase_sequence: every phase reads
the whole vector the phase before wrote, takes one dot and writes its share; its words come from copies
larger than the L2, in blocks of 512 bytes to 16 KB a program). The default is the int4 frontier step's
sliding store layer, approximately: the tensor-core kernels' grids and bytes (q|k|v 96 programs, 4.2 MB;
the attention's split kernel 64, none; o 80, 2.8 MB; gate|up 640, 27.8 MB; down 80, 13.9 MB), the bf16
PLE gate (256, 1.3 MB) and the PLE projection (160, 0.35 MB), 42 times. Per launch style the chains of
L and 2L layers are timed in CUDA graphs (each checked first: its vector and streamed sums against the
twin's) and the slope is a layer's cost; times --layers, the step's floor at these shapes, beside its
bytes alone at the copy bandwidth. Prints one JSON line per style (--out: JSONL) and a table last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math

import torch

from ..kernels.phase_floor import (CHAIN_STYLES, PhaseError, ahead_warps, phase_sequence, ring_weights, sequence_ref,
                                   stream_buffers, stream_ref)
from .floor import copies_summed, stream_layout

FRONTIER_LAYER = "96:4.2,64:0,80:2.8,640:27.8,80:13.9,256:1.3,160:0.35"


def parse_layer(text: str) -> list[tuple[int, float]]:
    """'P:MB,P:MB,...' -> [(programs, MB)]: programs >= 1, MB >= 0."""
    out = []
    for item in text.split(","):
        try:
            p, mb = item.split(":")
            out.append((int(p), float(mb)))
        except ValueError:
            raise ValueError(f"layer entry {item!r}: PROGRAMS:MB, e.g. 640:27.8") from None
        if out[-1][0] < 1 or out[-1][1] < 0 or not math.isfinite(out[-1][1]):
            raise ValueError(f"layer entry {item!r}: programs >= 1 and MB >= 0")
    return out


def build_kinds(layer, hidden: int, device, l2_bytes: int, ahead: bool) -> list:
    """One (w, stream) per entry of the layer (kernels/phase_floor.phase_sequence's kinds)."""
    kinds = []
    for j, (p, mb) in enumerate(layer):
        if p > hidden:
            raise ValueError(f"{p} programs share {hidden} values: at most {hidden}")
        stream = None
        if mb > 0:
            blocks, words, copies = stream_layout(mb, p, l2_bytes)
            ahead_warps(blocks, ahead, words)
            stream = stream_buffers(copies, p, blocks, device, seed=j, words=words)
        kinds.append((ring_weights(p, hidden, device), stream))
    return kinds


def bench_step(layer, layers: int = 42, styles=("pdl", "pdl_ahead"), hidden: int = 2560, timer=None,
               device: str = "cuda", out=None) -> list[dict]:
    """One dict per style: us a layer (the slope between chains of `layers` and 2 x `layers` layers),
    the step (x layers), the MB a layer streams (what whole blocks make); `skipped` with the reason where
    the layer does not fit the style."""
    from ..kernels.bench_util import timer_or_graphs

    dev = torch.device(device)
    timer = timer_or_graphs(timer, "bench.floor_step")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 0
    x0 = torch.randn(hidden, generator=torch.Generator(device="cpu").manual_seed(0)).to(dev)
    rows = []
    for style in styles:
        row = dict(style=style, layers=layers, launches=layers * len(layer), hidden=hidden,
                   layer=",".join(f"{p}:{mb:g}" for p, mb in layer))
        try:
            kinds = build_kinds(layer, hidden, dev, l2, style == "pdl_ahead")
        except (ValueError, PhaseError) as e:
            rows.append(dict(row, skipped=str(e)))
            continue
        row["mb_layer"] = sum(s[0][0].numel() * 4 for _, s in kinds if s is not None) / 1e6  # big[0]: one copy
        rows.append(_time_sequence(row, x0, kinds, style, timer))
        if out is not None:
            out.write(json.dumps(rows[-1]) + "\n")
            out.flush()
    return rows


def _time_sequence(row, x0, kinds, style, timer) -> dict:
    layers = row["layers"]
    x = torch.zeros(2, x0.numel(), dtype=torch.float32, device=x0.device)
    x[0].copy_(x0)
    phase_sequence(x, kinds, layers, style)
    want = sequence_ref(torch.stack([x0, x0]), [w for _ in range(layers) for w, _ in kinds])
    if not torch.equal(x[(layers * len(kinds)) % 2], want):
        raise RuntimeError(f"{style}: the vector after {layers} layers differs from the twin's (a phase read a "
                           f"stale vector?)")
    for w, stream in kinds:
        if stream is None:
            continue
        big, sink = stream
        if not torch.equal(sink, stream_ref(big, copies_summed(style, layers, big.shape[0]))):
            raise RuntimeError(f"{style}: the streamed words' sums of a {w.shape[0]}-program phase differ from the "
                               f"twin's")
    t1 = timer(lambda: phase_sequence(x, kinds, layers, style))
    t2 = timer(lambda: phase_sequence(x, kinds, 2 * layers, style))
    us = (t2 - t1) / layers
    return dict(row, us_layer=us, step_us=us * layers)


def table(rows, copy_gbs: float | None = None) -> str:
    """Markdown: one line per style; with `copy_gbs`, the step's bytes alone at that bandwidth."""
    lines = ["| style | launches | MB a layer | us a layer | step ms | tok/s at that step | the bytes alone, ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['style']} | {r['launches']} | | skipped: {r['skipped']} | | | |")
            continue
        alone = f"{r['mb_layer'] * r['layers'] / copy_gbs:.3f}" if copy_gbs else ""
        tps = f"{1e6 / r['step_us']:,.0f}" if r["step_us"] > 0 else ""
        lines.append(f"| {r['style']} | {r['launches']} | {r['mb_layer']:.2f} | {r['us_layer']:.2f} | "
                     f"{r['step_us'] / 1e3:.3f} | {tps} | {alone} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", default=FRONTIER_LAYER,
                    help="a layer's launches in order, PROGRAMS:MB each (default: the int4 frontier step's store layer)")
    ap.add_argument("--layers", type=int, default=42, help="layers a step (chains of L and 2L are timed)")
    ap.add_argument("--styles", default="pdl,pdl_ahead", help=f"launch styles, of {', '.join(CHAIN_STYLES)}")
    ap.add_argument("--hidden", type=int, default=2560, help="values in the vector each phase reads")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    a = ap.parse_args(argv)
    try:
        layer = parse_layer(a.layer)
    except ValueError as e:
        ap.error(f"--layer: {e}")
    styles = tuple(a.styles.split(","))
    bad = [s for s in styles if s not in CHAIN_STYLES]
    if bad:
        ap.error(f"--styles: of {', '.join(CHAIN_STYLES)}; got {', '.join(bad)}")
    if a.layers < 1 or a.hidden < 1:
        ap.error("--layers and --hidden must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("bench.floor_step times CUDA graphs: it needs a CUDA device")
    from ..metrics.memory import copy_bandwidth_gbs

    copy_gbs = copy_bandwidth_gbs(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: {a.layers} layers of {len(layer)} launches ({a.layer}); copy bandwidth "
          f"{copy_gbs / 1e3:.2f} TB/s")
    with open(a.out, "a") if a.out else contextlib.nullcontext() as f:
        rows = bench_step(layer, a.layers, styles, a.hidden, out=f)
    for r in rows:
        print(json.dumps(r))
    print(table(rows, copy_gbs))


if __name__ == "__main__":
    main()
