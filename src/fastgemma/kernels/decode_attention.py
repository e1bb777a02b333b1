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
(CUDA-graph safe). With num_splits > 1 partials (o normalised, log2-sum-exp) go to fp32 scratch
and `_combine_kernel` merges them (merge=True: the tile's last split program does, `_merge_tile`);
with num_splits == 1 the split kernel writes the output.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .counters import arrival_counters
from .gemv import _pdl_trigger, _pdl_wait, pdl_args

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_DEFAULT_SMS = 132  # H200; used when q is not on a CUDA device (interpreter tests)


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
    FIXUP: tl.constexpr, cnt_ptr, BLOCK_S: tl.constexpr,
):
    _pdl_wait(PDL)  # q and the cache rows come from the kernels before
    _pdl_trigger(PDL)  # the combine (or the next GEMV) may launch: a few programs that wait
    pid_split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    b64 = b.to(tl.int64)  # B * S * Hkv * D can pass 2**31 elements

    # rows r = t * G + g of this tile; head = kvh * G + g
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < R
    t = r // G
    g = r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b64 * sq_b + t[:, None] * sq_t + (kvh * G + g)[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # padding rows get qpos = -1: they see nothing and end as zeros
    qpos = tl.load(qpos_ptr + b64 * sqp_b + t * sqp_t, mask=row_ok, other=-1).to(tl.int32)
    qmax = tl.max(qpos, axis=0)
    qmin = tl.min(tl.where(row_ok, qpos, 2147483647), axis=0)
    # keys need kpos > win_lo; window == 0 means no lower bound (kpos >= 0 is checked apart)
    win_lo = tl.where(window > 0, qpos - window, -1)
    tile_win_lo = tl.where(window > 0, qmin - window, -1)

    if HAS_SLOT_POS:
        lo = 0
        hi = S
    else:
        lo = tl.maximum(tile_win_lo + 1, 0)
        hi = tl.minimum(qmax + 1, S)
    n_live = tl.maximum(hi - lo, 0)
    # each split takes a whole number of BLOCK_N blocks of the live range; late splits may be empty
    chunk = tl.cdiv(tl.cdiv(n_live, num_splits), BLOCK_N) * BLOCK_N
    start = lo + pid_split * chunk
    end = tl.minimum(start + chunk, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + b64 * sk_b + kvh * sk_h
    v_base = v_ptr + b64 * sv_b + kvh * sv_h
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        if HAS_SLOT_POS:
            kpos = tl.load(spos_ptr + b64 * ssp_b + n * ssp_s, mask=n_ok, other=-1)
            # slots no row of the tile can see are never read (empty/evicted slots may hold junk)
            n_ok = n_ok & (kpos >= 0) & (kpos <= qmax) & (kpos > tile_win_lo)
        else:
            kpos = n
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * sk_s + d[None, :] * sk_d, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        vis = n_ok[None, :] & (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None]) \
            & (kpos[None, :] > win_lo[:, None])
        s = tl.where(vis, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: avoid inf - inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * sv_s + d[None, :] * sv_d, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:
        # scratch o [B*Hkv, num_splits, R, D] fp32, lse [B*Hkv, num_splits, R] (log2 domain)
        row = (pid_bh * num_splits + pid_split) * R + r
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=row_ok)
        tl.store(o_ptr + row[:, None] * D + d[None, :], o,
                 mask=(row_ok & has)[:, None] & d_ok[None, :])
        if FIXUP:  # the tile's last split to arrive merges the partials (no combine launch)
            tl.debug_barrier()  # every thread's partial written before the arrival
            tile = pid_bh * tl.num_programs(2) + pid_m
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                _merge_tile(o_ptr, lse_ptr, out_ptr, pid_bh, r, row_ok, t, g, kvh, G, b64, d, d_ok, num_splits, R,
                            so_b, so_t, so_h, so_d, D, BLOCK_S)
                tl.store(cnt_ptr + tile, 0)
    else:
        tl.store(out_ptr + b64 * so_b + t[:, None] * so_t + (kvh * G + g)[:, None] * so_h + d[None, :] * so_d,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_tile(o_ptr, lse_ptr, out_ptr, bh, r, row_ok, t, g, kvh, G, b64, d, d_ok, num_splits, R,
                so_b, so_t, so_h, so_d, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """A row tile's num_splits partials (o normalised, lse log2) -> out, as `_combine_kernel` weighs
    them: w_s = 2^(lse_s - max lse), out = sum w_s o_s / sum w_s; empty splits (lse -inf) skipped.
    The partials are read from L2 (.cg), where the other programs wrote them."""
    s = tl.arange(0, BLOCK_S)
    rows = (bh * num_splits + s[:, None]) * R + r[None, :]  # [BLOCK_S, BLOCK_M]
    lse = tl.load(lse_ptr + rows, mask=(s[:, None] < num_splits) & row_ok[None, :], other=float("-inf"),
                  cache_modifier=".cg")
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w_sum = tl.sum(tl.exp2(lse - mx[None, :]), axis=0)
    acc = tl.zeros([r.shape[0], d.shape[0]], dtype=tl.float32)
    for sp in range(num_splits):
        row = (bh * num_splits + sp) * R + r
        lse_s = tl.load(lse_ptr + row, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        live = lse_s > float("-inf")
        o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        acc += o * tl.exp2(lse_s - mx)[:, None]
    res = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    tl.store(out_ptr + b64 * so_b + t[:, None] * so_t + (kvh * G + g)[:, None] * so_h + d[None, :] * so_d,
             res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


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


def _tiles(D: int, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). D=512 takes BLOCK_N=32 so K+V bf16 tiles stay 64 KiB per
    stage like D=256 at 64. Compiled for sm_90: BLOCK_M*D <= 8192 at 4 warps uses <= 220 regs,
    76-100 KiB shared, no spills; larger tiles (verify rows x D=512) spill at 4 warps, so 8
    (BLOCK_M=64, D=512: 244 regs, 192 KiB shared)."""
    block_n = 64 if D <= 256 else 32
    num_warps = 4 if block_m * triton.next_power_of_2(D) <= 8192 else 8
    return block_n, num_warps, 2


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_num_splits(B: int, Hkv: int, row_tiles: int, S: int, block_n: int, num_sms: int) -> int:
    """Enough splits for about one wave of programs (B*Hkv*row_tiles*splits ~ num_sms), never more
    than the BLOCK_N blocks in S, at most 64. Splits past the live range exit at once, so a large S
    with a short context costs only empty programs. E4B decode B=1 on 132 SMs: full layer (S=32k)
    64 splits, sliding ring (S=528) 9 splits."""
    want = triton.cdiv(num_sms, B * Hkv * row_tiles)
    return max(1, min(want, triton.cdiv(S, block_n), _MAX_SPLITS))


def decode_attention(q, k_cache, v_cache, q_pos, slot_pos, window: int, scale: float = 1.0,
                     num_splits: int | None = None, pdl: bool = False, merge: bool = False) -> torch.Tensor:
    """Split-KV Triton decode attention. Shapes as in the module docstring; returns [B, T, H, D]
    in q's dtype. q_pos: [B, T] int32/int64; slot_pos: [B, S] int32/int64 or None. No host sync.
    pdl (sm90+): both kernels launch with programmatic dependent launch, wait for the kernel before
    them at their start and let the next one launch at once (gemv.pdl_args). merge: the row tile's
    last split program to arrive merges the partials (arrival counters of kernels/counters.py)
    instead of a second launch; the counters need one eager call of the shape before a CUDA graph
    captures it."""
    B, T, H, D = q.shape
    Bk, S, Hkv, Dk = k_cache.shape
    if (Bk, Dk) != (B, D) or v_cache.shape != k_cache.shape or H % Hkv:
        raise ValueError(f"bad shapes q {tuple(q.shape)} k {tuple(k_cache.shape)} v {tuple(v_cache.shape)}")
    if tuple(q_pos.shape) != (B, T) or (slot_pos is not None and tuple(slot_pos.shape) != (B, S)):
        raise ValueError(f"bad position shapes q_pos {tuple(q_pos.shape)} slot_pos "
                         f"{None if slot_pos is None else tuple(slot_pos.shape)}")
    G = H // Hkv
    R = G * T
    block_m = min(64, max(16, triton.next_power_of_2(R)))  # tl.dot needs M >= 16
    row_tiles = triton.cdiv(R, block_m)
    block_n, num_warps, num_stages = _tiles(D, block_m)
    if num_splits is None:
        num_splits = pick_num_splits(B, Hkv, row_tiles, S, block_n, _num_sms(q.device))
    num_splits = max(1, int(num_splits))
    split = num_splits > 1

    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    if split:
        o_part = torch.empty((B * Hkv, num_splits, R, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B * Hkv, num_splits, R), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused
    spos = slot_pos if slot_pos is not None else q_pos  # dummy pointer when HAS_SLOT_POS is off
    launch = pdl_args(pdl, q.device)
    merge = split and merge
    cnt = arrival_counters(q.device, B * Hkv * row_tiles, "attention split-KV") if merge else out
    ssp = (slot_pos.stride(0), slot_pos.stride(1)) if slot_pos is not None else (0, 0)
    _split_kernel[(num_splits, B * Hkv, row_tiles)](
        q, k_cache, v_cache, q_pos, spos, o_part, lse_part, out,
        S, T, G, Hkv, R, num_splits, int(window), float(scale) * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        q_pos.stride(0), q_pos.stride(1), *ssp,
        *out.stride(),
        D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SLOT_POS=slot_pos is not None, SPLIT=split, IEEE=q.dtype == torch.float32,
        FIXUP=merge, cnt_ptr=cnt, BLOCK_S=triton.next_power_of_2(num_splits) if merge else 1,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )
    if split and not merge:
        block_s = triton.next_power_of_2(num_splits)
        block_dc = min(triton.next_power_of_2(D), max(16, 4096 // block_s))  # <= 16 KiB fp32 tile
        _combine_kernel[(B * Hkv * R, triton.cdiv(D, block_dc))](
            o_part, lse_part, out, G, Hkv, R, num_splits, *out.stride(),
            D=D, BLOCK_S=block_s, BLOCK_DC=block_dc, num_warps=4, **launch,
        )
    return out


def decode_attention_ref(q, k_cache, v_cache, q_pos, slot_pos, window: int, scale: float = 1.0,
                         pdl: bool = False, merge: bool = False) -> torch.Tensor:
    """Torch twin of `decode_attention`: fp32 scores over all S slots (no host sync, graph-safe;
    `pdl` and `merge` are the kernel's launch options and change nothing here)."""
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
                        pdl: bool = False, merge: bool = False) -> torch.Tensor:
    return decode_attention(q, k_cache, v_cache, q_pos, slot_pos, window, scale, pdl=pdl, merge=merge)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, q_pos, slot_pos, window, scale=1.0, pdl=False, merge=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
