"""Decode attention over a static KV cache: split-KV (flash-decoding) Triton kernel + torch twin.

q [B, T, H, D] (T = 1 decode, k + 1 speculative verify) attends to k/v caches [B, S, Hkv, D]
(slot-major, any strides). Key visibility per query row: 0 <= kpos <= qpos and, when window > 0,
kpos > qpos - window; kpos = slot_pos[b, s] (ring buffer, -1 empty) or s when slot_pos is None.
Softmax in fp32 with `scale` (Gemma 4: 1.0). A row that sees no key returns zeros.

Kernel layout: one program = (split, b * Hkv + kv_head, row tile). The G = H // Hkv query heads of
a KV head times the T rows form one tile of G*T rows (E4B decode: 4 rows, verify k=7: 32), so each
K/V block is read once for all of them. Each program walks its share of the live key range:
slot_pos=None: [max(0, min qpos - window + 1) or 0, max qpos], read from q_pos on the device, so
cost follows the context, not S; ring buffer: [0, S). The grid depends on shapes only
(CUDA-graph safe). per_position (the batch-invariant verify pass): a row tile per aligned group of
positions, the grid (row tile, b * Hkv + kv_head, split), so a split's tiles run in one wave and
read its K / V once from DRAM. With num_splits > 1 partials (o normalised, log2-sum-exp) go to fp32 scratch
and `_combine_kernel` merges them (merge=True: the tile's last split program does, `_merge_tile`);
with num_splits == 1 the split kernel writes the output.

`decode_attention_qkv` takes the merged q|k|v projection's rows instead of q and does
kernels/qkv_finish.py's work in the split kernel (q norm + RoPE per program; a store layer's own K /
V rows made, written and attended by each row tile's last split), so a layer's attention is one
launch fewer; its positions are read and each split's first K / V block loaded before the PDL wait, into
registers or L2 (`QKV` > 0; kernels/attention_tiles.py's `early_block` says which). The launch plan (tiles,
split counts, `fuse.attn_tiles`' text form) is kernels/attention_tiles.py's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_blocks import _cached_rows, _group_rows, _k_block, _norm_rope, _norm_w, _own_rows, _prefetch_l2
from .attention_tiles import _plan, _tiles_arg, check_tiles, early_block, qkv_splits
from .counters import arrival_counters
from .gemv import _INTERPRET, _pdl_trigger, _pdl_wait, pdl_args

_LOG2E = 1.4426950408889634
# merge=True merges a row tile's partials in its last split program only up to this many fp32 values
# (splits x rows x head dim, all loaded at once: 32 registers a thread at 8 warps): E4B's sliding
# layers at one row (8 x 4 x 256); the full layers' 35-65 splits keep the combine launch
MERGE_MAX_ELEMS = 8192


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, spos_ptr, o_ptr, lse_ptr, out_ptr,
    S, T, G, Hkv, R, num_splits, window, qk_scale,
    sq_b, sq_t, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sv_b, sv_s, sv_h, sv_d,
    sqp_b, sqp_t, ssp_b, ssp_s,
    so_b, so_t, so_h, so_d,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SLOT_POS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    FIXUP: tl.constexpr, cnt_ptr, BLOCK_S: tl.constexpr, MERGE_M: tl.constexpr,
    qw_ptr, kw_ptr, cos_ptr, sin_ptr, idx_ptr, scs_b, scs_t, sid_b, sid_t, eps, norm_off,
    QKV: tl.constexpr, V_NORM: tl.constexpr, BLOCK_T: tl.constexpr, EMU: tl.constexpr, POS_TILE: tl.constexpr,
    POS_Q: tl.constexpr = 1, PARTS: tl.constexpr = False, EARLY: tl.constexpr = 0,
):
    """QKV 0: q as given. 1: q_ptr is the merged projection's rows [B, T, H*D] (strides sq_b, sq_t),
    q = rope(q_norm(.)) made here (as its two RoPE halves, K read the same way). 2: rows [B, T,
    (H + 2 Hkv) D]: q as in 1, and the step's own K / V rows (rope(k_norm(k)), v_norm(v)) made here,
    written into the cache at idx[b, t] and attended by each row tile's last split, the cache's rows
    at positions >= the step's first excluded. With QKV > 0 the positions are read and the first K /
    V block is loaded before the PDL wait: into registers (EARLY 1, `early_block`; 2: the q rows' cos /
    sin too) or L2 (0). PARTS: o_ptr is bf16 and every row of every split is written (an empty split's
    as zeros), for a GEMV that weighs the splits itself (kernels/attn_fold.py); no merge. POS_Q:
    positions per group (`_plan`); a slot_pos=None range splits at the bounds of the groups its rows lie
    in. POS_TILE: row tile pid_m is the group
    q_pos[b, 0] // POS_Q + pid_m of positions (rows at consecutive positions), so each of its rows
    splits as its one-row launch does."""
    if QKV == 0:
        _pdl_wait(PDL)  # q and the cache rows come from the kernels before
        _pdl_trigger(PDL)  # the combine (or the next GEMV) may launch: a few programs that wait
    if POS_TILE:  # row tiles the fastest axis: a split's tiles run in one wave, its K / V read once from DRAM
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_split = tl.program_id(2)
    else:
        pid_split = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_m = tl.program_id(2)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    b64 = b.to(tl.int64)  # B * S * Hkv * D can pass 2**31 elements

    # rows r = t * G + g of this tile; head = kvh * G + g. POS_TILE: the tile is the rows of one
    # POS_Q-aligned group of positions (lanes past them or past the step's rows masked)
    lane = tl.arange(0, BLOCK_M)
    if POS_TILE:
        t0, t, g, row_ok, r = _group_rows(qpos_ptr + b64 * sqp_b, pid_m, lane, G, T, POS_Q)
    else:
        r = pid_m * BLOCK_M + lane
        row_ok = r < R
        t = r // G
        g = r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # padding rows get qpos = -1: they see nothing and end as zeros (positions: no kernel of the step
    # writes them, so QKV > 0 reads them before the wait, through L2)
    if QKV == 0:
        qa = tl.load(q_ptr + b64 * sq_b + t[:, None] * sq_t + (kvh * G + g)[:, None] * sq_h + d[None, :] * sq_d,
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        qb = qa
        qpos = tl.load(qpos_ptr + b64 * sqp_b + t * sqp_t, mask=row_ok, other=-1).to(tl.int32)
    else:
        qpos = tl.load(qpos_ptr + b64 * sqp_b + t * sqp_t, mask=row_ok, other=-1, cache_modifier=".cg").to(tl.int32)
    qmax = tl.max(qpos, axis=0)
    qmin = tl.min(tl.where(row_ok, qpos, 2147483647), axis=0)
    # keys need kpos > win_lo; window == 0 means no lower bound (kpos >= 0 is checked apart)
    win_lo = tl.where(window > 0, qpos - window, -1)
    tile_win_lo = tl.where(window > 0, qmin - window, -1)
    if QKV == 2:  # the cache's rows from the step's first position on are this step's, made below
        q_new = tl.load(qpos_ptr + b64 * sqp_b, cache_modifier=".cg").to(tl.int32)
    else:
        q_new = qmax  # unused

    if HAS_SLOT_POS:
        lo = 0
        hi = S
        span = tl.maximum(hi - lo, 0)  # (= S; written so, the sm_90a build keeps the registers it was timed with)
    else:
        # read up to the last row's position (a row's keys past its own are masked for it and add exact
        # zeros); the splits' bounds from the end of the last row's POS_Q-aligned group of positions, the
        # same for every row of a group, so a POS_TILE tile splits as its rows' one-row launches do (a
        # window over a linear cache takes POS_Q = 1: its first key moves with each position)
        lo = tl.maximum(tile_win_lo + 1, 0)
        hi = tl.minimum(qmax + 1, S)
        span = tl.maximum(tl.minimum((qmax // POS_Q + 1) * POS_Q, S) - lo, 0)
    # each split takes a whole number of BLOCK_N blocks of the span; late splits may be empty
    # (QKV 2: the last split takes the step's own rows instead)
    chunk = tl.cdiv(tl.cdiv(span, num_splits - (QKV == 2)), BLOCK_N) * BLOCK_N
    start = lo + pid_split * chunk
    end = tl.minimum(start + chunk, hi)

    k_base = k_ptr + b64 * sk_b + kvh * sk_h
    v_base = v_ptr + b64 * sv_b + kvh * sv_h
    DT: tl.constexpr = k_ptr.dtype.element_ty
    HALVES: tl.constexpr = QKV > 0
    first = 0  # EARLY: the split's first K / V block, loaded before the wait (below)
    if QKV > 0:
        # the first block while the kernel before still runs (the own-rows split reads none). The rows it may
        # read were written two or more launches back (this step's own rows are masked off, at q_new and
        # after), so the PDL wait orders nothing they need. EARLY: into registers, so the block's round
        # trips leave the path after the wait; else into L2
        if EARLY:
            cached_end = tl.where(pid_split < num_splits - (QKV == 2), end, start)
            ka, kb, n, kpos, n_ok = _k_block(k_base, spos_ptr, b64, ssp_b, ssp_s, start, cached_end, d, d_ok, qmax,
                                             tile_win_lo, q_new, sk_s, sk_d, BLOCK_N, HAS_SLOT_POS, HALVES, D,
                                             QKV == 2)
            first = (ka, kb, kpos, n_ok,
                     tl.load(v_base + n[:, None] * sv_s + d[None, :] * sv_d, mask=n_ok[:, None] & d_ok[None, :],
                             other=0.0))
        elif pid_split < num_splits - (QKV == 2):
            _prefetch_l2(k_base, start, end, sk_s, sk_d, BLOCK_N, D, EMU)
            _prefetch_l2(v_base, start, end, sv_s, sv_d, BLOCK_N, D, EMU)
        qw = _norm_w(qw_ptr, D)  # the norm weights too (parameters)
        kw = qw
        if QKV == 2:
            kw = _norm_w(kw_ptr, D)
        qrow = b64 * scs_b + t * scs_t  # the row's cos / sin
        tables = 0
        if EARLY == 2:  # and the rows' cos / sin (made at the step's start), so no load waits on the norm
            jh = tl.arange(0, D // 2)[None, :]
            mk = row_ok[:, None]
            cs = (cos_ptr + qrow)[:, None]
            sn = (sin_ptr + qrow)[:, None]
            tables = (tl.load(cs + jh, mask=mk, other=0.0), tl.load(sn + jh, mask=mk, other=0.0),
                      tl.load(cs + D // 2 + jh, mask=mk, other=0.0), tl.load(sn + D // 2 + jh, mask=mk, other=0.0))
        _pdl_wait(PDL)  # the merged projection's rows
        _pdl_trigger(PDL)
        qa, qb = _norm_rope(q_ptr + b64 * sq_b + t * sq_t + (kvh * G + g) * D, row_ok, qw, cos_ptr + qrow,
                            sin_ptr + qrow, eps, norm_off, D, DT, tables, EARLY == 2)
    if QKV == 2:
        if pid_split == num_splits - 1:  # the last split: the step's own T rows, made, stored, attended
            m_i, l_i, acc = _own_rows(qa, qb, q_ptr, k_base, v_base, qpos_ptr, kw, cos_ptr, sin_ptr, idx_ptr, b64,
                                      kvh, G, Hkv, T, sq_b, sq_t, sk_s, sk_d, sv_s, sv_d, sqp_b, sqp_t, scs_b, scs_t,
                                      sid_b, sid_t, eps, norm_off, qpos, win_lo, qk_scale, pid_m, d, d_ok, D, BLOCK_M,
                                      BLOCK_D, BLOCK_T, V_NORM, IEEE, DT)
        else:
            m_i, l_i, acc = _cached_rows(qa, qb, first, k_base, v_base, spos_ptr, b64, ssp_b, ssp_s, start, end, d,
                                         d_ok, qpos, qmax, win_lo, tile_win_lo, q_new, sk_s, sk_d, sv_s, sv_d,
                                         qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, HAS_SLOT_POS, HALVES, IEEE, D, True,
                                         EARLY)
    else:
        m_i, l_i, acc = _cached_rows(qa, qb, first, k_base, v_base, spos_ptr, b64, ssp_b, ssp_s, start, end, d, d_ok,
                                     qpos, qmax, win_lo, tile_win_lo, q_new, sk_s, sk_d, sv_s, sv_d, qk_scale,
                                     BLOCK_M, BLOCK_N, BLOCK_D, HAS_SLOT_POS, HALVES, IEEE, D, False, EARLY)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        # scratch o [B*Hkv, num_splits, R, D] fp32, lse [B*Hkv, num_splits, R] (log2 domain)
        row = (pid_bh * num_splits + pid_split) * R + r
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=row_ok)
        if PARTS:  # every row written (the reader does not look at lse first), rounded to o_ptr's bf16
            tl.store(o_ptr + row[:, None] * D + d[None, :], tl.where(has[:, None], o, 0.0).to(o_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            tl.store(o_ptr + row[:, None] * D + d[None, :], o,
                     mask=(row_ok & has)[:, None] & d_ok[None, :])
        if FIXUP:  # the tile's last split to arrive merges the partials (no combine launch)
            tl.debug_barrier()  # every thread's partial written before the arrival
            if POS_TILE:
                tile = pid_bh * tl.num_programs(0) + pid_m
            else:
                tile = pid_bh * tl.num_programs(2) + pid_m
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                if POS_TILE:  # position by position, as a one-row launch merges its G rows
                    for j in tl.static_range(POS_Q):
                        tj = t0 + j
                        _merge_tile(o_ptr, lse_ptr, out_ptr, pid_bh, tj * G, tl.where((tj >= 0) & (tj < T), G, 0),
                                    G, R, kvh, b64, num_splits, so_b, so_t, so_h, so_d, D, BLOCK_D, BLOCK_S, MERGE_M)
                else:
                    _merge_tile(o_ptr, lse_ptr, out_ptr, pid_bh, pid_m * BLOCK_M, BLOCK_M, G, R, kvh, b64,
                                num_splits, so_b, so_t, so_h, so_d, D, BLOCK_D, BLOCK_S, MERGE_M)
                tl.store(cnt_ptr + tile, 0)
    else:
        tl.store(out_ptr + b64 * so_b + t[:, None] * so_t + (kvh * G + g)[:, None] * so_h + d[None, :] * so_d,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_tile(o_ptr, lse_ptr, out_ptr, bh, r0, lim, G, R, kvh, b64, num_splits, so_b, so_t, so_h, so_d,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_M: tl.constexpr):
    """A row tile's num_splits partials (o normalised, lse log2) -> out, weighed as `_combine_kernel`
    weighs them: w_s = 2^(lse_s - max lse), out = sum w_s o_s / sum w_s; empty splits (lse -inf, o
    never written) count as zero. The tile's rows r0 .. r0 + MERGE_M - 1 (those below r0 + lim and R):
    every split's lse and o are loaded first, all in flight at once from L2 (.cg, where the other
    programs wrote them; an empty split's o is read and dropped, so no load waits for an lse), then
    added in split order, elementwise: the same bits at any tile shape or warp count."""
    lane = tl.arange(0, MERGE_M)
    r = r0 + lane
    ok = (lane < lim) & (r < R)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    lses = ()
    parts = ()
    for s in tl.static_range(BLOCK_S):
        row = (bh * num_splits + s) * R + r
        s_ok = ok & (s < num_splits)
        lses = lses + (tl.load(lse_ptr + row, mask=s_ok, other=float("-inf"), cache_modifier=".cg"),)
        parts = parts + (tl.load(o_ptr + row[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                                 other=0.0, cache_modifier=".cg"),)
    mx = lses[0]
    for s in tl.static_range(1, BLOCK_S):
        mx = tl.maximum(mx, lses[s])
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w_sum = tl.zeros([MERGE_M], dtype=tl.float32)
    acc = tl.zeros([MERGE_M, BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(BLOCK_S):
        w = tl.exp2(lses[s] - mx)  # 0 for an empty split
        w_sum += w
        acc += tl.where((lses[s] > float("-inf"))[:, None], parts[s], 0.0) * w[:, None]
    res = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    t = r // G
    g = r % G
    tl.store(out_ptr + b64 * so_b + t[:, None] * so_t + (kvh * G + g)[:, None] * so_h + d[None, :] * so_d,
             res.to(out_ptr.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(
    o_ptr, lse_ptr, out_ptr,
    G, Hkv, R, num_splits,
    so_b, so_t, so_h, so_d,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, PDL: tl.constexpr,
):
    _pdl_wait(PDL)
    _pdl_trigger(PDL)  # the next GEMV launches and loads its weights while this merges
    pid_row = tl.program_id(0)  # over B * Hkv * R
    pid_d = tl.program_id(1)
    bh = pid_row // R
    r = pid_row % R
    b = bh // Hkv
    kvh = bh % Hkv
    t = r // G
    g = r % G
    s = tl.arange(0, BLOCK_S)
    row = (bh * num_splits + s) * R + r
    lse = tl.load(lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))
    w_sum = tl.sum(w, axis=0)
    d = pid_d * BLOCK_DC + tl.arange(0, BLOCK_DC)
    # empty splits wrote no o: never read them
    live = lse > float("-inf")
    o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * so_b + t * so_t + (kvh * G + g) * so_h + d * so_d,
             res.to(out_ptr.dtype.element_ty), mask=d < D)


def _check_kv(B, T, H, D, k_cache, v_cache, q_pos, slot_pos, what: str) -> None:
    Bk, S, Hkv, Dk = k_cache.shape
    if (Bk, Dk) != (B, D) or v_cache.shape != k_cache.shape or H % Hkv:
        raise ValueError(f"bad shapes {what} k {tuple(k_cache.shape)} v {tuple(v_cache.shape)}")
    if tuple(q_pos.shape) != (B, T) or (slot_pos is not None and tuple(slot_pos.shape) != (B, S)):
        raise ValueError(f"bad position shapes q_pos {tuple(q_pos.shape)} slot_pos "
                         f"{None if slot_pos is None else tuple(slot_pos.shape)}")


def decode_attention(q, k_cache, v_cache, q_pos, slot_pos, window: int, scale: float = 1.0,
                     num_splits: int | None = None, pdl: bool = False, merge: bool = False,
                     per_position: bool = False) -> torch.Tensor:
    """Split-KV Triton decode attention. Shapes as in the module docstring; returns [B, T, H, D]
    in q's dtype. q_pos: [B, T] int32/int64; slot_pos: [B, S] int32/int64 or None. No host sync.
    pdl (sm90+): both kernels launch with programmatic dependent launch, wait for the kernel before
    them at their start and let the next one launch at once (gemv.pdl_args). merge: the row tile's
    last split program to arrive merges the partials (arrival counters of kernels/counters.py)
    instead of a second launch, where a tile's partials are at most MERGE_MAX_ELEMS values (else
    the combine launch stays); the counters need one eager call of the shape before a CUDA graph
    captures it. per_position (rows at consecutive positions): each row tile holds the G query heads
    of the positions in one aligned group (BLOCK_M // G of them: E4B 4, so 8 rows take 2-3 tiles;
    one, for a window over a linear cache) and the split count is the one-row launch's, so each row
    is summed exactly as a one-row call at its position sums it (its keys cut into the same splits
    and blocks, the same tile shape, a row's extra keys masked: exact zeros), bit for bit whatever
    rows sit beside it: a verify pass's rows equal the AR steps' (fuse.batch_invariant)."""
    B, T, H, D = q.shape
    _check_kv(B, T, H, D, k_cache, v_cache, q_pos, slot_pos, f"q {tuple(q.shape)}")
    return _attention(q, q.stride(), (B, T, H, D), k_cache, v_cache, q_pos, slot_pos, window, scale, num_splits,
                      pdl, merge, {}, per_position)


def decode_attention_qkv(qkv, q_w, k_w, cos, sin, k_cache, v_cache, idx, q_pos, slot_pos, window: int, *,
                         heads: int, eps: float, offset: float = 0.0, v_norm: bool = True, scale: float = 1.0,
                         num_splits: int | None = None, pdl: bool = False, merge: bool = False,
                         tiles: tuple[int, int, int] | None = None, parts: bool = False, per_position: bool = False,
                         early: int | None = None):
    """kernels/qkv_finish.py and `decode_attention` in one split kernel: qkv [B, T, (H + 2 Hkv) D], the
    merged projection's rows of a store layer (k_w given: its K / V rows are normed, rotated, written
    into k_cache / v_cache at idx [B, T] and attended), or [B, T, H D] of a query-only layer (k_w None:
    the caches are only read; idx unused) -> the attention output [B, T, H, D]. q_w / k_w [D], cos /
    sin [B, T, 1, D]. The positions are read and the first K / V block of each split loaded before the
    PDL wait, into registers or L2 (early 1 / 0, 2: the q rows' cos / sin too; None: `early_block`'s
    choice; the cache's rows at the step's positions are never read: a store layer makes them). Rounds
    as qkv_finish does; a store layer's own rows are summed in a split of their own (another summation
    order than `decode_attention` after qkv_finish: equal within rounding, not bit for bit). tiles:
    (BLOCK_N, num_warps, num_stages) instead of `_qkv_tiles`' (bench.attention times candidates;
    `check_tiles` refuses what the kernel cannot take). parts (one row): the splits'
    o and lse instead of the output, no combine (`_attention`). per_position (a query-only layer): the
    row tiles of `decode_attention`'s per_position, so each row's output is its one-row per_position
    launch's bit for bit (the q norm and RoPE are a row's own: fuse.batch_invariant's KV-shared layers)."""
    from .qkv_finish import _check as _check_qkv

    store = k_w is not None
    B, T, D, hkv = _check_qkv(qkv, q_w, k_w, cos, sin, heads, k_cache if store else None,
                              v_cache if store else None, idx if store else None)
    _check_kv(B, T, heads, D, k_cache, v_cache, q_pos, slot_pos, f"qkv {tuple(qkv.shape)}")
    if qkv.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("decode_attention_qkv: qkv rows and the k / v caches (one set of strides) must be "
                         "contiguous along the head dim")
    if cos.stride() != sin.stride() or cos.stride(3) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    extra = dict(qw_ptr=q_w, kw_ptr=k_w if store else q_w, cos_ptr=cos, sin_ptr=sin,
                 idx_ptr=idx if store else q_pos, scs_b=cos.stride(0), scs_t=cos.stride(1),
                 sid_b=idx.stride(0) if store else 0, sid_t=idx.stride(1) if store else 0, eps=float(eps),
                 norm_off=float(offset), QKV=2 if store else 1, V_NORM=bool(v_norm),
                 BLOCK_T=max(16, triton.next_power_of_2(T)), EMU=_INTERPRET)
    if tiles is not None:
        check_tiles(tiles)
    return _attention(qkv, (qkv.stride(0), qkv.stride(1), 0, 0), (B, T, heads, D), k_cache, v_cache, q_pos,
                      slot_pos, window, scale, num_splits, pdl, merge, extra, per_position, tiles=tiles, parts=parts,
                      early=early)


def _attention(q, q_strides, shape, k_cache, v_cache, q_pos, slot_pos, window, scale, num_splits, pdl, merge,
               extra: dict, per_position: bool = False, tiles: tuple[int, int, int] | None = None,
               parts: bool = False, early: int | None = None):
    """The split kernel (+ the combine) for q (or the merged rows of `extra`'s QKV mode) of `shape`;
    per_position: a row tile per group of positions, split as a one-row launch is (`decode_attention`). parts
    (one row, split): no combine; -> the splits' o [Hkv, splits, G, D] in q's dtype (an empty split's
    zeros) and their lse [Hkv, splits, G] (log2), for kernels/attn_fold.py. early (the q/k/v modes): each
    split's first K / V block into registers before the PDL wait (1; 2: the q rows' cos / sin too) or into
    L2 (0); None: `early_block`'s choice."""
    B, T, H, D = shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    R = G * T
    qkv = extra.get("QKV", 0)
    if per_position and (qkv == 2 or G > 64):
        raise ValueError("decode_attention per_position takes q as given or a query-only layer's rows (no store "
                         "layer's q/k/v mode) and at most 64 query heads per KV head, got the q/k/v mode "
                         f"{qkv} and {G}")
    block_m, row_tiles, (block_n, num_warps, num_stages), num_splits, pos_q = _plan(
        shape, S, Hkv, qkv, num_splits, per_position, tiles, q.device, slot_pos is None and window > 0)
    split = num_splits > 1
    if parts and (B != 1 or T != 1 or not split or per_position):
        raise ValueError(f"decode attention's partials are one row's (B = T = 1) over more than one split, got "
                         f"B={B}, T={T}, {num_splits} split(s){', per position' if per_position else ''}")
    merge = merge and not parts

    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    if split:  # (parts: the splits' o rounded to q's dtype, for the GEMV's B operand)
        o_part = torch.empty((B * Hkv, num_splits, R, D), dtype=q.dtype if parts else torch.float32, device=q.device)
        lse_part = torch.empty((B * Hkv, num_splits, R), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused
    spos = slot_pos if slot_pos is not None else q_pos  # dummy pointer when HAS_SLOT_POS is off
    launch = pdl_args(pdl, q.device)
    # merge: the tile's valid rows of every split in flight at once, where they are few (the sliding
    # layers' splits at one row); more go through the combine launch
    merge_m = min(block_m, triton.next_power_of_2(G if per_position else R))
    block_s, block_d = triton.next_power_of_2(num_splits), triton.next_power_of_2(D)
    merge = split and merge and block_s * merge_m * block_d <= MERGE_MAX_ELEMS
    cnt = arrival_counters(q.device, B * Hkv * row_tiles, "attention split-KV") if merge else out
    ssp = (slot_pos.stride(0), slot_pos.stride(1)) if slot_pos is not None else (0, 0)
    if not extra:  # QKV 0: the other pointers are not read
        extra = dict(qw_ptr=q, kw_ptr=q, cos_ptr=q, sin_ptr=q, idx_ptr=q_pos, scs_b=0, scs_t=0, sid_b=0, sid_t=0,
                     eps=0.0, norm_off=0.0, QKV=0, V_NORM=False, BLOCK_T=16, EMU=_INTERPRET)
    if early is None:
        early = early_block(qkv, block_m, block_n, block_d, q.element_size(), num_warps, per_position)
    elif early and not qkv:
        raise ValueError("decode attention with q as given reads q and the cache after its PDL wait: no early K / V "
                         "block (the q/k/v modes' option)")
    extra = dict(extra, POS_TILE=bool(per_position), POS_Q=pos_q, EARLY=int(early))
    grid = (row_tiles, B * Hkv, num_splits) if per_position else (num_splits, B * Hkv, row_tiles)
    _split_kernel[grid](
        q, k_cache, v_cache, q_pos, spos, o_part, lse_part, out,
        S, T, G, Hkv, R, num_splits, int(window), float(scale) * _LOG2E,
        *q_strides, *k_cache.stride(), *v_cache.stride(),
        q_pos.stride(0), q_pos.stride(1), *ssp,
        *out.stride(),
        D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SLOT_POS=slot_pos is not None, SPLIT=split, IEEE=q.dtype == torch.float32,
        FIXUP=merge, cnt_ptr=cnt, BLOCK_S=block_s if merge else 1, MERGE_M=merge_m if merge else 1,
        num_warps=num_warps, num_stages=num_stages, PARTS=parts, **extra, **launch,
    )
    if parts:
        return o_part, lse_part
    if split and not merge:
        block_dc = min(block_d, max(16, 4096 // block_s))  # <= 16 KiB fp32 tile
        _combine_kernel[(B * Hkv * R, triton.cdiv(D, block_dc))](
            o_part, lse_part, out, G, Hkv, R, num_splits, *out.stride(),
            D=D, BLOCK_S=block_s, BLOCK_DC=block_dc, num_warps=4, **launch,
        )
    return out


def decode_attention_ref(q, k_cache, v_cache, q_pos, slot_pos, window: int, scale: float = 1.0,
                         pdl: bool = False, merge: bool = False, per_position: bool = False) -> torch.Tensor:
    """Torch twin of `decode_attention`: fp32 scores over all S slots (no host sync, graph-safe;
    `pdl`, `merge` and `per_position` are the kernel's launch options and change nothing here)."""
    B, T, H, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    kpos = (slot_pos.long() if slot_pos is not None
            else torch.arange(S, device=q.device).expand(B, S))  # [B, S]
    qp = q_pos.long()[:, :, None]  # [B, T, 1]
    vis = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qp)  # [B, T, S]
    if window > 0:
        vis &= kpos[:, None, :] > qp - window
    # slots no row sees may hold junk (NaN): zero them so 0 * NaN cannot leak through p @ v
    seen = vis.any(dim=1)[:, :, None, None]  # [B, S, 1, 1]
    k = torch.where(seen, k_cache.float(), 0.0)
    v = torch.where(seen, v_cache.float(), 0.0)
    qf = q.float().reshape(B, T, Hkv, G, D)
    s = torch.einsum("btkgd,bskd->bkgts", qf, k) * scale  # [B, Hkv, G, T, S]
    s = s.masked_fill(~vis[:, None, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(m == float("-inf"), 0.0, m))  # empty row: p = 0, not NaN
    l = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bkgts,bskd->btkgd", p / torch.where(l > 0, l, 1.0), v)
    return o.reshape(B, T, H, D).to(q.dtype)


# Registered as an opaque op so torch.compile traces around the kernel instead of into its launcher.
@torch.library.custom_op("fastgemma::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                        slot_pos: torch.Tensor | None, window: int, scale: float = 1.0,
                        pdl: bool = False, merge: bool = False, per_position: bool = False) -> torch.Tensor:
    return decode_attention(q, k_cache, v_cache, q_pos, slot_pos, window, scale, pdl=pdl, merge=merge,
                            per_position=per_position)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, q_pos, slot_pos, window, scale=1.0, pdl=False, merge=False, per_position=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def decode_attention_qkv_ref(qkv, q_w, k_w, cos, sin, k_cache, v_cache, idx, q_pos, slot_pos, window: int, *,
                             heads: int, eps: float, offset: float = 0.0, v_norm: bool = True, scale: float = 1.0,
                             pdl: bool = False, merge: bool = False) -> torch.Tensor:
    """Twin of `decode_attention_qkv`: qkv_finish_ref (the caches written by index_put), then
    decode_attention_ref."""
    from .qkv_finish import qkv_finish_ref

    store = k_w is not None
    q = qkv_finish_ref(qkv, q_w, k_w, cos, sin, k_cache if store else None, v_cache if store else None,
                       idx if store else None, heads=heads, eps=eps, offset=offset, v_norm=v_norm)
    return decode_attention_ref(q, k_cache, v_cache, q_pos, slot_pos, window, scale)


# flexible_layout: as kernels/qkv_finish.py's ops (the step's one rope buffer and the GEMV's output as views)
@torch.library.custom_op("fastgemma::decode_attention_qkv", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def decode_attention_qkv_op(qkv: torch.Tensor, q_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                            slot_pos: torch.Tensor | None, window: int, heads: int, eps: float, offset: float,
                            scale: float, pdl: bool, merge: bool, tiles: str = "",
                            per_position: bool = False) -> torch.Tensor:
    """A query-only layer (KV-shared, the drafter): q made from the merged projection, the caches read.
    tiles: 'NxWsS[pP][eE]' instead of the kernel's own tiles (split count, early block) (''); per_position: row tiles
    per group of positions (`decode_attention_qkv`)."""
    return decode_attention_qkv(qkv, q_w, None, cos, sin, k_cache, v_cache, None, q_pos, slot_pos, window,
                                heads=heads, eps=eps, offset=offset, scale=scale, pdl=pdl, merge=merge,
                                per_position=per_position, **_tiles_arg(tiles))


@decode_attention_qkv_op.register_fake
def _(qkv, q_w, cos, sin, k_cache, v_cache, q_pos, slot_pos, window, heads, eps, offset, scale, pdl, merge, tiles="",
      per_position=False):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], heads, q_w.shape[0])


@torch.library.custom_op("fastgemma::decode_attention_qkv_store", mutates_args=("k_cache", "v_cache"),
                         tags=(torch.Tag.flexible_layout,))
def decode_attention_qkv_store_op(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor,
                                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor,
                                  q_pos: torch.Tensor, slot_pos: torch.Tensor | None, window: int, heads: int,
                                  eps: float, offset: float, v_norm: bool, scale: float, pdl: bool,
                                  merge: bool, tiles: str = "") -> torch.Tensor:
    """A store layer: its K / V rows written into the caches at idx, then attended with the rest."""
    return decode_attention_qkv(qkv, q_w, k_w, cos, sin, k_cache, v_cache, idx, q_pos, slot_pos, window,
                                heads=heads, eps=eps, offset=offset, v_norm=v_norm, scale=scale, pdl=pdl, merge=merge,
                                **_tiles_arg(tiles))


@decode_attention_qkv_store_op.register_fake
def _(qkv, q_w, k_w, cos, sin, k_cache, v_cache, idx, q_pos, slot_pos, window, heads, eps, offset, v_norm, scale,
      pdl, merge, tiles=""):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], heads, q_w.shape[0])


# the same two launches without the combine: (o [Hkv, splits, G, D], lse [Hkv, splits, G]) of one row for a GEMV
# that weighs the splits itself (kernels/attn_fold.py)
def _parts_fake(qkv, q_w, k_cache, heads, store, tiles):
    Hkv, D = k_cache.shape[2], q_w.shape[0]
    n = qkv_splits(k_cache, heads, D, store, tiles)
    return (qkv.new_empty(Hkv, n, heads // Hkv, D),
            qkv.new_empty(Hkv, n, heads // Hkv, dtype=torch.float32))


@torch.library.custom_op("fastgemma::decode_attention_qkv_parts", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def decode_attention_qkv_parts_op(qkv: torch.Tensor, q_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                                  slot_pos: torch.Tensor | None, window: int, heads: int, eps: float, offset: float,
                                  scale: float, pdl: bool, tiles: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention_qkv_op` (a query-only layer) ending in the splits' partials."""
    return decode_attention_qkv(qkv, q_w, None, cos, sin, k_cache, v_cache, None, q_pos, slot_pos, window,
                                heads=heads, eps=eps, offset=offset, scale=scale, pdl=pdl, parts=True,
                                **_tiles_arg(tiles))


@decode_attention_qkv_parts_op.register_fake
def _(qkv, q_w, cos, sin, k_cache, v_cache, q_pos, slot_pos, window, heads, eps, offset, scale, pdl, tiles=""):
    return _parts_fake(qkv, q_w, k_cache, heads, False, tiles)


@torch.library.custom_op("fastgemma::decode_attention_qkv_store_parts", mutates_args=("k_cache", "v_cache"),
                         tags=(torch.Tag.flexible_layout,))
def decode_attention_qkv_store_parts_op(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor,
                                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                        idx: torch.Tensor, q_pos: torch.Tensor, slot_pos: torch.Tensor | None,
                                        window: int, heads: int, eps: float, offset: float, v_norm: bool, scale: float,
                                        pdl: bool, tiles: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention_qkv_store_op` (a store layer) ending in the splits' partials."""
    return decode_attention_qkv(qkv, q_w, k_w, cos, sin, k_cache, v_cache, idx, q_pos, slot_pos, window,
                                heads=heads, eps=eps, offset=offset, v_norm=v_norm, scale=scale, pdl=pdl, parts=True,
                                **_tiles_arg(tiles))


@decode_attention_qkv_store_parts_op.register_fake
def _(qkv, q_w, k_w, cos, sin, k_cache, v_cache, idx, q_pos, slot_pos, window, heads, eps, offset, v_norm, scale,
      pdl, tiles=""):
    return _parts_fake(qkv, q_w, k_cache, heads, True, tiles)
