"""The tensor-core int4 kernel's benchmark (CUDA): every E4B shape at 1 and 8 rows over `mma_candidates`
against what the engine launches otherwise, and the table lines of the configs that beat the table's."""
from __future__ import annotations

import torch

from .mma_table import MMA_CONFIGS, MmaConfig, config_problem, format_config
from .mma_w4a16 import MmaWeight, mma_w4a16, mma_w4a16_ref


def mma_candidates(K: int, group_size: int, epilogue: str) -> list[MmaConfig]:
    """Tiles x warps where each warp's K slice is whole groups of at most 2,560 k; depth 2, 4, 8, all;
    with every group in flight, also 2 and 4 program tiles per program; and K split over 2, 4 or 8
    programs (every group in flight) where each warp keeps at least 2 groups. GeGLU: the gate / up tile
    pair, and 1 or 2 tiles of the paired layout."""
    kinds = [(2, False), (1, True), (2, True)] if epilogue == "geglu" else [(t, False) for t in (1, 2, 4)]
    out = []
    for t, pairs in kinds:
        for w in (1, 2, 4, 8):
            if K % (w * group_size) or K // w > 2560:
                continue
            out.append(MmaConfig(t, w, pairs=pairs))
            out += [MmaConfig(t, w, d, pairs=pairs) for d in (2, 4, 8) if K // (w * group_size) > d]
            out += [MmaConfig(t, w, iters=i, pairs=pairs) for i in (2, 4)]
        for s in (2, 4, 8):
            out += [MmaConfig(t, w, splits=s, pairs=pairs) for w in (1, 2, 4, 8)
                    if K % (2 * w * s * group_size) == 0 and K // (w * s) <= 2560]
    return out


def mma_label(c: MmaConfig) -> str:
    """A config's line in bench_mma's table."""
    if c.cuda:
        return (f"CUDA {c.warps} warps x {c.depth} stages" + (f", K over {c.splits} CTAs" if c.splits > 1 else "")
                + (", paired" if c.pairs else ""))
    return (f"mma {c.tiles}x16 rows, {c.warps} warps, d{c.depth}, iters {c.iters}, splits {c.splits}"
            + (f", persist {c.persist}" if c.persist else "") + (", fresh" if c.fresh else "")
            + (f", {c.hw} hw warps" if c.hw else "") + (f", <= {c.regs} registers" if c.regs else "")
            + (", paired" if c.pairs else ""))


def bench_mma(cases: dict | None = None, ms=(1, 8), group_size: int = 128, timer=None, device: str = "cuda",
              pdl: bool = True, configs: list[MmaConfig] | None = None, hot: bool = False) -> list[dict]:
    """Every E4B shape (kernels/fused_w4a16.E4B_CASES; gate|up with GeGLU) at each row count in ms:
    this kernel over `mma_candidates` (or those of `configs` that fit the shape) against what the
    engine launches now (one row: the fused int4
    GEMV with the case's prologue, and without it; 8 rows: the per-group tl.dot kernel), weights
    rotated out of L2, PDL launches, each output checked against the twin first. Prints a table;
    returns one dict per (case, rows, kernel); `config` is this kernel's config as `parse_config` reads
    it (None for the other kernels). hot: each kernel also timed on one copy of its weights, called
    again and again, so they stay in the L2 (`hot` True in its rows): what a kernel would take if
    its weights were brought into the L2 before it ran."""
    from .bench_util import WRONG_REL_ERR, copies_past_l2, max_rel_err, rotating, timer_or_graphs
    from .fused_w4a16 import E4B_CASES, case_inputs, fused_w4a16
    from .int4_pack import pack_int4, pack_scale_zero, quantize_int4
    from .read_floor import read_floor
    from .w4a16 import w4a16_matmul

    dev = torch.device(device)
    timer = timer_or_graphs(timer, "bench_mma")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}  int4 GEMV on the tensor cores vs "
          f"the current kernels, group {group_size} (us; weights rotated out of L2; {'PDL' if pdl else 'plain'})")
    print(f"{'case':>16} {'N':>6} {'K':>6} {'M':>2} | {'kernel':<48} | {'us':>8} | {'GB/s':>6} | check")
    for name, (N, K, mode) in (cases or E4B_CASES).items():
        epi = "geglu" if mode == "geglu" else "none"
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        q, sc, zr = quantize_int4(w, group_size)
        qw = pack_int4(q)
        mw = MmaWeight.from_codes(q, sc, zr, group_size)
        nbytes = qw.numel() + 2 * sc.numel() * sc.element_size()
        n_copies = copies_past_l2(nbytes, dev)
        std = [(qw.clone(), sc.clone(), zr.clone()) for _ in range(n_copies)]
        mma = [(MmaWeight(mw.words.clone(), mw.sz.clone(), N, K, group_size),) for _ in range(n_copies)]
        tried = (mma_candidates(K, group_size, epi) if configs is None else
                 [c for c in configs if not config_problem(c, N, K, group_size, epi)])
        paired = ([(MmaWeight.from_codes(q, sc, zr, group_size, pairs=True),) for _ in range(n_copies)]
                  if epi == "geglu" and any(c.pairs for c in tried) else None)
        vec = lambda n: torch.randn(1, n, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
        if any(c.cuda for c in tried):  # the CUDA configs' libraries built at once (nvcc in parallel); a failure
            from .cuda_gemm import prebuild, variants_of  # shows at its run

            prebuild(variants_of((N, K, c) for c in tried if c.cuda))
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = mma_w4a16_ref(x, qw, sc, zr, group_size, epi)
            runs = [(mma_label(c), paired if c.pairs else mma,
                     lambda mw_, c=c: mma_w4a16(x, mw_, epi, c, pdl), format_config(c)) for c in tried]
            if M == 1:
                kw = dict(eps=1e-6, pdl=pdl, epilogue=epi)
                runs.append(("fused int4 GEMV, plain", std,
                             lambda q_, s_, z_: fused_w4a16(x, q_, s_, z_, group_size, **kw)[0], None))
                if mode != "plain":
                    kw_case = dict(eps=1e-6, pdl=pdl, **case_inputs(mode, K, vec))
                    runs.append((f"fused int4 GEMV, {mode} prologue (timed only)", std,
                                 lambda q_, s_, z_: fused_w4a16(x, q_, s_, z_, group_size, **kw_case)[0], None))
            else:
                sz = pack_scale_zero(sc, zr)
                runs.append(("per-group tl.dot (w4a16_matmul)", std,
                             lambda q_, s_, z_: w4a16_matmul(x, q_, s_, z_, group_size, epilogue=epi, sz=sz), None))
            runs += [(f"read the words only, {b * 4 // 1024} KB per program (floor)", mma,
                      lambda mw_, b=b, w=w: read_floor(mw_.words, b, w, pdl), None) for b, w in ((2048, 4), (8192, 8))]
            for label, bufs, call, cfg_text in runs:
                try:
                    got = call(*bufs[0])
                    times = [(False, timer(rotating(bufs, call)))]
                    if hot:
                        times.append((True, timer(lambda: call(*bufs[0]))))
                except Exception as e:  # out of resources for a candidate: report, go on
                    print(f"{name:>16} {N:>6} {K:>6} {M:>2} | {label:<48} | skipped: {type(e).__name__}: {e}"[:160])
                    continue
                timed_only = "timed only" in label or "floor" in label
                err = float("nan") if timed_only else max_rel_err(got, ref)
                ok = timed_only or err < WRONG_REL_ERR
                check = "-" if timed_only else f"{'ok' if ok else 'WRONG'} {err:.1e}"
                for in_l2, us in times:
                    gbs = (mw.words.numel() * 4 if "floor" in label else nbytes) / us / 1e3
                    rows.append(dict(case=name, N=N, K=K, M=M, kernel=label, config=cfg_text, us=us, gbps=gbs,
                                     max_rel_err=err, ok=ok, hot=in_l2))
                    shown = f"{label}, weights in L2" if in_l2 else label
                    print(f"{name:>16} {N:>6} {K:>6} {M:>2} | {shown:<48} | {us:8.2f} | {gbs:6.0f} | {check}")
        del std, mma, paired
    return rows


def faster_entries(rows: list[dict], table: dict | None = None, margin_us: float = 0.2) -> str:
    """From `bench_mma`'s rows, the table entries ('CASE@ROWS=CONFIG' joined by ',', `parse_table`'s
    form, spaces as '_') whose fastest correct config beats the one `table` (default MMA_CONFIGS) holds
    for that shape by more than margin_us, where the table's was timed in the same rows; '' if none.
    For `bench.stack --mma-table +ENTRIES`: the configs faster alone, timed in the step."""
    table = MMA_CONFIGS if table is None else table
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["case"], r["M"])
        if r.get("config") and r["ok"] and not r.get("hot") and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    out = []
    for (case, M), r in best.items():
        have = table.get((r["N"], r["K"], M > 1))
        if have is None:
            continue
        text = format_config(have)
        mine = next((x["us"] for x in rows if (x["case"], x["M"]) == (case, M) and x.get("config") == text
                     and not x.get("hot")), None)
        if mine is not None and r["config"] != text and r["us"] < mine - margin_us:
            out.append(f"{case.replace(' ', '_')}@{M}={r['config']}")
    return ",".join(out)
