"""What one dependent kernel boundary costs on this GPU: the floor under a decode step of N launches.

    python -m fastgemma.bench.floor [--programs 1,16,80,132,264,640] [--phases 256]

A decode step is a chain of ops in which every program of an op needs all of the previous op's
output. kernels/phase_floor.py's phase keeps only that: read the previous vector (2,560 fp32 values,
from L2), one dot with a row loaded before the wait, write a share of the next vector. No weights
stream, so its time is the boundary itself. Per launch style and program count:
- `graph`: one launch per phase, stream ordered, in a CUDA graph;
- `pdl`: the same with programmatic dependent launch (the engine's launches);
- `barrier`: one persistent launch, a grid barrier between phases (at most one program per
  multiprocessor: every program must be resident);
- `pdl_ahead`, `barrier_ahead`: as `pdl` and `barrier`, with a phase's streamed words (below) left in
  flight across its boundary and used after it (kernels/phase_floor.py).
`--no-work` times the boundary alone too (no loads, no stores). `--mb 4,8` adds phases that also
stream that many MB of weights each, read before the wait (a launch) or before the barrier that opens
the phase (one launch), from copies larger than the L2, beside those bytes alone at the copy bandwidth:
a phase that costs its bytes plus its boundary hides nothing, one that costs the larger of the two
hides the boundary under streaming. Each figure is the slope between
chains of n and 2n phases (us per phase; the graph's own launch taken out), each chain's final vector
checked against the twin (exact: each sum has one nonzero product).
Prints one JSON line per figure (--out: JSONL) and a markdown table last; `--step-launches N` adds
N x the figure: the boundaries' share of a step of N launches.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math

import torch

from ..kernels.phase_floor import (BASE_STYLES, MIN_WORDS, STYLES, WORDS, ahead_warps, phase_chain,
                                   phase_persistent, phase_ref, ring_weights, stream_buffers, stream_ref)


def _list_of(cast, what: str, least):
    """An argparse type: comma-separated values of `cast`, each >= least."""
    def parse(text: str) -> tuple:
        try:
            vals = tuple(cast(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not vals or min(vals) < least:
            raise argparse.ArgumentTypeError(f"expected {what} >= {least}, got {text!r}")
        return vals
    return parse


def _styles(text: str) -> tuple[str, ...]:
    vals = tuple(text.split(","))
    bad = [v for v in vals if v not in STYLES]
    if bad:
        raise argparse.ArgumentTypeError(f"styles are {', '.join(STYLES)}; got {', '.join(bad)}")
    return vals


MAX_BLOCKS = 64  # streamed blocks a program of one phase reads (16 KB each, unrolled in the kernel)


def stream_layout(mb: float, programs: int, l2_bytes: int, min_words: int = MIN_WORDS) -> tuple[int, int, int]:
    """(blocks per program, words a block, copies) that stream ~mb MB per phase over `programs` programs:
    blocks of 16 KB, or one smaller power-of-two block (at least `min_words`) where a program's share is
    under 16 KB; copies enough that a phase's words are not in the L2 from the last time (twice its size)."""
    need = mb * 1e6 / (programs * 4)  # words a program
    words = WORDS
    while words > min_words and need < words:
        words //= 2
    blocks = max(1, round(need / words))
    if blocks > MAX_BLOCKS:
        raise ValueError(f"{mb} MB a phase over {programs} programs is {blocks} blocks of {WORDS * 4 // 1024} KB a "
                         f"program; at most {MAX_BLOCKS}: more programs or fewer MB")
    return blocks, words, max(2, math.ceil(2 * l2_bytes / (programs * blocks * words * 4)))


def stream_shape(mb: float, programs: int, l2_bytes: int) -> tuple[int, int]:
    """(blocks per program, copies) of `stream_layout` in 16 KB blocks only (bench_floor's phases)."""
    blocks, _, copies = stream_layout(mb, programs, l2_bytes, min_words=WORDS)
    return blocks, copies


def bench_floor(programs=(1, 16, 80, 132, 264, 640), styles=BASE_STYLES, phases: int = 256, hidden: int = 2560,
                works=(True,), mbs=(0.0,), timer=None, device: str = "cuda", out=None) -> list[dict]:
    """One dict per (MB streamed a phase, work, style, programs): us per phase, or `skipped` with the
    reason. `mbs`: weights each phase reads before its wait (0: none); the row's `mb` is what the
    whole blocks make. `timer`: fn -> median microseconds (default: CUDA graphs, 20 ms of replays)."""
    from ..kernels.bench_util import timer_or_graphs

    dev = torch.device(device)
    timer = timer_or_graphs(timer, "bench.floor")
    # a grid barrier opens only when every program has arrived: all must be resident (the
    # interpreter runs one program after another, so one)
    props = torch.cuda.get_device_properties(dev) if dev.type == "cuda" else None
    resident = props.multi_processor_count if props else 1
    l2 = props.L2_cache_size if props else 0
    gen = torch.Generator(device="cpu").manual_seed(0)
    x0 = torch.randn(hidden, generator=gen).to(dev)
    bar = torch.zeros(2, dtype=torch.int32, device=dev)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    rows = []
    for mb in mbs:
        for work in works:
            for style in styles:
                for P in programs:
                    row = dict(style=style, work=work, programs=P, phases=phases, hidden=hidden, mb=0.0,
                               mb_asked=float(mb))
                    if style.startswith("barrier") and P > resident:
                        row["skipped"] = f"a barrier needs every program resident: at most {resident} here"
                        rows.append(row)
                        continue
                    stream = None
                    if mb > 0:
                        try:
                            blocks, copies = stream_shape(mb, P, l2)
                            ahead_warps(blocks, style.endswith("_ahead"))
                        except ValueError as e:
                            rows.append(dict(row, skipped=str(e)))
                            continue
                        stream = stream_buffers(copies, P, blocks, dev)
                        row.update(mb=P * blocks * WORDS * 4 / 1e6, copies=copies)
                    rows.append(_time_phases(row, x0, bar, err, stream, timer))
                    line = json.dumps(rows[-1])
                    print(line, flush=True)
                    if out is not None:
                        out.write(line + "\n")
                        out.flush()
    return rows


def copies_summed(style: str, n: int, copies: int) -> list[int]:
    """The copies whose words a chain of n phases leaves summed in the sink: each phase's in one launch
    (`barrier` reads a phase n's too, before its last barrier), the last phase's with a launch each."""
    if style == "barrier":
        return [i % copies for i in range(n + 1)]
    if style == "barrier_ahead":
        return [i % copies for i in range(n)]
    return [(n - 1) % copies]


def _time_phases(row, x0, bar, err, stream, timer) -> dict:
    """The row's chains checked once (the vector against the twin, the sink against its sums), then
    timed: us per phase = the slope between n and 2n phases."""
    style, work, P, n = row["style"], row["work"], row["programs"], row["phases"]
    w = ring_weights(P, x0.numel(), x0.device)
    x = torch.zeros(2, x0.numel(), dtype=torch.float32, device=x0.device)

    def run(m):
        if style.startswith("barrier"):
            phase_persistent(x, w, m, bar, err, work=work, stream=stream, ahead=style == "barrier_ahead")
        else:
            phase_chain(x, w, m, style, work=work, stream=stream)

    x[0].copy_(x0)
    run(n)
    if work and not torch.equal(x[n % 2], phase_ref(torch.stack([x0, x0]), w, n)):
        raise RuntimeError(f"{style}, {P} programs: the vector after {n} phases differs from the twin's "
                           f"(a phase read a stale vector?)")
    if stream is not None:
        big, sink = stream
        if not torch.equal(sink, stream_ref(big, copies_summed(style, n, big.shape[0]))):
            raise RuntimeError(f"{style}, {P} programs: the streamed words' sums differ from the twin's")
    t1, t2 = timer(lambda: run(n)), timer(lambda: run(2 * n))
    if int(err.item()):
        raise RuntimeError(f"a grid barrier gave up waiting with {P} programs (not all resident?)")
    return dict(row, us_per_phase=(t2 - t1) / n)


def load_floor(path, style: str = "pdl") -> list[tuple[int, float]]:
    """bench.floor's JSONL -> sorted (programs, us per phase) of `style`'s read + dot + write figures
    (a later line for the same program count replaces an earlier one)."""
    if style not in STYLES:
        raise ValueError(f"floor style is one of {', '.join(STYLES)}; got {style!r}")
    pts = {}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON line of bench.floor ({e.msg})") from None
            if r.get("style") == style and r.get("work") and not r.get("mb") and "us_per_phase" in r:
                pts[int(r["programs"])] = float(r["us_per_phase"])
    if not pts:
        raise ValueError(f"{path}: no {style} figures with work in it (write one with "
                         f"`python -m fastgemma.bench.floor --styles {style} --out FILE`)")
    return sorted(pts.items())


def floor_option(path, traced: bool, trace_flag: str):
    """A bench's `--floor FILE`: None when not given, else the file's PDL figures; SystemExit with the
    reason when the bench traces nothing (`trace_flag` is the option that would) or the file is unusable."""
    if path is None:
        return None
    if not traced:
        raise SystemExit(f"--floor adds columns to {trace_flag}'s table: give {trace_flag} N too")
    try:
        return load_floor(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--floor: {e}") from e


def floor_us(points: list[tuple[int, float]], programs: int) -> float:
    """The boundary of a launch of `programs` programs: linear between the measured program counts,
    the nearest measured figure outside them (a lower bound above the largest count)."""
    if programs <= points[0][0]:
        return points[0][1]
    for (a, fa), (b, fb) in zip(points, points[1:]):
        if programs <= b:
            return fa + (fb - fa) * (programs - a) / (b - a)
    return points[-1][1]


def table(rows: list[dict], step_launches: int | None = None, copy_gbs: float | None = None) -> str:
    """Markdown: one line per (MB asked a phase, style, work), one column per program count, us per
    phase (with streaming: and the MB the whole blocks make); with `copy_gbs`, a line per MB asked of
    those bytes alone at that bandwidth."""
    progs = sorted({r["programs"] for r in rows})
    keys = list(dict.fromkeys((r.get("mb_asked", 0.0), r["style"], r["work"]) for r in rows))
    cell = {(r.get("mb_asked", 0.0), r["style"], r["work"], r["programs"]): r for r in rows}
    head = "| MB a phase | style | phase | " + " | ".join(f"{p} programs" for p in progs) + " |"
    lines = [head, "|" + "---|" * (3 + len(progs))]
    shown = set()
    for mb, style, work in keys:
        vals = []
        for p in progs:
            r = cell.get((mb, style, work, p))
            if r is None or "skipped" in r:
                vals.append("" if r is None else "-")
            else:
                vals.append(f"{r['us_per_phase']:.2f}" + (f" ({r['mb']:.3g} MB)" if r["mb"] else ""))
        phase = "read + dot + write" if work else "boundary only"
        lines.append(f"| {mb:g} | {style} | {phase} | " + " | ".join(vals) + " |")
        if mb and copy_gbs and mb not in shown:
            shown.add(mb)
            alone = [next((f"{1e3 * r['mb'] / copy_gbs:.2f}" for r in rows if r.get("mb_asked") == mb
                           and r["programs"] == p and r.get("mb")), "") for p in progs]
            lines.append(f"| {mb:g} | the bytes alone at {copy_gbs / 1e3:.2f} TB/s | | " + " | ".join(alone) + " |")
    if step_launches:
        lines.append("")
        lines.append(f"x {step_launches} launches (us): " + "; ".join(
            f"{r['style']} {'work' if r['work'] else 'empty'} {r['programs']}: {r['us_per_phase'] * step_launches:.0f}"
            for r in rows if "us_per_phase" in r and not r["mb"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=_list_of(int, "program counts", 1), default=(1, 16, 80, 132, 264, 640),
                    help="programs per phase")
    ap.add_argument("--styles", type=_styles, default=BASE_STYLES,
                    help=f"launch styles, of {', '.join(STYLES)} (default: {','.join(BASE_STYLES)})")
    ap.add_argument("--phases", type=int, default=256, help="n: chains of n and 2n phases are timed")
    ap.add_argument("--hidden", type=int, default=2560, help="values in the vector each phase reads")
    ap.add_argument("--no-work", action="store_true", help="also time the boundary alone (no loads, no stores)")
    ap.add_argument("--mb", type=_list_of(float, "MB figures", 0), default=(0.0,),
                    help="weights each phase streams before its wait, MB, comma-separated (0: none; e.g. 0,4,8)")
    ap.add_argument("--step-launches", type=int, default=None, help="print each figure x this launch count")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    a = ap.parse_args(argv)
    if a.phases < 1 or a.hidden < 1:
        ap.error("--phases and --hidden must be positive")
    works = (True, False) if a.no_work else (True,)
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    copy_gbs = None
    if cuda and any(a.mb):
        from ..metrics.memory import copy_bandwidth_gbs
        copy_gbs = copy_bandwidth_gbs(torch.device("cuda"))
    print(f"{name}: dependent phases of {a.hidden} fp32 values, chains of {a.phases} and {2 * a.phases}"
          + (f"; copy bandwidth {copy_gbs / 1e3:.2f} TB/s" if copy_gbs else ""))
    with open(a.out, "a") if a.out else contextlib.nullcontext() as f:
        rows = bench_floor(a.programs, a.styles, a.phases, a.hidden, works, a.mb, out=f)
    print(table(rows, a.step_launches, copy_gbs))


if __name__ == "__main__":
    main()
