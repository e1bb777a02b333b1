"""What one dependent kernel boundary costs on this GPU: the floor under a decode step of N launches.

    python -m fastgemma.bench.floor [--programs 1,16,80,132,264,640] [--phases 256]

A decode step is a chain of ops in which every program of an op needs all of the previous op's
output. kernels/phase_floor.py's phase keeps only that: read the previous vector (2,560 fp32 values,
from L2), one dot with a row loaded before the wait, write a share of the next vector. No weights
stream, so its time is the boundary itself. Per launch style and program count:
- `graph`: one launch per phase, stream ordered, in a CUDA graph;
- `pdl`: the same with programmatic dependent launch (the engine's launches);
- `barrier`: one persistent launch, a grid barrier between phases (at most one program per
  multiprocessor: every program must be resident).
`--no-work` times the boundary alone too (no loads, no stores). Each figure is the slope between
chains of n and 2n phases (us per phase; the graph's own launch taken out), each chain's final vector
checked against the twin (exact: each sum has one nonzero product).
Prints one JSON line per figure (--out: JSONL) and a markdown table last; `--step-launches N` adds
N x the figure: the boundaries' share of a step of N launches.
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch

from ..kernels.phase_floor import STYLES, phase_chain, phase_persistent, phase_ref, ring_weights


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _styles(text: str) -> tuple[str, ...]:
    vals = tuple(text.split(","))
    bad = [v for v in vals if v not in STYLES]
    if bad:
        raise argparse.ArgumentTypeError(f"styles are {', '.join(STYLES)}; got {', '.join(bad)}")
    return vals


def bench_floor(programs=(1, 16, 80, 132, 264, 640), styles=STYLES, phases: int = 256, hidden: int = 2560,
                works=(True,), timer=None, device: str = "cuda", out=None) -> list[dict]:
    """One dict per (work, style, programs): us per phase, or `skipped` with the reason. `timer`:
    fn -> median microseconds (default: CUDA graphs, 20 ms of replays)."""
    from ..kernels.bench_util import timer_or_graphs

    dev = torch.device(device)
    timer = timer_or_graphs(timer, "bench.floor")
    # a grid barrier opens only when every program has arrived: all must be resident (the
    # interpreter runs one program after another, so one)
    resident = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    x0 = torch.randn(hidden, generator=gen).to(dev)
    bar = torch.zeros(2, dtype=torch.int32, device=dev)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    rows = []
    for work in works:
        for style in styles:
            for P in programs:
                row = dict(style=style, work=work, programs=P, phases=phases, hidden=hidden)
                if style == "barrier" and P > resident:
                    row["skipped"] = f"a barrier needs every program resident: at most {resident} here"
                    rows.append(row)
                    continue
                w = ring_weights(P, hidden, dev)
                x = torch.zeros(2, hidden, dtype=torch.float32, device=dev)

                def run(n, x=x, w=w, style=style, work=work):
                    if style == "barrier":
                        phase_persistent(x, w, n, bar, err, work=work)
                    else:
                        phase_chain(x, w, n, style, work=work)

                if work:
                    x[0].copy_(x0)
                    run(phases)
                    want = phase_ref(torch.stack([x0, x0]), w, phases)
                    if not torch.equal(x[phases % 2], want):
                        raise RuntimeError(f"{style}, {P} programs: the vector after {phases} phases differs "
                                           f"from the twin's (a phase read a stale vector?)")
                t1, t2 = timer(lambda: run(phases)), timer(lambda: run(2 * phases))
                if int(err.item()):
                    raise RuntimeError(f"a grid barrier gave up waiting with {P} programs (not all resident?)")
                row["us_per_phase"] = (t2 - t1) / phases
                rows.append(row)
                line = json.dumps(row)
                print(line, flush=True)
                if out is not None:
                    out.write(line + "\n")
                    out.flush()
    return rows


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
            if r.get("style") == style and r.get("work") and "us_per_phase" in r:
                pts[int(r["programs"])] = float(r["us_per_phase"])
    if not pts:
        raise ValueError(f"{path}: no {style} figures with work in it (write one with "
                         f"`python -m fastgemma.bench.floor --styles {style} --out FILE`)")
    return sorted(pts.items())


def floor_us(points: list[tuple[int, float]], programs: int) -> float:
    """The boundary of a launch of `programs` programs: linear between the measured program counts,
    the nearest measured figure outside them (a lower bound above the largest count)."""
    if programs <= points[0][0]:
        return points[0][1]
    for (a, fa), (b, fb) in zip(points, points[1:]):
        if programs <= b:
            return fa + (fb - fa) * (programs - a) / (b - a)
    return points[-1][1]


def table(rows: list[dict], step_launches: int | None = None) -> str:
    """Markdown: one line per (style, work), one column per program count, us per phase."""
    progs = sorted({r["programs"] for r in rows})
    keys = list(dict.fromkeys((r["style"], r["work"]) for r in rows))
    cell = {(r["style"], r["work"], r["programs"]): r for r in rows}
    head = "| style | phase | " + " | ".join(f"{p} programs" for p in progs) + " |"
    lines = [head, "|" + "---|" * (2 + len(progs))]
    for style, work in keys:
        vals = []
        for p in progs:
            r = cell.get((style, work, p))
            vals.append("" if r is None else "-" if "skipped" in r else f"{r['us_per_phase']:.2f}")
        lines.append(f"| {style} | {'read + dot + write' if work else 'boundary only'} | " + " | ".join(vals) + " |")
    if step_launches:
        lines.append("")
        lines.append(f"x {step_launches} launches (us): " + "; ".join(
            f"{r['style']} {'work' if r['work'] else 'empty'} {r['programs']}: {r['us_per_phase'] * step_launches:.0f}"
            for r in rows if "us_per_phase" in r))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=_ints, default=(1, 16, 80, 132, 264, 640), help="programs per phase")
    ap.add_argument("--styles", type=_styles, default=STYLES, help=f"launch styles, of {', '.join(STYLES)}")
    ap.add_argument("--phases", type=int, default=256, help="n: chains of n and 2n phases are timed")
    ap.add_argument("--hidden", type=int, default=2560, help="values in the vector each phase reads")
    ap.add_argument("--no-work", action="store_true", help="also time the boundary alone (no loads, no stores)")
    ap.add_argument("--step-launches", type=int, default=None, help="print each figure x this launch count")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    a = ap.parse_args(argv)
    if a.phases < 1 or a.hidden < 1:
        ap.error("--phases and --hidden must be positive")
    works = (True, False) if a.no_work else (True,)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{name}: dependent phases of {a.hidden} fp32 values, chains of {a.phases} and {2 * a.phases}")
    with open(a.out, "a") if a.out else contextlib.nullcontext() as f:
        rows = bench_floor(a.programs, a.styles, a.phases, a.hidden, works, out=f)
    print(table(rows, a.step_launches))


if __name__ == "__main__":
    main()
