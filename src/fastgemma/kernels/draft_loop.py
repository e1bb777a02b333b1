"""The MTP drafter's whole k-step draft loop in one persistent kernel (`fuse.draft_loop`).

The fused drafter step (fuse=layers) launches ~28 kernels per draft token, each reading 0.1-2.6 MB:
on the H200 the k=7 loop took 0.64-0.66 ms for ~25 MB of weights per token, i.e. it is bound by
launches, not bytes. Here one launch runs all k steps. Its P programs (one per multiprocessor, all
resident at once) go through each step's phases; a phase's work is split over the programs, and a
grid barrier separates a phase from the next one that reads its output:

  pre      z = W_pre [E_t[tok] * sqrt(H_t); h]                        rows over the programs
  layer    q     = W_q rmsnorm(the previous layer's residual update)  (fused_gemv's prologue)
           attn  q_norm + RoPE, then softmax(q K^T) V over the target's K/V: (KV head, split) partials
           merge the splits' partials -> the attention output           (head, dim block) units
           o     = W_o attn
           act   GeGLU(W_gate|up rmsnorm(h)), h += rmsnorm(o) * post_attn  (fused_gemv's prologue)
           down  = W_down act
  post     g = final norm of the last update; h' = W_post g and the centroid scores W_c g
  select   the top-k centroids (every program, as kernels/draft_head.py), the candidates' scores in
           (centroid, chunk) units, each unit's first maximum
  then every program picks the step's token from the units' maxima (all programs agree, so no
  barrier follows), and program 0 writes it out.

E4B's drafter (4 layers) takes 27 barriers per draft token. A barrier: the program's threads meet,
one thread adds 1 to a counter (release, GPU scope) and polls it (acquire) until every program of
the launch has arrived; the counter only grows within a launch and the last program to leave resets
it. Polling gives up after SPIN_LIMIT reads and raises the error flag (a bug then fails, not hangs).

Numerics are the fused drafter step's (kernels/fused_gemv.py's prologue and epilogue roundings, the
drafter head's selection and tie rules, qkv_finish's q norm + RoPE); the GEMV tiles and the
attention's split sums differ, so results match the reference up to the order of fp32 sums. The
tiles do not depend on the program count: one program (the interpreter's, P = 1) computes exactly
what P programs compute.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .draft_head import _keys, _kth_largest
from .fused_gemv import _finish, _fma_block, _h_store, _pro_params, _prologue_scalars, _rnd, _rows
from .gemv import _INTERPRET

SPIN_LIMIT = 1 << 26  # barrier polls before giving up (seconds on the H200)
ALIGN_N = 64  # arena fields start on multiples of 64 elements (vector loads)
ALIGN = tl.constexpr(ALIGN_N)


@triton.jit
def _arrive(bar_ptr):
    """This program's arrival at the next grid barrier: its stores before it (release, GPU scope)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(bar_ptr, err_ptr, target, SPIN: tl.constexpr):
    """Poll until `target` arrivals (acquire): every store before them is seen by the loads after."""
    spins = 0
    while (tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < SPIN):
        spins += 1
    if spins >= SPIN:
        tl.store(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _sync(bar_ptr, err_ptr, nb, nprog, SPIN: tl.constexpr):
    """Grid barrier number nb of the launch -> nb + 1. Every program's stores before it are seen
    by every program's loads after it."""
    _arrive(bar_ptr)
    _wait(bar_ptr, err_ptr, (nb + 1) * nprog, SPIN)
    return nb + 1


@triton.jit
def _leave(bar_ptr, nprog):
    """The last program out of the launch resets the barrier (every program has passed the last one)."""
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == nprog - 1:
        tl.store(bar_ptr, 0)
        tl.store(bar_ptr + 1, 0)


@triton.jit
def _first_tile(pid, nprog, rot, NT: tl.constexpr):
    return (pid + nprog - rot % nprog) % nprog


@triton.jit
def _w_blocks(w_ptr, t, NT: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EPI: tl.constexpr):
    """Tile t's weight blocks (a tuple of [BLOCK_N, BLOCK_K]; zeros past the last tile)."""
    rows, n_ok = _rows(t, N, N // 2, BLOCK_N, EPI)
    n_ok = n_ok & (t < NT)
    offs_k = tl.arange(0, BLOCK_K)
    ws = ()
    for kb in tl.static_range((K + BLOCK_K - 1) // BLOCK_K):
        k = kb * BLOCK_K + offs_k
        ws = ws + (tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0),)
    return ws


@triton.jit
def _gemv_w(pid, nprog, rot, w_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            EPI: tl.constexpr):
    """The program's first tile of a `_gemv` phase, loaded ahead (before the barrier that opens it)."""
    NT: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    return _w_blocks(w_ptr, _first_tile(pid, nprog, rot, NT), NT, N, K, BLOCK_N, BLOCK_K, EPI)


@triton.jit
def _gemv_tile(t, ws, a_ptr, y_ptr, params, h_ptr, out_ptr, inv_y, inv_x, off,
               N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
               HAS_PRE: tl.constexpr, EPI: tl.constexpr, DT: tl.constexpr):
    rows, n_ok = _rows(t, N, N // 2, BLOCK_N, EPI)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kb in tl.static_range((K + BLOCK_K - 1) // BLOCK_K):
        acc = _fma_block(acc, ws[kb], a_ptr, y_ptr, params, kb, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, PRO == 2, HAS_PRE, DT)
    _h_store(t, a_ptr, y_ptr, params, h_ptr, inv_y, off, K, BLOCK_K, PRO, PRO == 2, DT)  # tile 0's program
    _finish(tl.sum(acc, axis=1), rows, n_ok, t, 0.0, out_ptr, N // 2, BLOCK_N, EPI, DT)


@triton.jit
def _gemv(pid, nprog, rot, ws, w_ptr, a_ptr, y_ptr, post_ptr, scale_ptr, pre_ptr, h_ptr, out_ptr, eps, off,
          N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
          HAS_PRE: tl.constexpr, EPI: tl.constexpr, DT: tl.constexpr):
    """out = epilogue(W prologue(a, y)) for W [N, K], tiles of BLOCK_N rows over the programs (tile t
    on program (t + rot) % nprog; ws: the first one's weights, from `_gemv_w`). PRO / EPI as
    kernels/fused_gemv.py (PRO 2 has the layer scalar); with PRO 2 the program of tile 0 writes the
    new residual to h_ptr."""
    params = _pro_params(post_ptr, pre_ptr, scale_ptr, tl.arange(0, BLOCK_K), K, BLOCK_K, PRO, PRO == 2, HAS_PRE)
    inv_y, inv_x = _prologue_scalars(a_ptr, y_ptr, params, eps, off, K, BLOCK_K, PRO, PRO == 2, HAS_PRE, DT)
    NT: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    t0 = _first_tile(pid, nprog, rot, NT)
    if t0 < NT:
        _gemv_tile(t0, ws, a_ptr, y_ptr, params, h_ptr, out_ptr, inv_y, inv_x, off,
                   N, K, BLOCK_N, BLOCK_K, PRO, HAS_PRE, EPI, DT)
    for t in range(t0 + nprog, NT, nprog):
        _gemv_tile(t, _w_blocks(w_ptr, t, NT, N, K, BLOCK_N, BLOCK_K, EPI), a_ptr, y_ptr, params, h_ptr,
                   out_ptr, inv_y, inv_x, off, N, K, BLOCK_N, BLOCK_K, PRO, HAS_PRE, EPI, DT)


@triton.jit
def _pre(pid, nprog, ws, w_ptr, emb_ptr, tok, s_emb, hid_ptr, out_ptr,
         D: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr):
    """z = W_pre [rnd(E_t[tok] * s_emb); hid] (W_pre [D, 2H]; BLOCK_K divides H; ws: the program's
    first tile, from `_gemv_w`)."""
    NT: tl.constexpr = (D + BLOCK_N - 1) // BLOCK_N
    if pid < NT:
        _pre_tile(pid, ws, emb_ptr, tok, s_emb, hid_ptr, out_ptr, D, H, BLOCK_N, BLOCK_K, DT)
    for t in range(pid + nprog, NT, nprog):
        _pre_tile(t, _w_blocks(w_ptr, t, NT, D, 2 * H, BLOCK_N, BLOCK_K, 0), emb_ptr, tok, s_emb, hid_ptr, out_ptr,
                  D, H, BLOCK_N, BLOCK_K, DT)


@triton.jit
def _pre_tile(t, ws, emb_ptr, tok, s_emb, hid_ptr, out_ptr, D: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, DT: tl.constexpr):
    offs_k = tl.arange(0, BLOCK_K)
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kb in tl.static_range(2 * H // BLOCK_K):
        k = kb * BLOCK_K + offs_k
        if kb * BLOCK_K < H:
            x = _rnd(tl.load(emb_ptr + tok * H + k).to(tl.float32) * s_emb, DT)
        else:
            x = tl.load(hid_ptr + (k - H)).to(tl.float32)
        acc += ws[kb].to(tl.float32) * x[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(DT), mask=rows < D)


@triton.jit
def _attend(pid, nprog, q_ptr, qw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, ring_ptr, S, stride_s, stride_h, qpos, window,
            m_ptr, l_ptr, acc_ptr, eps, off, NH: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
            NSPL: tl.constexpr, BLOCK_T: tl.constexpr, RING: tl.constexpr, DT: tl.constexpr):
    """Partials of one query row's attention over a KV-shared source layer: unit (KV head j, split
    sp) takes key blocks sp, sp + NSPL, ... and writes, per query head of j, the running max m, the
    sum l and the unnormalised p @ V (fp32). Its q heads are normed and RoPE'd here (qkv_finish's
    rounding). Keys: slots < S (ring: ring_ptr's positions, -1 empty), 0 <= kpos <= qpos and, with
    a window, kpos > qpos - window; without a ring only the slots up to qpos are read."""
    G: tl.constexpr = NH // HKV
    HALF: tl.constexpr = HD // 2
    j = tl.arange(0, HALF)
    g = tl.arange(0, G)
    if RING:
        NB = (S + BLOCK_T - 1) // BLOCK_T
    else:
        NB = (tl.minimum(qpos + 1, S) + BLOCK_T - 1) // BLOCK_T
    lo = tl.where(window > 0, qpos - window, -1)
    c1 = tl.load(cos_ptr + j).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + j).to(tl.float32)
    s1 = tl.load(sin_ptr + j).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + j).to(tl.float32)
    w1 = tl.load(qw_ptr + j).to(tl.float32) + off
    w2 = tl.load(qw_ptr + HALF + j).to(tl.float32) + off
    for u in range(pid, HKV * NSPL, nprog):
        kvh = u // NSPL
        sp = u % NSPL
        qh = kvh * G + g
        x1 = tl.load(q_ptr + qh[:, None] * HD + j[None, :]).to(tl.float32)
        x2 = tl.load(q_ptr + qh[:, None] * HD + HALF + j[None, :]).to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)
        n1 = _rnd(x1 * inv[:, None] * w1[None, :], DT)
        n2 = _rnd(x2 * inv[:, None] * w2[None, :], DT)
        q1 = _rnd(n1 * c1[None, :] - n2 * s1[None, :], DT)
        q2 = _rnd(n2 * c2[None, :] + n1 * s2[None, :], DT)
        m = tl.full((G,), float("-inf"), tl.float32)
        l = tl.zeros((G,), dtype=tl.float32)
        a1 = tl.zeros((G, HALF), dtype=tl.float32)
        a2 = tl.zeros((G, HALF), dtype=tl.float32)
        for b in range(sp, NB, NSPL):
            t = b * BLOCK_T + tl.arange(0, BLOCK_T)
            if RING:
                kp = tl.load(ring_ptr + t, mask=t < S, other=-1)
            else:
                kp = t
            vis = (t < S) & (kp >= 0) & (kp <= qpos) & (kp > lo)
            base = t[:, None].to(tl.int64) * stride_s + kvh * stride_h
            k1 = tl.load(k_ptr + base + j[None, :], mask=vis[:, None], other=0.0).to(tl.float32)
            k2 = tl.load(k_ptr + base + HALF + j[None, :], mask=vis[:, None], other=0.0).to(tl.float32)
            v1 = tl.load(v_ptr + base + j[None, :], mask=vis[:, None], other=0.0).to(tl.float32)
            v2 = tl.load(v_ptr + base + HALF + j[None, :], mask=vis[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q1[:, None, :] * k1[None, :, :], axis=2) + tl.sum(q2[:, None, :] * k2[None, :, :], axis=2)
            s = tl.where(vis[None, :], s, float("-inf"))
            mn = tl.maximum(m, tl.max(s, axis=1))
            safe = tl.where(mn == float("-inf"), 0.0, mn)
            alpha = tl.exp(m - safe)
            p = tl.exp(s - safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            a1 = a1 * alpha[:, None] + tl.sum(p[:, :, None] * v1[None, :, :], axis=1)
            a2 = a2 * alpha[:, None] + tl.sum(p[:, :, None] * v2[None, :, :], axis=1)
            m = mn
        slot = qh * NSPL + sp
        tl.store(m_ptr + slot, m)
        tl.store(l_ptr + slot, l)
        tl.store(acc_ptr + slot[:, None] * HD + j[None, :], a1)
        tl.store(acc_ptr + slot[:, None] * HD + HALF + j[None, :], a2)


@triton.jit
def _merge(pid, nprog, m_ptr, l_ptr, acc_ptr, out_ptr, NH: tl.constexpr, HD: tl.constexpr, NSPL: tl.constexpr,
           BLOCK_D: tl.constexpr, DT: tl.constexpr):
    """The attention output [NH * HD] from the splits' partials, in split order."""
    NDB: tl.constexpr = HD // BLOCK_D
    SP: tl.constexpr = triton.next_power_of_2(NSPL)
    s = tl.arange(0, SP)
    s_ok = s < NSPL
    for u in range(pid, NH * NDB, nprog):
        h = u // NDB
        d = (u % NDB) * BLOCK_D + tl.arange(0, BLOCK_D)
        ms = tl.load(m_ptr + h * NSPL + s, mask=s_ok, other=float("-inf"))
        ls = tl.load(l_ptr + h * NSPL + s, mask=s_ok, other=0.0)
        mx = tl.max(ms, axis=0)
        wt = tl.exp(ms - tl.where(mx == float("-inf"), 0.0, mx))
        tot = tl.sum(ls * wt, axis=0)
        a = tl.load(acc_ptr + (h * NSPL + s[:, None]) * HD + d[None, :], mask=s_ok[:, None], other=0.0)
        o = tl.sum(a * wt[:, None], axis=0) / tl.where(tot > 0, tot, 1.0)
        tl.store(out_ptr + h * HD + d, o.to(DT))


@triton.jit
def _q_w(pid, nprog, lw, D: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, BN_Q: tl.constexpr,
         BK_D: tl.constexpr):
    """A layer's first q tile (its arena lw), loaded ahead."""
    return _gemv_w(pid, nprog, 0, lw + 4 * D + ALIGN + HD, NH * HD, D, BN_Q, BK_D, 0)


@triton.jit
def _layer(pid, nprog, nb, ws_q, lw, first: tl.constexpr, a_ptr, y_ptr, post_ptr, scale_ptr,
           hq_ptr, h2_ptr, q_ptr, att_ptr, o_ptr, act_ptr, dn_ptr,
           cos_ptr, sin_ptr, k_ptr, v_ptr, ring_ptr, S, stride_s, stride_h, qpos, window,
           m_ptr, l_ptr, acc_ptr, bar_ptr, err_ptr, eps, off,
           D: tl.constexpr, I: tl.constexpr, NH: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
           NSPL: tl.constexpr, BLOCK_T: tl.constexpr, RING: tl.constexpr, BN_Q: tl.constexpr,
           BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DN: tl.constexpr, BK_D: tl.constexpr, BK_I: tl.constexpr,
           BK_A: tl.constexpr, BLOCK_D: tl.constexpr, SPIN: tl.constexpr, DT: tl.constexpr):
    """One drafter layer (its arena lw: norms, scalars, q_norm, q, o, gate|up, down; see DraftLoop),
    from its q phase (ws_q: the first q tile, loaded ahead) to its down phase (the barrier after it
    is the caller's) -> the barrier count. Its residual input: a (first layer, the pre-projection's
    z) or the previous layer's (a, y = down, post = post_ffn norm, scale_ptr = its layer scalar).
    Each GEMV phase's first tile is loaded before the barrier that opens the phase."""
    NQ: tl.constexpr = NH * HD
    ln_in = lw
    post_attn = lw + D
    pre_ff = lw + 2 * D
    qn = lw + 4 * D + ALIGN
    wq = qn + HD
    wo = wq + NQ * D
    wgu = wo + D * NQ
    wdn = wgu + 2 * I * D
    if first:
        _gemv(pid, nprog, 0, ws_q, wq, a_ptr, a_ptr, a_ptr, a_ptr, ln_in, hq_ptr, q_ptr, eps, off,
              NQ, D, BN_Q, BK_D, 1, True, 0, DT)
        h_ptr = a_ptr
    else:
        _gemv(pid, nprog, 0, ws_q, wq, a_ptr, y_ptr, post_ptr, scale_ptr, ln_in, hq_ptr, q_ptr, eps, off,
              NQ, D, BN_Q, BK_D, 2, True, 0, DT)
        h_ptr = hq_ptr
    nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    _attend(pid, nprog, q_ptr, qn, cos_ptr, sin_ptr, k_ptr, v_ptr, ring_ptr, S, stride_s, stride_h, qpos, window,
            m_ptr, l_ptr, acc_ptr, eps, off, NH, HKV, HD, NSPL, BLOCK_T, RING, DT)
    nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    _merge(pid, nprog, m_ptr, l_ptr, acc_ptr, att_ptr, NH, HD, NSPL, BLOCK_D, DT)
    ws = _gemv_w(pid, nprog, 0, wo, D, NQ, BN_O, BK_A, 0)
    nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    _gemv(pid, nprog, 0, ws, wo, att_ptr, att_ptr, att_ptr, att_ptr, att_ptr, att_ptr, o_ptr, eps, off,
          D, NQ, BN_O, BK_A, 0, False, 0, DT)
    ws = _gemv_w(pid, nprog, 0, wgu, 2 * I, D, BN_GU, BK_D, 1)
    nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    # h2 = h + rmsnorm(o) * post_attn (no layer scalar: scale_ptr -> a 1), x = rmsnorm(h2) * pre_ffn
    _gemv(pid, nprog, 0, ws, wgu, h_ptr, o_ptr, post_attn, lw + 4 * D + 1, pre_ff, h2_ptr, act_ptr, eps, off,
          2 * I, D, BN_GU, BK_D, 2, True, 1, DT)
    ws = _gemv_w(pid, nprog, 0, wdn, D, I, BN_DN, BK_I, 0)
    nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    _gemv(pid, nprog, 0, ws, wdn, act_ptr, act_ptr, act_ptr, act_ptr, act_ptr, act_ptr, dn_ptr, eps, off,
          D, I, BN_DN, BK_I, 0, False, 0, DT)
    return nb


@triton.jit
def _pick(pmax, pord, ptok, NU: tl.constexpr):
    """The step's token from the select units' maxima: the highest score, then the earliest (rank,
    position) among equals (every program computes it)."""
    uu = tl.arange(0, triton.next_power_of_2(NU))
    u_ok = uu < NU
    pv = tl.load(pmax + uu, mask=u_ok, other=float("-inf"))
    po = tl.load(pord + uu, mask=u_ok, other=2147483647)
    pt = tl.load(ptok + uu, mask=u_ok, other=0)
    po = tl.where(pv == tl.max(pv, axis=0), po, 2147483647)
    return tl.sum(tl.where(po == tl.min(po, axis=0), pt, 0), axis=0)


@triton.jit
def _draft_loop_kernel(
        arena, emb_t, emb_d, order, tok_ptr, qpos_ptr, cos_s, sin_s, cos_f, sin_f,
        ks, vs, ring, S_s, ss_s, sh_s, kf, vf, S_f, ss_f, sh_f, window,
        z, hq, h2, q, att, o, act, dn, hl, hp, cs, m_buf, l_buf, acc_buf, pmax, pord, ptok,
        drafts, bar_ptr, err_ptr, nsteps, s_emb, eps, off,
        D: tl.constexpr, H: tl.constexpr, I: tl.constexpr, NH: tl.constexpr, HKV: tl.constexpr,
        HD_S: tl.constexpr, HD_F: tl.constexpr, NL: tl.constexpr, KINDS: tl.constexpr, LSZ_S: tl.constexpr,
        LSZ_F: tl.constexpr, GSZ: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, TOP_K: tl.constexpr,
        TPC: tl.constexpr, NSPL: tl.constexpr, BT_S: tl.constexpr, BT_F: tl.constexpr, BT_C: tl.constexpr,
        BN_PRE: tl.constexpr, BK_PRE: tl.constexpr, BN_Q: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
        BN_DN: tl.constexpr, BN_POST: tl.constexpr, BK_D: tl.constexpr, BK_I: tl.constexpr, BK_AS: tl.constexpr,
        BK_AF: tl.constexpr, BLOCK_D: tl.constexpr, KEY_SHIFT: tl.constexpr, SPIN: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DT: tl.constexpr = z.dtype.element_ty
    qpos = tl.load(qpos_ptr)
    tok = tl.load(tok_ptr)
    # the global arena: W_pre [D, 2H], final norm [D], W_post [H, D], centroids [C, D]
    w_fin = arena + 2 * H * D
    w_post = w_fin + ALIGN * ((D + ALIGN - 1) // ALIGN)
    w_c = w_post + H * D
    NT_POST: tl.constexpr = (H + BN_POST - 1) // BN_POST
    NU: tl.constexpr = TOP_K * (TPC // BT_C)
    nb = 0
    for step in range(nsteps):
        ws = _gemv_w(pid, nprog, 0, arena, D, 2 * H, BN_PRE, BK_PRE, 0)
        if step > 0:  # the previous step's token, while W_pre's tile loads
            tok = _pick(pmax, pord, ptok, NU)
            if pid == 0:
                tl.store(drafts + step - 1, tok)
        _pre(pid, nprog, ws, arena, emb_t, tok, s_emb, hp, z, D, H, BN_PRE, BK_PRE, DT)
        lw = arena + GSZ
        lw_prev = lw
        if KINDS & 1:
            ws = _q_w(pid, nprog, lw, D, NH, HD_S, BN_Q, BK_D)
        else:
            ws = _q_w(pid, nprog, lw, D, NH, HD_F, BN_Q, BK_D)
        nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
        for li in tl.static_range(NL):
            if li == 0:
                a_ptr, y_ptr, post_ptr, scale_ptr = z, z, z, z
            else:
                # the previous layer's residual after attention, its down output, post_ffn norm, scalar
                a_ptr, y_ptr, post_ptr, scale_ptr = h2 + (li - 1) * D, dn + (li - 1) * D, lw_prev + 3 * D, lw_prev + 4 * D
            if (KINDS >> li) & 1:
                nb = _layer(pid, nprog, nb, ws, lw, li == 0, a_ptr, y_ptr, post_ptr, scale_ptr, hq + li * D,
                            h2 + li * D, q, att, o, act, dn + li * D, cos_s, sin_s, ks, vs, ring, S_s, ss_s, sh_s,
                            qpos, window, m_buf, l_buf, acc_buf, bar_ptr, err_ptr, eps, off, D, I, NH, HKV, HD_S,
                            NSPL, BT_S, True, BN_Q, BN_O, BN_GU, BN_DN, BK_D, BK_I, BK_AS, BLOCK_D, SPIN, DT)
                lw_prev = lw
                lw = lw + LSZ_S
            else:
                nb = _layer(pid, nprog, nb, ws, lw, li == 0, a_ptr, y_ptr, post_ptr, scale_ptr, hq + li * D,
                            h2 + li * D, q, att, o, act, dn + li * D, cos_f, sin_f, kf, vf, ring, S_f, ss_f, sh_f,
                            qpos, window * 0, m_buf, l_buf, acc_buf, bar_ptr, err_ptr, eps, off, D, I, NH, HKV, HD_F,
                            NSPL, BT_F, False, BN_Q, BN_O, BN_GU, BN_DN, BK_D, BK_I, BK_AF, BLOCK_D, SPIN, DT)
                lw_prev = lw
                lw = lw + LSZ_F
            if li + 1 < NL:
                if (KINDS >> (li + 1)) & 1:
                    ws = _q_w(pid, nprog, lw, D, NH, HD_S, BN_Q, BK_D)
                else:
                    ws = _q_w(pid, nprog, lw, D, NH, HD_F, BN_Q, BK_D)
            else:
                ws = _gemv_w(pid, nprog, 0, w_post, H, D, BN_POST, BK_D, 0)
                ws_c = _gemv_w(pid, nprog, NT_POST, w_c, C, D, BN_POST, BK_D, 0)
            nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
        # post: the last update, the final norm, then h' = W_post g and the centroid scores W_c g
        la = h2 + (NL - 1) * D
        ly = dn + (NL - 1) * D
        _gemv(pid, nprog, 0, ws, w_post, la, ly, lw_prev + 3 * D, lw_prev + 4 * D, w_fin, hl, hp, eps, off,
              H, D, BN_POST, BK_D, 2, True, 0, DT)
        _gemv(pid, nprog, NT_POST, ws_c, w_c, la, ly, lw_prev + 3 * D, lw_prev + 4 * D, w_fin, hl, cs,
              eps, off, C, D, BN_POST, BK_D, 2, True, 0, DT)
        nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
        # select: g from the residual hl, the top-k centroids, the candidates' scores per unit
        dd = tl.arange(0, D)
        hv = tl.load(hl + dd).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(hv * hv, axis=0) / D + eps)
        gv = _rnd(hv * inv * (tl.load(w_fin + dd).to(tl.float32) + off), DT)
        c = tl.arange(0, CP)
        key = _keys(cs, c, C, KEY_SHIFT)
        kth = _kth_largest(key, TOP_K, 32 - KEY_SHIFT)
        above = key > kth
        tie = (key == kth) & (c < C)
        sel = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= TOP_K - tl.sum(above.to(tl.int32), axis=0)))
        nth = tl.cumsum(sel.to(tl.int32), axis=0)
        for u in range(pid, NU, nprog):
            p = u // (TPC // BT_C)
            ch = u % (TPC // BT_C)
            mine = sel & (nth == p + 1)
            cent = tl.sum(tl.where(mine, c, 0), axis=0)
            my_key = tl.sum(tl.where(mine, key, 0), axis=0)
            rank = tl.sum((sel & ((key > my_key) | ((key == my_key) & (c < cent)))).to(tl.int32), axis=0)
            jj = ch * BT_C + tl.arange(0, BT_C)
            ids = tl.load(order + cent.to(tl.int64) * TPC + jj)
            rows = tl.load(emb_d + ids[:, None] * D + dd[None, :]).to(tl.float32)
            score = tl.sum(rows * gv[None, :], axis=1).to(DT).to(tl.float32)
            v = tl.max(score, axis=0)
            first = tl.min(tl.where(score == v, jj, TPC), axis=0)
            tl.store(pmax + u, v)
            tl.store(pord + u, rank * TPC + first)
            tl.store(ptok + u, tl.sum(tl.where(jj == first, ids, 0), axis=0))
        nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    tok = _pick(pmax, pord, ptok, NU)
    if pid == 0:
        tl.store(drafts + nsteps - 1, tok)
    _leave(bar_ptr, nprog)


# ---------------------------------------------------------------------------------------------
# host side


class DraftLoopError(ValueError):
    pass


def _pad(n: int) -> int:
    return ALIGN_N * ((n + ALIGN_N - 1) // ALIGN_N)


def global_size(D: int, H: int, C: int) -> int:
    """The arena's head (the kernel's GSZ): W_pre [D, 2H], final norm [D] padded, W_post [H, D],
    centroids [C, D] padded."""
    return 2 * H * D + _pad(D) + H * D + _pad(C * D)


def layer_size(D: int, NH: int, hd: int, I: int) -> int:
    """One layer's arena (the kernel's LSZ_S / LSZ_F): 4 norms [D], a header of ALIGN_N (layer scalar,
    a 1), q_norm [hd], q [NH hd, D], o [D, NH hd], gate|up [2I, D], down [D, I], padded."""
    return _pad(4 * D + ALIGN_N + hd + 2 * NH * hd * D + 3 * I * D)


def _pow2_block(n: int, parts: int, lo: int, hi: int) -> int:
    """Rows per tile: about n / parts (a power of two in [lo, hi])."""
    return max(lo, min(hi, triton.next_power_of_2(max(1, -(-n // parts)))))


def _divisor_block(n: int, hi: int) -> int:
    """The largest power of two <= hi dividing n."""
    b = 1
    while b * 2 <= hi and n % (b * 2) == 0:
        b *= 2
    return b


class DraftLoop:
    """k draft tokens of a one-row MTP drafter in one launch: `loop(tok, hid, pos, k)` -> [1, k] ids,
    tok, pos [1, 1] (the last accepted token and its position), hid [1, 1, H_t] (the target's
    final-norm hidden state there). Built once per engine (the KV cache and the weights are read in
    place but for a packed copy of the drafter's matrices, ~25 MB for E4B's); no host sync per call,
    CUDA-graph capturable. `programs`: the grid (default: one per multiprocessor on a GPU, one in
    the interpreter), at most the multiprocessor count, since every program must be resident for the
    barriers; `splits`: the attention's key splits per KV head. `check()` raises if a barrier gave
    up (it reads the error flag: a host sync)."""

    def __init__(self, drafter, target_embed: torch.Tensor, cache, *, programs: int | None = None,
                 splits: int | None = None):
        from torch import nn

        from ..model.config import FULL, SLIDING
        from ..model.decoder import _rounded

        c = drafter.config
        dev = target_embed.device
        if not (target_embed.is_cuda or _INTERPRET):
            raise RuntimeError("DraftLoop runs on CUDA tensors (or with TRITON_INTERPRET=1)")
        if drafter.masked_embedding is None:
            raise DraftLoopError("fuse.draft_loop needs a drafter with a centroid-masked head (ordered_embeddings)")
        layers = drafter.model.layers
        for i, layer in enumerate(layers):
            mlp = layer.mlp
            mods = {"self_attn.q_proj": layer.self_attn.q_proj, "self_attn.o_proj": layer.self_attn.o_proj,
                    "mlp.gate_up_proj": getattr(mlp, "gate_up_proj", None), "mlp.down_proj": mlp.down_proj}
            for name, mod in mods.items():
                if type(mod) is not nn.Linear or mod.bias is not None:
                    raise DraftLoopError(f"fuse.draft_loop reads dense bias-free linears with gate|up merged; drafter "
                                         f"layers.{i}.{name} is {type(mod).__name__}")
        D, H, I = c.hidden_size, c.backbone_hidden_size, c.intermediate_size
        NH, HKV, C = c.num_heads, c.num_kv_heads, c.num_centroids
        TPC = c.vocab_size // C
        top_k = drafter.top_k
        if D & (D - 1) or D < 16 or C & (C - 1) or TPC & (TPC - 1) or NH % HKV or (NH // HKV) & (NH // HKV - 1):
            raise DraftLoopError(f"fuse.draft_loop needs powers of two for the hidden size ({D}), the centroids "
                                 f"({C}), the tokens per centroid ({TPC}) and the query heads per KV head "
                                 f"({NH}/{HKV})")
        if H % 16:
            raise DraftLoopError(f"fuse.draft_loop needs the target's hidden size a multiple of 16, got {H}")
        kinds = [layer.spec.sliding for layer in layers]
        hd_s, hd_f = c.head_dim, c.global_head_dim
        for layer in layers:
            if layer.self_attn.head_dim != (hd_s if layer.spec.sliding else hd_f):
                raise DraftLoopError("fuse.draft_loop: a layer's head_dim differs from its kind's")
        src = drafter.sources
        sl_src = src.get(SLIDING)
        fl_src = src.get(FULL)
        if (any(kinds) and sl_src is None) or (not all(kinds) and fl_src is None):
            raise DraftLoopError("fuse.draft_loop: the target has no KV source for one of the drafter's layer kinds")
        n_sm = torch.cuda.get_device_properties(dev).multi_processor_count if target_embed.is_cuda else 1
        P = int(programs or n_sm)
        if not 1 <= P <= n_sm:
            raise DraftLoopError(f"fuse.draft_loop: programs={P} must be in [1, {n_sm}] (every program resident)")
        nspl = int(splits or max(1, min(32, P // HKV)))
        dt = target_embed.dtype
        self.drafter, self.cache, self.P, self.dtype = drafter, cache, P, dt
        self.emb_t = target_embed
        # the arena: W_pre, final norm, W_post, centroids; then per layer its norms, scalars, q_norm,
        # q, o, gate|up, down (the kernel's offsets)
        parts, sizes = [], []

        def put(t, pad=False):
            flat = t.detach().reshape(-1).to(dt)
            parts.append(flat)
            if pad and flat.numel() % ALIGN_N:
                parts.append(torch.zeros(ALIGN_N - flat.numel() % ALIGN_N, dtype=dt, device=dev))

        put(drafter.pre_projection.weight)
        put(drafter.model.norm.weight, pad=True)
        put(drafter.post_projection.weight)
        put(drafter.masked_embedding.centroids.weight, pad=True)
        gsz = sum(p.numel() for p in parts)
        for layer in layers:
            start = sum(p.numel() for p in parts)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                         layer.post_feedforward_layernorm):
                put(norm.weight)
            hdr = torch.zeros(ALIGN_N, dtype=dt, device=dev)
            hdr[0] = layer.layer_scalar.reshape(-1)[0].to(dt)
            hdr[1] = 1.0
            put(hdr)
            at = layer.self_attn
            for t in (at.q_norm.weight, at.q_proj.weight, at.o_proj.weight, layer.mlp.gate_up_proj.weight,
                      layer.mlp.down_proj.weight):
                put(t)
            used = sum(p.numel() for p in parts) - start
            if used % ALIGN_N:
                parts.append(torch.zeros(ALIGN_N - used % ALIGN_N, dtype=dt, device=dev))
            sizes.append(sum(p.numel() for p in parts) - start)
        self.arena = torch.cat(parts)
        # the kernel's offsets come from the layout's formulas
        assert gsz == global_size(D, H, C), (gsz, global_size(D, H, C))
        for s, sliding in zip(sizes, kinds):
            assert s == layer_size(D, NH, hd_s if sliding else hd_f, I), (s, sliding)
        hd_max = max(hd_s if any(kinds) else 0, hd_f if not all(kinds) else 0)
        nq_max = NH * hd_max
        bc = min(TPC, 32)
        nu = top_k * (TPC // bc)
        new = lambda *shape, dtype=dt: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        L = len(layers)
        self.ws = dict(z=new(D), hq=new(L * D), h2=new(L * D), q=new(nq_max), att=new(nq_max), o=new(D),
                       act=new(I), dn=new(L * D), hl=new(D), hp=new(H), cs=new(C),
                       m=new(NH * nspl, dtype=torch.float32), l=new(NH * nspl, dtype=torch.float32),
                       acc=new(NH * nspl * hd_max, dtype=torch.float32), pmax=new(nu, dtype=torch.float32),
                       pord=new(nu, dtype=torch.int32), ptok=new(nu, dtype=torch.int64))
        self.bar = torch.zeros(2, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.drafts = torch.zeros(1, 64, dtype=torch.long, device=dev)
        dummy_kv = self.ws["z"]
        self._kv = {}
        for key, s in (("s", sl_src), ("f", fl_src)):
            if s is None:
                self._kv[key] = (dummy_kv, dummy_kv, 1, 0, 0)
            else:
                k, v = cache.k[s], cache.v[s]
                if k.shape[0] != 1:
                    raise DraftLoopError(f"fuse.draft_loop runs one row: the cache holds batch {k.shape[0]}")
                if k.stride() != v.stride() or k.stride(3) != 1:
                    raise DraftLoopError("fuse.draft_loop: the K and V caches need one layout, contiguous in head_dim")
                self._kv[key] = (k, v, k.shape[1], k.stride(1), k.stride(2))
        self.meta = dict(
            D=D, H=H, I=I, NH=NH, HKV=HKV, HD_S=hd_s, HD_F=hd_f, NL=L,
            KINDS=sum(1 << i for i, s in enumerate(kinds) if s), LSZ_S=layer_size(D, NH, hd_s, I),
            LSZ_F=layer_size(D, NH, hd_f, I), GSZ=gsz,
            C=C, CP=triton.next_power_of_2(C), TOP_K=top_k, TPC=TPC, NSPL=nspl,
            BT_S=16 if target_embed.is_cuda else 4, BT_F=8 if target_embed.is_cuda else 4, BT_C=bc,
            BN_PRE=_pow2_block(D, P, 1, 16), BK_PRE=_divisor_block(H, 512),
            BN_Q=_pow2_block(NH * hd_s, P, 1, 64), BN_O=_pow2_block(D, P, 1, 16),
            BN_GU=_pow2_block(2 * I, P, 2, 64), BN_DN=_pow2_block(D, P, 1, 16),
            BN_POST=_pow2_block(H, P, 1, 64), BK_D=D, BK_I=min(512, triton.next_power_of_2(I)),
            BK_AS=min(512, triton.next_power_of_2(NH * hd_s)), BK_AF=min(512, triton.next_power_of_2(NH * hd_f)),
            BLOCK_D=min(32, hd_s, hd_f), KEY_SHIFT=16 if dt == torch.bfloat16 else 0, SPIN=SPIN_LIMIT)
        self.window = int(cache.window)
        self.s_emb = _rounded(H ** 0.5, dt)  # as Drafter.embed_input scales E_t[tok]
        self.eps, self.off = float(c.rms_eps), float(c.body_config().norm_offset)

    def __call__(self, tok: torch.Tensor, hid: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
        if tok.shape[0] != 1 or hid.shape[0] != 1 or pos.shape[0] != 1:
            raise DraftLoopError(f"fuse.draft_loop runs one row, got batch {tok.shape[0]}")
        if not 1 <= k <= self.drafts.shape[1]:
            raise DraftLoopError(f"fuse.draft_loop: depth k={k} must be in [1, {self.drafts.shape[1]}]")
        d, w = self.drafter, self.ws
        rope = d.rope(pos, self.dtype)
        cs_s, sn_s = (t.reshape(-1).contiguous() for t in rope[True])
        cs_f, sn_f = (t.reshape(-1).contiguous() for t in rope[False])
        qpos = (pos - 1).reshape(-1)
        w["hp"].copy_(hid.reshape(-1))
        ks, vs, S_s, ss_s, sh_s = self._kv["s"]
        kf, vf, S_f, ss_f, sh_f = self._kv["f"]
        me = d.masked_embedding
        _draft_loop_kernel[(self.P,)](
            self.arena, self.emb_t, d.model.embed_tokens.weight, me.token_ordering, tok.reshape(-1), qpos,
            cs_s, sn_s, cs_f, sn_f, ks, vs, self.cache.ring_pos, S_s, ss_s, sh_s, kf, vf, S_f, ss_f, sh_f,
            self.window, w["z"], w["hq"], w["h2"], w["q"], w["att"], w["o"], w["act"], w["dn"], w["hl"], w["hp"],
            w["cs"], w["m"], w["l"], w["acc"], w["pmax"], w["pord"], w["ptok"], self.drafts, self.bar, self.err,
            k, self.s_emb, self.eps, self.off, num_warps=4, **self.meta)
        return self.drafts[:, :k].clone()

    def hidden(self) -> torch.Tensor:
        """The last draft step's projected hidden state h' [1, 1, H_t] (for checks)."""
        return self.ws["hp"].view(1, 1, -1).clone()

    def check(self) -> None:
        if int(self.err.item()):
            raise RuntimeError("fuse.draft_loop: a grid barrier gave up waiting (programs not all resident?)")
