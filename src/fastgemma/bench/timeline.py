"""Which kernels a replayed step waits for: the kernels' own times and their share of the critical path.

Under PDL (and with graphs) a kernel starts before the previous one ends, so summing kernel times
(bench.profile) counts every overlap twice and says little about what sets the step's length. Here
each kernel of one stream is charged with how much later the stream's work finishes because of it:
`inc` = max(0, end - the latest end before it). The incs of a call add up to its span, first start
to last end; a kernel hidden under its predecessor costs 0, the gap before a late start is charged to
the kernel that starts late (`gap`). Kernels are told apart by name and grid (the same Triton kernel
runs several shapes).

`trace_kernels(fn, calls)` profiles `calls` calls of fn() (CUPTI kernel records, CUDA graphs included)
and returns one list of kernels per call; `charge` adds inc / gap / overlap; `group` sums them per
(name, grid); `print_groups` prints the table. bench.stack --timeline runs it on the captured step.
`with_floor` adds what bench.floor measured a dependent launch of each grid to cost in a chain of
such launches (its boundary), so the table says how much each kernel takes above it (bench.stack /
bench.spec --floor FILE; a kernel that reads less than the floor's phase can come in under it).
"""
from __future__ import annotations

import collections
import json
import math
import os
import tempfile


def kernels_from_trace(trace: dict) -> list[dict]:
    """A Chrome trace (torch.profiler's export) -> its GPU kernels in start order: name, grid, block,
    regs, start and dur in us."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        out.append(dict(name=e["name"], grid=tuple(args.get("grid", ())), block=tuple(args.get("block", ())),
                        regs=args.get("registers per thread"), start=float(e["ts"]), dur=float(e["dur"])))
    return sorted(out, key=lambda k: k["start"])


def split_calls(kernels: list[dict], calls: int) -> list[list[dict]]:
    """The kernels of `calls` identical calls -> one list per call (each the same count)."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    if not kernels or len(kernels) % calls:
        raise ValueError(f"{len(kernels)} kernels do not split into {calls} equal calls "
                         "(did every call launch the same kernels?)")
    n = len(kernels) // calls
    return [kernels[i * n:(i + 1) * n] for i in range(calls)]


def charge(kernels: list[dict]) -> list[dict]:
    """Per kernel (start order, one stream): inc, the later end it causes; gap, the idle time before
    its start; overlap, how long it ran beside the work before it. Copies; times relative to the first start."""
    out, frontier = [], None
    t0 = kernels[0]["start"] if kernels else 0.0
    for k in kernels:
        end = k["start"] + k["dur"]
        if frontier is None:
            inc, gap, overlap = k["dur"], 0.0, 0.0
        else:
            inc = max(0.0, end - frontier)
            gap = max(0.0, k["start"] - frontier)
            overlap = max(0.0, min(frontier, end) - k["start"])
        frontier = end if frontier is None else max(frontier, end)
        out.append(dict(k, t=k["start"] - t0, inc=inc, gap=gap, overlap=overlap))
    return out


def span(charged: list[dict]) -> float:
    """First start to last end of one call (= the sum of its incs)."""
    return sum(k["inc"] for k in charged)


def group(calls: list[list[dict]]) -> list[dict]:
    """Charged calls -> per (name, grid), per call: n, dur, inc, gap; sorted by inc."""
    acc = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for ks in calls:
        for k in ks:
            a = acc[(k["name"], k["grid"])]
            a[0] += 1
            a[1] += k["dur"]
            a[2] += k["inc"]
            a[3] += k["gap"]
    n = len(calls)
    rows = [dict(name=name, grid=list(grid), n=v[0] / n, dur_us=v[1] / n, inc_us=v[2] / n, gap_us=v[3] / n)
            for (name, grid), v in acc.items()]
    return sorted(rows, key=lambda r: -r["inc_us"])


def trace_kernels(fn, calls: int) -> list[list[dict]]:
    """`calls` calls of fn() under the CUDA profiler -> their kernels, charged, one list per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="fastgemma-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.remove(path)
    return [charge(ks) for ks in split_calls(kernels_from_trace(trace), calls)]


def summarize(calls: list[list[dict]], top: int = 25) -> dict:
    """Per call: kernels, span, kernel time, gaps; the `top` groups by inc; the median call's kernels."""
    spans = sorted((span(ks), i) for i, ks in enumerate(calls))
    mid = calls[spans[len(spans) // 2][1]]
    n = len(calls)
    return dict(kernels=len(mid), span_us=sum(s for s, _ in spans) / n,
                kernel_us=sum(k["dur"] for ks in calls for k in ks) / n,
                gap_us=sum(k["gap"] for ks in calls for k in ks) / n,
                groups=group(calls)[:top],
                kernels_of_median_call=[dict(name=k["name"], grid=list(k["grid"]), t=round(k["t"], 3),
                                             dur=round(k["dur"], 3), inc=round(k["inc"], 3)) for k in mid])


def with_floor(s: dict, points: list[tuple[int, float]]) -> dict:
    """A summary with each group's boundaries at bench.floor's figures (`boundary_us`: n x the figure
    of its grid's program count) and the median call's in all (`boundary_us` of the summary)."""
    from .floor import floor_us

    groups = [dict(g, boundary_us=g["n"] * floor_us(points, math.prod(g["grid"]))) for g in s["groups"]]
    total = sum(floor_us(points, math.prod(k["grid"])) for k in s["kernels_of_median_call"])
    return dict(s, groups=groups, boundary_us=total)


def print_groups(s: dict, title: str = "") -> None:
    """The summary's table; with `with_floor`'s figures, each group's boundaries and what it takes above them."""
    floor = "boundary_us" in s
    print(f"\n### timeline{': ' + title if title else ''}: {s['kernels']} kernels, span {s['span_us']:.1f} us, "
          f"kernel time {s['kernel_us']:.1f} us, idle gaps {s['gap_us']:.1f} us"
          + (f", boundaries {s['boundary_us']:.1f} us" if floor else ""))
    extra = " boundaries (floor) | above them |" if floor else ""
    print("| kernel | grid | n/call | us (own) | us on the critical path | idle before |" + extra)
    print("|---|---|---|---|---|---|" + ("---|---|" if floor else ""))
    for r in s["groups"]:
        grid = "x".join(str(g) for g in r["grid"])
        line = f"| {r['name'][:60]} | {grid} | {r['n']:.0f} | {r['dur_us']:.1f} | {r['inc_us']:.1f} | {r['gap_us']:.1f} |"
        if floor:
            line += f" {r['boundary_us']:.1f} | {r['inc_us'] - r['boundary_us']:.1f} |"
        print(line)
