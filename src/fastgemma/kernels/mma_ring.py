"""The int4 tensor-core GEMV (kernels/mma_w4a16.py) with its weights streamed through shared memory.

In `_mma_w4a16_kernel` and `_mma_stream_kernel` a program's weight words go to registers: ptxas hoists
every load of a one-tile program ahead of its mmas, so gate|up's programs hold 210 registers, run 2 a
multiprocessor, and its 640 program tiles pass in ~2.4 waves of load-then-multiply, the memory idle
while each wave multiplies (run HV's reading). Here a persistent program (one a multiprocessor) loops
over its program tiles with Triton's software pipeline (`tl.range(num_stages=STAGES)`): each tile's
words and scale / zero words go to shared memory by `cp.async`, STAGES - 1 tiles ahead of the one being
multiplied, so the registers hold only the tile in use and the loads never stop for the mmas. The x
words of the program's K slices are loaded once, to registers, after the PDL wait (at most 640 k per
warp: 80 words a lane row), so they take no shared memory and no bandwidth in the loop.

The fragment order, the mma blocks and the store are mma_w4a16's (`_tile_ptrs`, `_group_loads`,
`_tile_mma`, `_ones_mma`, `_tile_store`); each 64-k block's chains start from zero (mma_w4a16's fresh
chains). `MmaConfig.ring` (config text `cN`) picks it; `mma_w4a16` launches it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv import _pdl_trigger, _pdl_wait
from .mma_w4a16 import _bf16_pairs, _group_loads, _ones_mma, _tile_mma, _tile_ptrs, _tile_store, _x_ptrs

RING_MAX_K = 640  # k per warp slice at most: 80 x words a lane row held in registers through the loop


@triton.jit
def _ring_tile(acc, grp, xs, g: tl.constexpr, BG: tl.constexpr, R: tl.constexpr, EMU: tl.constexpr):
    """acc + group g's sums: its BG word blocks `grp` (then its scale / zero words) against the x words
    xs[2b], xs[2b + 1] of its blocks b, each block's mmas from zero."""
    p = tl.zeros((R, 4), dtype=tl.float32)
    xsum = tl.zeros((R, 4), dtype=tl.float32)
    for i in tl.static_range(BG):
        xa = xs[2 * (g * BG + i)]
        xb = xs[2 * (g * BG + i) + 1]
        xsum += _ones_mma(xa, xb, tl.zeros((R, 4), dtype=tl.float32), EMU)
        p += _tile_mma(grp[i], xa, xb, tl.zeros((R, 4), dtype=tl.float32), EMU)
    s, z = _bf16_pairs(grp[BG])
    return acc + (s * p + (z - 128.0 * s) * xsum)


@triton.jit
def _mma_ring_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, M, HALF, stride_xm, stride_om, NPT, NITER,
                     K: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, W: tl.constexpr, EPI: tl.constexpr,
                     STAGES: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr):
    """Program p sums program tiles p, p + P, ... (NITER of them; those past NPT masked), each tile's
    words in shared memory STAGES - 1 tiles ahead of its use."""
    _pdl_trigger(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    BG: tl.constexpr = GROUP // 64
    NG: tl.constexpr = K // W // GROUP
    R: tl.constexpr = W * T * 32
    r = tl.arange(0, R)[:, None]
    oj = tl.arange(0, 4)[None, :]
    _pdl_wait(PDL)
    x_ptrs = _x_ptrs(x_ptr, r, oj, 0, M, stride_xm, K, T, W, 1)
    xs = ()  # a lane row's x words of every 64-k block of its warp's K slice: (xa, xb) per block
    for b in tl.static_range(NG * BG):
        xs = xs + (tl.load(x_ptrs + b * 32), tl.load(x_ptrs + b * 32 + 4))
    for j in tl.range(0, NITER, num_stages=STAGES):
        it = pid + j * nprog
        ok = it < NPT
        w_ptrs, sz_ptrs = _tile_ptrs(it, 0, w_ptr, sz_ptr, HALF, r, oj, K, GROUP, T, W, 1, EPI)
        acc = tl.zeros((R, 4), dtype=tl.float32)
        for g in tl.static_range(NG):
            acc = _ring_tile(acc, _group_loads(w_ptrs, sz_ptrs, g, ok, BG, R), xs, g, BG, R, EMU)
        _tile_store(tl.sum(tl.reshape(acc, (W, T * 32, 4)), axis=0), it, ok, out_ptr, M, stride_om, T, EPI)


def ring_problem(cfg, K: int) -> str | None:
    """Why the ring kernel cannot run cfg (cfg.ring > 0) at K, or None."""
    if cfg.persist < 1 or cfg.iters != 1 or cfg.splits != 1 or cfg.fresh or cfg.depth != type(cfg).depth:
        return (f"ring (cN) runs one persistent program stream a multiprocessor: it needs persist > 0 and no "
                f"depth, iters, splits or fresh (its stages replace them), got {cfg}")
    if cfg.ring < 2:
        return f"ring needs at least 2 stages (one tile ahead), got {cfg}"
    if K // cfg.warps > RING_MAX_K:
        return f"ring holds each warp's x in registers: at most {RING_MAX_K} k per warp, got K={K} over {cfg.warps}"
    return None


def launch_ring(x, weight, out, epi: int, cfg, n_tiles: int, pdl_kw: dict, interpret: bool) -> None:
    """`_mma_ring_kernel` over n_tiles program tiles into out (mma_w4a16's checks done)."""
    from .mma_w4a16 import persistent_programs

    grid = (persistent_programs(n_tiles, cfg.persist, x.device),)
    _mma_ring_kernel[grid](x, weight.words, weight.sz, out, x.shape[0], weight.N // 2, x.stride(0), out.stride(0),
                           n_tiles, triton.cdiv(n_tiles, grid[0]), K=weight.K, GROUP=weight.group_size,
                           T=cfg.tiles, W=cfg.warps, EPI=epi, STAGES=cfg.ring, EMU=interpret, **cfg.launch, **pdl_kw)
