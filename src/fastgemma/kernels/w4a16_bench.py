"""The W4A16 kernels' benchmark (CUDA only; not a test): every E4B shape against cuBLAS bf16, the
table's tiles and, with sweep=True, `candidates`, printing CONFIGS lines for the best."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import w4a16
from .int4_pack import pack_int4, pack_scale_zero, quantize_int4
from .w4a16 import w4a16_matmul, w4a16_torch
from .w4a16_table import DEQUANT_MIN_M, E4B_SHAPES, candidates, m_bucket, resolve_config


def _time_reduce_launch(x, qw, s, z, qbufs, group_size, cfg, timed_us) -> dict:
    """A split config with SPLIT_FIXUP off (partials, then `_splitk_reduce_kernel`): its time, and
    whether the fixup's output equals it bit for bit."""
    from .bench_util import rotating as _rotating

    fixed = w4a16_matmul(x, qw, s, z, group_size, cfg)
    w4a16.SPLIT_FIXUP = False
    try:
        base = w4a16_matmul(x, qw, s, z, group_size, cfg)
        t = timed_us(_rotating(qbufs, lambda a, b, c, d: w4a16_matmul(x, a, b, c, group_size, cfg, sz=d)))
    finally:
        w4a16.SPLIT_FIXUP = True
    return dict(reduce_launch_us=t, fixup_equal=bool(torch.equal(fixed, base)))


def bench_shapes(ms=(1, 8, 16), group_size: int = 128, shapes: dict | None = None, dtype=torch.bfloat16,
                 sweep: bool = False, graph: bool = True, rep_ms: int = 20, device: str = "cuda",
                 per_group_only: bool = False, packed: bool = False) -> list[dict]:
    """Time each E4B shape: int4 kernel vs cuBLAS bf16 (F.linear), weights rotated out of L2.

    graph=True times inside CUDA graphs (do_bench_cudagraph; the decode path), False times eager
    launches (do_bench). sweep=True also tries `candidates` and prints CONFIGS lines for the best
    (per_group_only: the table's config and the per-group kernel's candidates only). packed=True:
    the per-group kernel reads `pack_scale_zero` words (the row keeps the table's config on separate
    scales / zeros as `separate_sz_us`). Returns one dict per (shape, M). Needs a CUDA device.
    """
    from .bench_util import WRONG_REL_ERR, copies_past_l2, max_rel_err, rotated_copies, rotating, timer

    if not torch.cuda.is_available():
        raise RuntimeError("bench_shapes needs a CUDA device")
    dev = torch.device(device)
    shapes = shapes or E4B_SHAPES
    gen = torch.Generator(device=dev).manual_seed(0)
    timed_us = timer(graph, rep_ms)

    rows, best_lines = [], []
    print(f"{torch.cuda.get_device_name(dev)}  group {group_size}  {dtype}  "
          f"{'graph' if graph else 'eager'}  (us, GB/s of weight + scale bytes)")
    print(f"{'shape':>10} {'N':>6} {'K':>6} {'M':>3} | {'int4 us':>8} {'GB/s':>6} | {'bf16 us':>8} {'GB/s':>6} "
          f"| {'x':>5} | {'err':>8} | config")
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=dtype, generator=gen) * 0.02
        q, s, z = quantize_int4(w, group_size)
        qw = pack_int4(q)
        q_bytes = qw.numel() + 2 * s.numel() * s.element_size()
        qbufs = [(qw.clone(), s.clone(), z.clone(), pack_scale_zero(s, z) if packed else None)
                 for _ in range(copies_past_l2(q_bytes, dev))]
        sz = qbufs[0][3]
        wbufs = rotated_copies(w)
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
            ref = w4a16_torch(x, qw, s, z, group_size)
            t_ref = timed_us(rotating(wbufs, lambda w_: F.linear(x, w_)))
            cfgs = [resolve_config(M, N, K, group_size)]
            if M == 1:  # the baselines, same tiles: per-weight dequantisation, then the other loop
                cfgs.append(dataclasses.replace(cfgs[0], factored=False))
                cfgs.append(dataclasses.replace(cfgs[0], words=not cfgs[0].words))
            if sweep:
                cfgs += [resolve_config(M, N, K, group_size, c) for c in candidates(M, N, K, per_group_only)]
                cfgs = list(dict.fromkeys(cfgs))
            results, err = [], float("nan")
            for cfg in cfgs:
                try:
                    e = max_rel_err(w4a16_matmul(x, qw, s, z, group_size, cfg, sz=sz), ref)
                    t = timed_us(rotating(qbufs, lambda a, b, c, d, cfg=cfg: w4a16_matmul(x, a, b, c, group_size, cfg,
                                                                                         sz=d)))
                except Exception as ex:  # out of resources for a candidate: skip it
                    print(f"    skip {cfg}: {type(ex).__name__}")
                    continue
                if cfg == cfgs[0]:
                    err = e  # the table's config: its error goes in the row
                if not e < WRONG_REL_ERR:  # a wrong candidate is reported and never chosen
                    print(f"    WRONG {cfg}: max rel err {e:.2e}")
                    continue
                results.append((t, cfg))
            t_tab, cfg_tab = results[0]
            t_best, cfg_best = min((r for r in results if r[1].factored), key=lambda r: r[0])
            t_base = next((t for t, c in results if not c.factored), float("nan"))
            t_other = next((t for t, c in results if c.factored and c.words != cfg_tab.words
                            and dataclasses.replace(c, words=cfg_tab.words) == cfg_tab), float("nan"))
            row = dict(shape=name, N=N, K=K, M=M, int4_us=t_tab, unfactored_us=t_base, other_loop_us=t_other,
                       bf16_us=t_ref, config=cfg_tab, best_us=t_best, best_config=cfg_best, max_rel_err=err)
            if cfg_tab.split_k > 1:  # the same tiles with the partials summed by a second launch
                row.update(_time_reduce_launch(x, qw, s, z, qbufs, group_size, cfg_tab, timed_us))
            if packed and cfg_tab.per_group:  # the table's tiles on separate scales / zeros
                row["separate_sz_us"] = timed_us(rotating(qbufs, lambda a, b, c, d: w4a16_matmul(
                    x, a, b, c, group_size, cfg_tab)))
            rows.append(row)
            print(f"{name:>10} {N:>6} {K:>6} {M:>3} | {t_tab:8.2f} {q_bytes / t_tab / 1e3:6.0f} | "
                  f"{t_ref:8.2f} {2 * N * K / t_ref / 1e3:6.0f} | {t_ref / t_tab:5.2f} | {err:8.1e} | {cfg_tab}"
                  + (f" | unfactored {t_base:.2f} us, {'byte' if cfg_tab.words else 'word'} loop {t_other:.2f} us"
                     if M == 1 else "")
                  + (f" | reduce launch {row['reduce_launch_us']:.2f} us, bitwise equal {row['fixup_equal']}"
                     if "reduce_launch_us" in row else "")
                  + (f" | separate scales / zeros {row['separate_sz_us']:.2f} us" if "separate_sz_us" in row else ""))
            if sweep:
                print(f"{'best':>10} {'':>6} {'':>6} {M:>3} | {t_best:8.2f} {q_bytes / t_best / 1e3:6.0f} | {cfg_best}")
                pg = [r for r in results if r[1].per_group]
                if pg:
                    t_pg, cfg_pg = min(pg, key=lambda r: r[0])
                    row.update(per_group_us=t_pg, per_group_config=cfg_pg)
                    print(f"{'per-group':>10} {'':>6} {'':>6} {M:>3} | {t_pg:8.2f} {q_bytes / t_pg / 1e3:6.0f} | {cfg_pg}")
                key = (DEQUANT_MIN_M if M >= DEQUANT_MIN_M else m_bucket(M), N, K)
                best_lines.append(f"    {key}: {cfg_best!r},  # {name}: {t_best:.2f} us")
        del qbufs, wbufs
    if sweep:
        print("\n# CONFIGS entries (block_n, block_k, split_k, num_warps, num_stages, block_m):")
        print("\n".join(best_lines))
    return rows
