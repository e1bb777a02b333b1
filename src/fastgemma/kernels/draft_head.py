"""The MTP drafter's centroid-masked head in two launches: Triton + torch twin.

The drafter picks its token from the candidates of its top-k centroids (E4B: 32 of 2,048 centroids,
128 tokens each, 4,096 candidate rows of 256): centroid scores, top-k, the candidates' ids from
`token_ordering`, their rows of the embedding, their scores, the argmax. In torch that is ~12
kernels per draft token (topk alone ~13 us on the H200). Here:
1. `_centroid_kernel`: scores[n, c] = g[n] . Wc[c], fp32 sums rounded to g's dtype (as F.linear);
   grid (C / CENTROID_BLOCK, rows); under PDL its centroid rows are read before the wait.
2. `_select_kernel`, S programs per selected centroid (top_k of them) and row: each finds the
   top_k itself from the row's C scores (int32 keys in score order; the top_k-th largest key two
   bits a round, the counts of 4 candidates in one block-wide reduction: 8 rounds for bf16 scores,
   where a bisection took 16 and the draft loop 58 us more at k = 7, runs HF; two rounds of 8-bit
   histograms took as long on an H100, 9.79 against 9.67-9.77 us a call, select programs of 1 or 2
   warps 37.6 / 14.4, of 8 warps 9.25, run MI; keys above it, then the lowest indices among keys
   equal to it), takes the p-th selected centroid in index order and its rank
   among the selected (larger score first, the lower index on a tie), scores its s-th 1/S of the
   centroid's candidates (fp32 sums rounded to g's dtype, as the twin's einsum) and keeps the first
   maximum; the row's last program to arrive (an arrival counter, `counters.py`) picks the highest
   score, the earliest (rank, position) on ties: torch.argmax's first maximum over the candidates in
   rank order. The candidates' rows can only be read once the selection is known: S splits a
   centroid's 128 rows (64 KB at E4B) over S programs, so each waits out a shorter read.
   (Earlier versions gave each program 64 centroids to rank against all C with int64 keys and a
   loop over the selected ones among them: 30 us per call on the H200 with a sort, run Z; 35 us
   with ranks, run AA.)
Numerics: the twin ranks centroids with a stable descending sort (ties: lower index first), which
the kernel reproduces exactly; Drafter.next_token's topk may order exact ties otherwise. fp32 sums
run in another order than cuBLAS's, so bf16 scores on a rounding boundary can still differ.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .counters import arrival_counters
from .gemv import _INTERPRET, _pdl_trigger, _pdl_wait, pdl_args

CENTROID_BLOCK = 16  # centroids per program of the score kernel (E4B: 128 programs of 8 KB)
CANDIDATE_SPLITS = 4  # select programs per centroid (E4B: 128 programs of 32 candidates, 16 KB each)


@triton.jit
def _row_blocks(w_ptr, rows, ok, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rows `rows` of w [*, H] (where ok), as H / BLOCK_H blocks [len(rows), BLOCK_H] (all in flight)."""
    blocks = ()
    for h0 in tl.static_range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        blocks = blocks + (tl.load(w_ptr + rows[:, None] * H + h[None, :], mask=ok[:, None] & (h < H)[None, :],
                                   other=0.0),)
    return blocks


@triton.jit
def _dot_blocks(blocks, g_ptr, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """`_row_blocks`' rows against g [H] -> fp32 sums [len(rows)]."""
    acc = tl.zeros((blocks[0].shape[0],), dtype=tl.float32)
    for i in tl.static_range(len(blocks)):
        h = i * BLOCK_H + tl.arange(0, BLOCK_H)
        g = tl.load(g_ptr + h, mask=h < H, other=0.0).to(tl.float32)
        acc += tl.sum(blocks[i].to(tl.float32) * g[None, :], axis=1)
    return acc


@triton.jit
def _centroid_kernel(g_ptr, w_ptr, s_ptr, C, stride_gn, stride_sn,
                     H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """PDL: the centroid rows (weights) are loaded before the wait, g (the step's state) after it."""
    _pdl_trigger(PDL)  # the select kernel launches and waits for these scores
    pid_c = tl.program_id(0)
    n = tl.program_id(1)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    blocks = _row_blocks(w_ptr, c, c_ok, H, BLOCK_H)
    _pdl_wait(PDL)
    acc = _dot_blocks(blocks, g_ptr + n * stride_gn, H, BLOCK_H)
    tl.store(s_ptr + n * stride_sn + c, acc.to(s_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _keys(s_ptr, c, C, KEY_SHIFT: tl.constexpr):
    """Centroid scores -> int32 keys in score order (-inf past C; -0.0 as +0.0, as torch compares them):
    the order-preserving int of the fp32 bits, shifted right by KEY_SHIFT (16 for bf16 scores, whose
    low 16 bits are zero: the keys then span 2^16 values)."""
    s = tl.load(s_ptr + c, mask=c < C, other=float("-inf")).to(tl.float32)
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True) >> KEY_SHIFT
    MAG: tl.constexpr = 0x7FFFFFFF >> KEY_SHIFT
    return b ^ ((b >> 31) & MAG)  # negative floats: flip the magnitude bits (signed order)


@triton.jit
def _kth_largest(key, K, KEY_BITS: tl.constexpr, DIGIT: tl.constexpr = 2):
    """The K-th largest of the int32 keys (with repeats): the largest t with count(key >= t) >= K,
    DIGIT bits of t a round from the top, the counts of its 2^DIGIT candidates in one block-wide
    reduction (KEY_BITS / DIGIT rounds). Keys offset to unsigned (int64 for 32-bit keys)."""
    if KEY_BITS == 32:
        u = key.to(tl.int64) + (1 << 31)
    else:
        u = key + (1 << (KEY_BITS - 1))
    d = tl.arange(0, 1 << DIGIT).to(u.dtype)
    t = tl.sum(tl.zeros_like(d), axis=0)  # count(u >= t) >= K holds for every t found so far
    for r in tl.static_range(KEY_BITS // DIGIT):
        enough = tl.sum((u[:, None] >= (t + (d << (KEY_BITS - DIGIT * (r + 1))))[None, :]).to(tl.int32), axis=0) >= K
        t = t + ((tl.sum(enough.to(u.dtype), axis=0) - 1) << (KEY_BITS - DIGIT * (r + 1)))
    return (t - (1 << (KEY_BITS - 1))).to(tl.int32)


@triton.jit
def _select_kernel(s_ptr, g_ptr, order_ptr, emb_ptr, pmax_ptr, pord_ptr, ptok_ptr, cnt_ptr, out_ptr,
                   C, TPC, stride_sn, stride_gn,
                   H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, KEY_SHIFT: tl.constexpr, S: tl.constexpr = 1,
                   PDL: tl.constexpr = False):
    _pdl_wait(PDL)  # the centroid scores
    p = tl.program_id(0) // S  # the p-th selected centroid, in index order
    sp = tl.program_id(0) % S  # its candidates sp * TPC / S ..
    n = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    key = _keys(s_ptr + n * stride_sn, c, C, KEY_SHIFT)
    # the top TOP_K: keys above the TOP_K-th largest, then the lowest indices among keys equal to it
    t = _kth_largest(key, TOP_K, 32 - KEY_SHIFT)
    above = key > t
    tie = (key == t) & (c < C)
    sel = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= TOP_K - tl.sum(above.to(tl.int32), axis=0)))
    mine = sel & (tl.cumsum(sel.to(tl.int32), axis=0) == p + 1)
    cent = tl.sum(tl.where(mine, c, 0), axis=0)
    my_key = tl.sum(tl.where(mine, key, 0), axis=0)
    # its rank among the selected: larger keys first, the lower centroid index first on a tie
    rank = tl.sum((sel & ((key > my_key) | ((key == my_key) & (c < cent)))).to(tl.int32), axis=0)
    # its candidates' scores (fp32 sums rounded to g's dtype, as the twin's einsum); the first maximum
    TPS = TPC // S
    j = tl.arange(0, BLOCK_T)
    j_ok = j < TPS
    ids = tl.load(order_ptr + cent.to(tl.int64) * TPC + sp * TPS + j, mask=j_ok, other=0)
    acc = _dot_blocks(_row_blocks(emb_ptr, ids, j_ok, H, BLOCK_H), g_ptr + n * stride_gn, H, BLOCK_H)
    score = tl.where(j_ok, acc.to(emb_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    v = tl.max(score, axis=0)
    first = tl.min(tl.where(score == v, j, BLOCK_T), axis=0)
    P = TOP_K * S  # partial picks per row
    tl.store(pmax_ptr + n * P + tl.program_id(0), v)
    tl.store(pord_ptr + n * P + tl.program_id(0), rank * TPC + sp * TPS + first)
    tl.store(ptok_ptr + n * P + tl.program_id(0), tl.sum(tl.where(j == first, ids, 0), axis=0))
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + n, 1, sem="acq_rel", scope="gpu")
    if arrived == P - 1:  # the row's last program: the highest score, the earliest (rank, position)
        q = tl.arange(0, BLOCK_P)
        q_ok = q < P
        pv = tl.load(pmax_ptr + n * P + q, mask=q_ok, other=float("-inf"), cache_modifier=".cg")
        po = tl.load(pord_ptr + n * P + q, mask=q_ok, other=2147483647, cache_modifier=".cg")
        ptk = tl.load(ptok_ptr + n * P + q, mask=q_ok, other=0, cache_modifier=".cg")
        po = tl.where(pv == tl.max(pv, axis=0), po, 2147483647)
        tl.store(out_ptr + n, tl.sum(tl.where(po == tl.min(po, axis=0), ptk, 0), axis=0))
        tl.store(cnt_ptr + n, 0)


def _check(g, centroids, ordering, emb, top_k):
    if g.dim() != 2 or centroids.dim() != 2 or emb.dim() != 2:
        raise ValueError(f"g [N, H], centroids [C, H] and emb [V, H] expected, got {tuple(g.shape)}, "
                         f"{tuple(centroids.shape)}, {tuple(emb.shape)}")
    C, H = centroids.shape
    V = emb.shape[0]
    if g.shape[1] != H or emb.shape[1] != H or g.dtype != centroids.dtype or emb.dtype != g.dtype:
        raise ValueError(f"g, centroids and emb need one hidden size and dtype: {tuple(g.shape)} {g.dtype}, "
                         f"{tuple(centroids.shape)} {centroids.dtype}, {tuple(emb.shape)} {emb.dtype}")
    if V % C or ordering.dtype != torch.int64 or tuple(ordering.shape) != (V,):
        raise ValueError(f"token_ordering must be int64 [V] = [{V}] with V a multiple of C = {C}, got "
                         f"{ordering.dtype} {tuple(ordering.shape)}")
    if not 1 <= top_k <= C:
        raise ValueError(f"top_k must be in [1, {C}], got {top_k}")
    return C, H, V


def candidate_splits(tokens_per_centroid: int, splits: int = 0) -> int:
    """Select programs per centroid: `splits` (it must divide the centroid's tokens), or for 0 the
    largest divisor of them up to CANDIDATE_SPLITS."""
    if splits:
        if splits < 1 or tokens_per_centroid % splits:
            raise ValueError(f"draft_head splits must divide the {tokens_per_centroid} tokens of a centroid, "
                             f"got {splits}")
        return splits
    return max(s for s in range(1, CANDIDATE_SPLITS + 1) if tokens_per_centroid % s == 0)


def draft_head(g, centroids, ordering, emb, top_k: int, pdl: bool = False, splits: int = 0) -> torch.Tensor:
    """Triton: g [N, H] (final-norm drafter state) -> token ids [N] int64; centroids [C, H],
    ordering [V] (token_ordering), emb [V, H] (the head's rows). No host sync. pdl: both launches
    programmatic dependent ones (the centroid rows read while the kernel before runs). splits: select
    programs per centroid (`candidate_splits`; 0: the default)."""
    C, H, V = _check(g, centroids, ordering, emb, top_k)
    S = candidate_splits(V // C, splits)
    if not (g.is_cuda or _INTERPRET):
        raise RuntimeError("draft_head runs on CUDA tensors (or with TRITON_INTERPRET=1); use draft_head_ref")
    if not (centroids.is_contiguous() and emb.is_contiguous() and ordering.is_contiguous()):
        raise ValueError("draft_head: centroids, emb and token_ordering must be contiguous")
    N = g.shape[0]
    if g.stride(1) != 1:
        g = g.contiguous()
    scores = torch.empty(N, C, device=g.device, dtype=g.dtype)
    block_h = min(64, triton.next_power_of_2(H))
    launch = pdl_args(pdl, g.device)
    _centroid_kernel[(triton.cdiv(C, CENTROID_BLOCK), N)](g, centroids, scores, C, g.stride(0), scores.stride(0), H=H,
                                                          BLOCK_C=CENTROID_BLOCK, BLOCK_H=block_h, num_warps=4, **launch)
    pmax = torch.empty(N, top_k * S, device=g.device, dtype=torch.float32)
    pord = torch.empty(N, top_k * S, device=g.device, dtype=torch.int32)
    ptok = torch.empty(N, top_k * S, device=g.device, dtype=torch.int64)
    out = torch.empty(N, device=g.device, dtype=torch.int64)
    cnt = arrival_counters(g.device, N, "draft_head")
    # bf16 scores (F.linear's rounding) carry 16 significant bits: keys of 16 bits, 16 bisection steps
    shift = 16 if scores.dtype == torch.bfloat16 else 0
    _select_kernel[(top_k * S, N)](scores, g, ordering, emb, pmax, pord, ptok, cnt, out, C, V // C, scores.stride(0),
                                   g.stride(0), H=H, TOP_K=top_k, BLOCK_C=triton.next_power_of_2(C),
                                   BLOCK_T=triton.next_power_of_2(V // C // S), BLOCK_H=block_h,
                                   BLOCK_P=triton.next_power_of_2(top_k * S), KEY_SHIFT=shift, S=S, num_warps=4,
                                   **launch)
    return out


def draft_head_ref(g, centroids, ordering, emb, top_k: int, pdl: bool = False, splits: int = 0) -> torch.Tensor:
    """The twin: F.linear scores, a stable descending sort (ties: lower centroid first), the
    candidates in rank order, their einsum scores, the first maximum (pdl, splits: `draft_head`'s,
    unused)."""
    C, H, V = _check(g, centroids, ordering, emb, top_k)
    s = F.linear(g, centroids)
    top = torch.sort(s.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    cand = ordering.view(C, V // C)[top].flatten(1)  # [N, top_k * V / C]
    scores = torch.einsum("nkd,nd->nk", emb[cand], g)
    return cand.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)


# an opaque op, so torch.compile traces around the launches
@torch.library.custom_op("fastgemma::draft_head", mutates_args=())
def draft_head_op(g: torch.Tensor, centroids: torch.Tensor, ordering: torch.Tensor, emb: torch.Tensor,
                  top_k: int, pdl: bool = False, splits: int = 0) -> torch.Tensor:
    return draft_head(g, centroids, ordering, emb, top_k, pdl, splits)


@draft_head_op.register_fake
def _(g, centroids, ordering, emb, top_k, pdl=False, splits=0):
    return g.new_empty(g.shape[0], dtype=torch.int64)
