"""The split decode-attention kernel's building blocks (kernels/decode_attention.py's `_split_kernel`): a K block's
positions and visibility, the scores and the online softmax, the accumulation, q / k norm + RoPE on rows made in
the kernel, an L2 prefetch, and the walks over the cached keys and over a store layer's own new rows. Each works on
one row tile of G query heads x T rows; under TRITON_INTERPRET=1 the dots run row by row (`ROWWISE`)."""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv import _INTERPRET

ROWWISE = tl.constexpr(_INTERPRET)  # `_rowwise_mm` for tl.dot under the interpreter


@triton.jit
def _k_block(k_base, spos_ptr, b64, ssp_b, ssp_s, n0, end, d, d_ok, qmax, tile_win_lo, q_new, sk_s, sk_d,
             BLOCK_N: tl.constexpr, HAS_SLOT_POS: tl.constexpr, HALVES: tl.constexpr, D: tl.constexpr,
             OWN: tl.constexpr):
    """The K block at n0 (slots n0 .. n0 + BLOCK_N - 1, below `end`) and its key positions: slots no
    row of the tile can see are never read (empty / evicted slots may hold junk), nor (OWN) those at
    positions >= q_new (the step's own rows, made by the caller). HALVES: K as its two RoPE halves
    [BLOCK_N, D / 2] (ka, kb), else ka = kb = the whole rows."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    if HAS_SLOT_POS:
        kpos = tl.load(spos_ptr + b64 * ssp_b + n * ssp_s, mask=n_ok, other=-1)
        n_ok = n_ok & (kpos >= 0) & (kpos <= qmax) & (kpos > tile_win_lo)
    else:
        kpos = n
    if OWN:
        n_ok = n_ok & (kpos < q_new)
    if HALVES:
        j = tl.arange(0, D // 2)
        ka = tl.load(k_base + n[:, None] * sk_s + j[None, :] * sk_d, mask=n_ok[:, None], other=0.0)
        kb = tl.load(k_base + n[:, None] * sk_s + (j + D // 2)[None, :] * sk_d, mask=n_ok[:, None], other=0.0)
    else:
        ka = tl.load(k_base + n[:, None] * sk_s + d[None, :] * sk_d, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        kb = ka
    return ka, kb, n, kpos, n_ok


@triton.jit
def _rowwise_mm(a, b):
    """a [M, K] @ b [K, N] in fp32 as a broadcast product summed over K: the interpreter's tl.dot, so
    that a row's sums do not depend on where it sits in the tile (numpy's matmul blocks rows and can
    round a row by its index; the tensor cores' rows are independent)."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _scores(qa, qb, ka, kb, kpos, n_ok, qpos, win_lo, m_i, l_i, qk_scale, IEEE: tl.constexpr, HALVES: tl.constexpr):
    """A key block's scores into the online softmax of the tile's rows (log2 domain) -> (m_i, l_i,
    alpha, p); then `_accumulate` with its V. HALVES: from the two RoPE halves (qa . ka + qb . kb),
    else qa . ka."""
    if ROWWISE:
        s = _rowwise_mm(qa, tl.trans(ka))
        if HALVES:
            s += _rowwise_mm(qb, tl.trans(kb))
    elif IEEE:
        s = tl.dot(qa, tl.trans(ka), input_precision="ieee")
        if HALVES:
            s += tl.dot(qb, tl.trans(kb), input_precision="ieee")
    else:
        s = tl.dot(qa, tl.trans(ka))
        if HALVES:
            s += tl.dot(qb, tl.trans(kb))
    vis = n_ok[None, :] & (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None]) \
        & (kpos[None, :] > win_lo[:, None])
    s = tl.where(vis, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: avoid inf - inf
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, alpha, p


@triton.jit
def _accumulate(acc, alpha, p, v, IEEE: tl.constexpr):
    if ROWWISE:
        return acc * alpha[:, None] + _rowwise_mm(p.to(v.dtype), v)
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _norm_w(w_ptr, D: tl.constexpr):
    """A q / k norm weight's two halves [1, D / 2] as stored: a parameter, loaded before the PDL wait
    (after the norm's reduction it was a dependent round trip to DRAM)."""
    j = tl.arange(0, D // 2)[None, :]
    return tl.load(w_ptr + j), tl.load(w_ptr + D // 2 + j)


@triton.jit
def _norm_rope(base, ok, w, cs_base, sn_base, eps, off, D: tl.constexpr, DT: tl.constexpr, tables=0,
               PRE: tl.constexpr = False):
    """Head vectors at `base` [M] (row pointers, where ok) -> the two halves [M, D / 2] of
    rope(RMSNorm(x) * (w + off)) in DT (w: `_norm_w`'s halves): the norm in fp32 rounded to DT
    (RMSNorm's type_as), then rotate-half RoPE in fp32 with each row's cos / sin (cs_base / sn_base [M]),
    rounded once: the arithmetic of kernels/qkv_finish.py, on [M] rows. PRE: the rows' cos / sin halves
    given as `tables` (c1, s1, c2, s2 [M, D / 2], loaded by the caller), else loaded here after the norm."""
    HALF: tl.constexpr = D // 2
    j = tl.arange(0, HALF)[None, :]
    m = ok[:, None]
    x1 = tl.load(base[:, None] + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base[:, None] + HALF + j, mask=m, other=0.0).to(tl.float32)
    w1, w2 = w
    inv = (1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps))[:, None]
    n1 = (x1 * inv * (w1.to(tl.float32) + off)).to(DT).to(tl.float32)
    n2 = (x2 * inv * (w2.to(tl.float32) + off)).to(DT).to(tl.float32)
    # cos / sin after the reduction, as they are used: [M, D / 2] each, loaded ahead of it they spilled
    # (sm_90a: 8 rows of a full layer)
    if PRE:
        c1, s1, c2, s2 = tables
        y1 = n1 * c1.to(tl.float32) - n2 * s1.to(tl.float32)
        y2 = n2 * c2.to(tl.float32) + n1 * s2.to(tl.float32)
    else:
        cs = cs_base[:, None]
        sn = sn_base[:, None]
        y1 = n1 * tl.load(cs + j, mask=m, other=0.0).to(tl.float32) \
            - n2 * tl.load(sn + j, mask=m, other=0.0).to(tl.float32)
        y2 = n2 * tl.load(cs + HALF + j, mask=m, other=0.0).to(tl.float32) \
            + n1 * tl.load(sn + HALF + j, mask=m, other=0.0).to(tl.float32)
    return y1.to(DT), y2.to(DT)


@triton.jit
def _prefetch_l2(base, n0, end, s_row, s_d, BLOCK_N: tl.constexpr, D: tl.constexpr, EMU: tl.constexpr):
    """Rows n0 .. min(n0 + BLOCK_N, end) - 1 of a [*, D] 16-bit cache (row stride s_row) into L2:
    one `prefetch.global.L2` per 128-byte line; no registers held, nothing read that a later load
    depends on (the interpreter: nothing)."""
    if not EMU:
        n = n0 + tl.arange(0, BLOCK_N)[:, None]
        line = (tl.arange(0, D // 64) * 64)[None, :]
        ok = (n < end) & (line >= 0)  # [BLOCK_N, D / 64]: one flag per line
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [base + n * s_row + line * s_d, ok.to(tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _start_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax before any key: (m_i -inf, l_i 0, acc 0)."""
    return (tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
            tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32))


@triton.jit
def _cached_rows(qa, qb, first, k_base, v_base, spos_ptr, b64, ssp_b, ssp_s, start, end, d, d_ok, qpos, qmax, win_lo,
                 tile_win_lo, q_new, sk_s, sk_d, sv_s, sv_d, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, HAS_SLOT_POS: tl.constexpr, HALVES: tl.constexpr, IEEE: tl.constexpr,
                 D: tl.constexpr, OWN: tl.constexpr, EARLY: tl.constexpr):
    """The split's share [start, end) of the cache -> its online-softmax state (m_i, l_i, acc). EARLY: its
    first block is `first` (`_k_block`'s ka, kb, kpos, n_ok and the block's V, loaded by the caller before the
    PDL wait; all masked for an empty split, whose state stays the start state, as with no block at all)."""
    m_i, l_i, acc = _start_state(BLOCK_M, BLOCK_D)
    n_from = start
    if EARLY:
        ka, kb, kpos, n_ok, v = first
        m_i, l_i, alpha, p = _scores(qa, qb, ka, kb, kpos, n_ok, qpos, win_lo, m_i, l_i, qk_scale, IEEE, HALVES)
        acc = _accumulate(acc, alpha, p, v, IEEE)
        n_from = start + BLOCK_N
    for n0 in range(n_from, end, BLOCK_N):
        ka, kb, n, kpos, n_ok = _k_block(k_base, spos_ptr, b64, ssp_b, ssp_s, n0, end, d, d_ok, qmax, tile_win_lo,
                                         q_new, sk_s, sk_d, BLOCK_N, HAS_SLOT_POS, HALVES, D, OWN)
        m_i, l_i, alpha, p = _scores(qa, qb, ka, kb, kpos, n_ok, qpos, win_lo, m_i, l_i, qk_scale, IEEE, HALVES)
        v = tl.load(v_base + n[:, None] * sv_s + d[None, :] * sv_d, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = _accumulate(acc, alpha, p, v, IEEE)
    return m_i, l_i, acc


@triton.jit
def _own_rows(qa, qb, qkv_ptr, k_base, v_base, qpos_ptr, kw, cos_ptr, sin_ptr, idx_ptr, b64, kvh, G, Hkv, T,
              sq_b, sq_t, sk_s, sk_d, sv_s, sv_d, sqp_b, sqp_t, scs_b, scs_t, sid_b, sid_t, eps, norm_off, qpos, win_lo,
              qk_scale, pid_m, d, d_ok, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_T: tl.constexpr, V_NORM: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr):
    """A store layer's own T rows of this step from the merged projection (rope(k_norm(k)), v_norm(v),
    rounded as kernels/qkv_finish.py), written into the cache at idx[b, t] (by the first row tile)
    and attended -> their online-softmax state (m_i, l_i, acc)."""
    tn = tl.arange(0, BLOCK_T)
    t_ok = tn < T
    src = qkv_ptr + b64 * sq_b + tn * sq_t
    trow = b64 * scs_b + tn * scs_t
    ka, kb = _norm_rope(src + (G * Hkv + kvh) * D, t_ok, kw, cos_ptr + trow, sin_ptr + trow, eps, norm_off, D, DT)
    vx = tl.load((src + (G * Hkv + Hkv + kvh) * D)[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
    if V_NORM:
        vf = vx.to(tl.float32)
        vx = vf * (1.0 / tl.sqrt(tl.sum(vf * vf, axis=1) / D + eps))[:, None]
    v = vx.to(DT)
    if pid_m == 0:
        slot = tl.load(idx_ptr + b64 * sid_b + tn * sid_t, mask=t_ok, other=0).to(tl.int64)
        j = tl.arange(0, D // 2)[None, :]
        kdst = k_base + slot[:, None] * sk_s
        tl.store(kdst + j * sk_d, ka, mask=t_ok[:, None])
        tl.store(kdst + (j + D // 2) * sk_d, kb, mask=t_ok[:, None])
        tl.store(v_base + slot[:, None] * sv_s + d[None, :] * sv_d, v, mask=t_ok[:, None] & d_ok[None, :])
    kp = tl.load(qpos_ptr + b64 * sqp_b + tn * sqp_t, mask=t_ok, other=-1).to(tl.int32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i, l_i, alpha, p = _scores(qa, qb, ka, kb, kp, t_ok, qpos, win_lo, m_i, l_i, qk_scale, IEEE, True)
    return m_i, l_i, _accumulate(acc, alpha, p, v, IEEE)


@triton.jit
def _group_rows(qpos0_ptr, pid_m, lane, G, T, POS_Q: tl.constexpr):
    """Group tile pid_m's rows (T rows at consecutive positions from *qpos0_ptr): the group
    q0 // POS_Q + pid_m of positions -> (its first position as a row t0, < 0 before the step; each
    lane's row t, head g, whether it is a row of the step, r = t G + g)."""
    q0 = tl.load(qpos0_ptr).to(tl.int32)
    t0 = (q0 // POS_Q + pid_m) * POS_Q - q0
    t = t0 + lane // G
    g = lane % G
    row_ok = (lane < POS_Q * G) & (t >= 0) & (t < T)
    return t0, t, g, row_ok, t * G + g
