"""Hardware counters of the int4 kernels at E4B shapes, through Nsight Compute: is a kernel waiting
on memory, on its instruction issue, or short of resident warps?

    python -m fastgemma.bench.counters [--ms 1,8] [--shapes gate|up,down] [--separate] [--mma 2x4d2,...]
                                       [--out DIR]

runs itself under `ncu --clock-control none` (the clocks as they are; ncu flushes the caches before
each profiled launch) with one launch per (shape, rows): at one row the fused GEMV that fuse=layers
launches for that shape (`fused_w4a16`, with its prologue / epilogue), at 2..16 rows the per-group
kernel of the verify pass (`w4a16_matmul`, table tiles, packed scale / zero words unless
--separate; gate|up with its GeGLU epilogue); with --mma, the tensor-core kernel
(kernels/mma_w4a16.py) instead, once per config given (TxW[dD][iI][sS][pR][f][nH]; those that do not fit
a shape are refused). Prints one row per launch: time, DRAM throughput,
issue slots busy, warps resident, the top stall reasons per issued instruction, instructions per
weight (thread instructions: warp instructions x 32 / weights). `--launch` runs the launches alone
(what ncu profiles). The H200 machines have ncu (KINDS.md: it reads counters on Firecracker).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

METRICS = {
    "us": "gpu__time_duration.sum",
    "dram %": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "issue %": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warps %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "GHz": "sm__cycles_elapsed.avg.per_second",
    "inst": "smsp__inst_executed.sum",
    "smem conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
}
STALLS = ("long_scoreboard", "wait", "barrier", "short_scoreboard", "math_pipe_throttle", "not_selected",
          "dispatch_stall", "mio_throttle", "lg_throttle", "no_instruction")
_STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
KERNELS = "regex:_group_mma_kernel|_fused_w4a16_kernel|_gemv_kernel|_mma_kernel|_mma_w4a16_kernel|_mma_stream_kernel"


def _multi_row() -> dict:
    """The verify pass's shapes (N, K, epilogue) at 2..16 rows: fused_w4a16.E4B_CASES' shapes, gate|up
    with its GeGLU epilogue (the norms of the one-row prologues run apart there)."""
    from ..kernels.fused_w4a16 import E4B_CASES

    return {n: (N, K, "geglu" if mode == "geglu" else "none") for n, (N, K, mode) in E4B_CASES.items()}


def _shape(name: str, m: int) -> tuple[int, int, str]:
    from ..kernels.fused_w4a16 import E4B_CASES

    return (E4B_CASES if m == 1 else _multi_row())[name]


def metric_names() -> list[str]:
    return list(METRICS.values()) + [_STALL.format(s) for s in STALLS]


def plan(ms: list[int], shapes: list[str] | None, mma: list[str] | None = None) -> list[tuple]:
    """(shape, rows) launches in order, or (shape, rows, config) per tensor-core config in `mma`;
    shape names from fused_w4a16.E4B_CASES."""
    from ..kernels.fused_w4a16 import E4B_CASES
    from ..kernels.mma_table import MAX_ROWS, config_problem, parse_config

    out = []
    for m in ms:
        names = shapes or list(E4B_CASES)
        bad = [n for n in names if n not in E4B_CASES]
        if bad:
            raise SystemExit(f"--shapes: unknown at {m} row(s): {', '.join(bad)}; known: {', '.join(E4B_CASES)}")
        if not 1 <= m <= 16:
            raise SystemExit(f"--ms: rows from 1 to 16 (the decode and verify kernels), got {m}")
        if not mma:
            out += [(n, m) for n in names]
            continue
        if m > MAX_ROWS:
            raise SystemExit(f"--mma: the tensor-core kernel takes 1 to {MAX_ROWS} rows, got {m}")
        for n in names:
            N, K, epi = _shape(n, m)
            for c in mma:
                why = config_problem(parse_config(c), N, K, 128, "geglu" if epi == "geglu" else "none")
                if why:
                    raise SystemExit(f"--mma {c} on {n}: {why}")
                out.append((n, m, c))
    return out


def launch(launches: list[tuple], packed: bool = True) -> None:
    """One launch per (shape, rows[, tensor-core config]), in order, on fresh weights (what ncu profiles)."""
    import torch

    from ..kernels.fused_w4a16 import case_inputs, fused_w4a16
    from ..kernels.int4_pack import pack_int4, pack_scale_zero, quantize_int4
    from ..kernels.mma_table import parse_config
    from ..kernels.mma_w4a16 import MmaWeight, mma_w4a16
    from ..kernels.w4a16 import w4a16_matmul

    if not torch.cuda.is_available():
        raise SystemExit("bench.counters launches CUDA kernels; no CUDA device here")
    gen = torch.Generator(device="cuda").manual_seed(0)
    vec = lambda m, n: torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    for name, m, *cfg in launches:
        N, K, mode = _shape(name, m)
        q, s, z = quantize_int4(vec(N, K) * 0.02, 128)
        qw = pack_int4(q)
        if cfg:
            epi = "geglu" if mode == "geglu" else "none"
            c = parse_config(cfg[0])
            mma_w4a16(vec(m, K), MmaWeight.from_codes(q, s, z, 128, pairs=c.pairs), epi, c)
        elif m == 1:  # the fused GEMV as fuse=layers launches it for this shape
            fused_w4a16(vec(1, K), qw, s, z, 128, eps=1e-6, **case_inputs(mode, K, lambda n: vec(1, n)))
        else:
            w4a16_matmul(vec(m, K), qw, s, z, 128, epilogue=mode, sz=pack_scale_zero(s, z) if packed else None)
        torch.cuda.synchronize()


def _num(v: str) -> float:
    return float(v.replace(",", ""))


def parse(text: str) -> list[dict]:
    """ncu's plain report -> one dict per profiled launch: kernel, grid, block, then each metric's
    value by its full name (numbers; thousands separators dropped)."""
    rows = []
    head = re.compile(r"^\s+(\S+) \(([\d, ]+)\)x\(([\d, ]+)\), Context")
    line = re.compile(r"^\s+([a-z0-9_]+__[\w.]+)\s+(?:\S+\s+)?([\d,.]+)\s*$")
    for t in text.splitlines():
        h = head.match(t)
        if h:
            rows.append(dict(kernel=h.group(1), grid=h.group(2).replace(" ", ""), block=h.group(3).replace(" ", "")))
            continue
        mm = line.match(t)
        if mm and rows:
            rows[-1][mm.group(1)] = _num(mm.group(2))
    return rows


def table(rows: list[dict], launches: list[tuple[str, int]]) -> str:
    """The rows labelled by launch order (shape, rows, weights) as a markdown table."""
    if len(rows) != len(launches):
        raise ValueError(f"ncu profiled {len(rows)} launches, {len(launches)} were planned")
    cols = ["shape", "rows", "kernel", "grid x block"] + list(METRICS) + ["inst / weight"] + list(STALLS)
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    def fmt(x):
        return "" if x is None else (f"{x:,.0f}" if x >= 1000 else f"{x:.2f}")

    for r, (name, m, *cfg) in zip(rows, launches):
        N, K, _ = _shape(name, m)
        kernel = r["kernel"] + (f" {cfg[0]}" if cfg else "")
        vals = [r.get(v) for v in METRICS.values()]
        inst = r.get(METRICS["inst"])
        per_w = None if inst is None else inst * 32 / (N * K)
        stalls = [r.get(_STALL.format(s)) for s in STALLS]
        out.append("| " + " | ".join([name, str(m), kernel, f"{r['grid']} x {r['block']}"]
                                     + [fmt(v) for v in vals] + [fmt(per_w)] + [fmt(v) for v in stalls]) + " |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8", help="rows per launch, comma-separated (1: fused GEMV; 2..16: per-group)")
    ap.add_argument("--shapes", default="", help="comma-separated names (default: every E4B case)")
    ap.add_argument("--separate", action="store_true", help="per-group kernel on separate scales / zeros")
    ap.add_argument("--out", default="", help="directory for ncu's raw report (ncu.txt)")
    ap.add_argument("--mma", default="",
                    help="tensor-core kernel configs, comma-separated (TxW[dD][iI][sS][pR][f][nH])")
    ap.add_argument("--launch", action="store_true", help="run the launches only (what ncu profiles)")
    a = ap.parse_args(argv)
    launches = plan([int(x) for x in a.ms.split(",") if x], [x for x in a.shapes.split(",") if x] or None,
                    [x for x in a.mma.split(",") if x] or None)
    if a.launch:
        launch(launches, packed=not a.separate)
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("bench.counters needs Nsight Compute's `ncu` on PATH (the H200 machines have it); "
                         "--launch runs the launches alone")
    cmd = [ncu, "--clock-control", "none", "--kernel-name", KERNELS, "--metrics", ",".join(metric_names()),
           sys.executable, "-m", "fastgemma.bench.counters", "--launch", "--ms", a.ms, "--shapes", a.shapes,
           "--mma", a.mma]
    if a.separate:
        cmd.append("--separate")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "ncu.txt"), "w") as f:
            f.write(r.stdout + r.stderr)
    if r.returncode:
        raise SystemExit(f"ncu failed (rc {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    print(table(parse(r.stdout), launches))


if __name__ == "__main__":
    main()
