"""The MTP drafter's centroid-masked head in two launches: Triton + torch twin.

The drafter picks its token from the candidates of its top-k centroids (E4B: 32 of 2,048 centroids,
128 tokens each, 4,096 candidate rows of 256): centroid scores, top-k, the candidates' ids from
`token_ordering`, their rows of the embedding, their scores, the argmax. In torch that is ~12
kernels per draft token (topk alone ~13 us on the H200). Here:
1. `_centroid_kernel`: scores[n, c] = g[n] . Wc[c], fp32 sums rounded to g's dtype (as F.linear);
   grid (C / BLOCK_C, rows).
2. `_select_kernel`, one program per (rank j < top_k, row n): ranks the C scores with one sort of
   int64 keys (order-preserving score bits, then the lower centroid index first among ties), takes
   the j-th centroid, scores its tokens' rows (fp32 sums rounded to g's dtype, as the einsum in
   the twin), keeps its best (first candidate among ties) and, the last program of the row to
   arrive (an arrival counter, `counters.py`), picks the row's token: the highest score, the lower
   rank among ties. That is torch.argmax's first maximum over the candidates in rank order.
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
from .gemv import _INTERPRET


@triton.jit
def _centroid_kernel(g_ptr, w_ptr, s_ptr, C, stride_gn, stride_sn,
                     H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_c = tl.program_id(0)
    n = tl.program_id(1)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for h0 in tl.static_range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < H
        g = tl.load(g_ptr + n * stride_gn + h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c[:, None] * H + h[None, :], mask=c_ok[:, None] & h_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * g[None, :], axis=1)
    tl.store(s_ptr + n * stride_sn + c, acc.to(s_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _select_kernel(s_ptr, g_ptr, order_ptr, emb_ptr, pmax_ptr, ptok_ptr, cnt_ptr, out_ptr,
                   C, TPC, stride_sn, stride_gn,
                   H: tl.constexpr, TOP_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    j = tl.program_id(0)
    n = tl.program_id(1)
    # rank the centroids: key = order-preserving int of the score (high 32 bits), then BLOCK_C - 1 - c
    # (low 32 bits: the lower index wins a tie in a descending sort); padding scores are -inf
    c = tl.arange(0, BLOCK_C)
    s = tl.load(s_ptr + n * stride_sn + c, mask=c < C, other=float("-inf")).to(tl.float32)
    b = s.to(tl.int32, bitcast=True)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits (signed order)
    k64 = (key.to(tl.int64) << 32) | (BLOCK_C - 1 - c).to(tl.int64)
    ranked = tl.sort(k64, descending=True)
    pick = tl.sum(tl.where(c == j, ranked, 0), axis=0)
    cent = BLOCK_C - 1 - (pick & 0xFFFFFFFF).to(tl.int32)
    # this centroid's candidates: ids from token_ordering, their embedding rows against g
    t = tl.arange(0, BLOCK_T)
    t_ok = t < TPC
    ids = tl.load(order_ptr + cent.to(tl.int64) * TPC + t, mask=t_ok, other=0)
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h0 in tl.static_range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < H
        g = tl.load(g_ptr + n * stride_gn + h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(emb_ptr + ids[:, None] * H + h[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * g[None, :], axis=1)
    score = tl.where(t_ok, acc.to(emb_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    best = tl.max(score, axis=0)
    first = tl.min(tl.where(score == best, t, BLOCK_T), axis=0)
    tok = tl.sum(tl.where(t == first, ids, 0), axis=0)
    tl.store(pmax_ptr + n * TOP_K + j, best)
    tl.store(ptok_ptr + n * TOP_K + j, tok)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + n, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:  # the row's last program: the best rank's token (lower rank on ties)
        r = tl.arange(0, BLOCK_K)
        r_ok = r < TOP_K
        v = tl.load(pmax_ptr + n * TOP_K + r, mask=r_ok, other=float("-inf"), cache_modifier=".cg")
        ptok = tl.load(ptok_ptr + n * TOP_K + r, mask=r_ok, other=0, cache_modifier=".cg")
        vmax = tl.max(v, axis=0)
        r_best = tl.min(tl.where(v == vmax, r, BLOCK_K), axis=0)
        tl.store(out_ptr + n, tl.sum(tl.where(r == r_best, ptok, 0), axis=0))
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


def draft_head(g, centroids, ordering, emb, top_k: int) -> torch.Tensor:
    """Triton: g [N, H] (final-norm drafter state) -> token ids [N] int64; centroids [C, H],
    ordering [V] (token_ordering), emb [V, H] (the head's rows). No host sync."""
    C, H, V = _check(g, centroids, ordering, emb, top_k)
    if not (g.is_cuda or _INTERPRET):
        raise RuntimeError("draft_head runs on CUDA tensors (or with TRITON_INTERPRET=1); use draft_head_ref")
    if not (centroids.is_contiguous() and emb.is_contiguous() and ordering.is_contiguous()):
        raise ValueError("draft_head: centroids, emb and token_ordering must be contiguous")
    N = g.shape[0]
    if g.stride(1) != 1:
        g = g.contiguous()
    scores = torch.empty(N, C, device=g.device, dtype=g.dtype)
    block_h = min(64, triton.next_power_of_2(H))
    _centroid_kernel[(triton.cdiv(C, 64), N)](g, centroids, scores, C, g.stride(0), scores.stride(0),
                                              H=H, BLOCK_C=64, BLOCK_H=block_h, num_warps=4)
    pmax = torch.empty(N, top_k, device=g.device, dtype=torch.float32)
    ptok = torch.empty(N, top_k, device=g.device, dtype=torch.int64)
    out = torch.empty(N, device=g.device, dtype=torch.int64)
    cnt = arrival_counters(g.device, N, "draft_head")
    _select_kernel[(top_k, N)](scores, g, ordering, emb, pmax, ptok, cnt, out, C, V // C, scores.stride(0),
                               g.stride(0), H=H, TOP_K=top_k, BLOCK_C=triton.next_power_of_2(C),
                               BLOCK_T=triton.next_power_of_2(V // C), BLOCK_H=block_h,
                               BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return out


def draft_head_ref(g, centroids, ordering, emb, top_k: int) -> torch.Tensor:
    """The twin: F.linear scores, a stable descending sort (ties: lower centroid first), the
    candidates in rank order, their einsum scores, the first maximum."""
    C, H, V = _check(g, centroids, ordering, emb, top_k)
    s = F.linear(g, centroids)
    top = torch.sort(s.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    cand = ordering.view(C, V // C)[top].flatten(1)  # [N, top_k * V / C]
    scores = torch.einsum("nkd,nd->nk", emb[cand], g)
    return cand.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)


# an opaque op, so torch.compile traces around the launches
@torch.library.custom_op("fastgemma::draft_head", mutates_args=())
def draft_head_op(g: torch.Tensor, centroids: torch.Tensor, ordering: torch.Tensor, emb: torch.Tensor,
                  top_k: int) -> torch.Tensor:
    return draft_head(g, centroids, ordering, emb, top_k)


@draft_head_op.register_fake
def _(g, centroids, ordering, emb, top_k):
    return g.new_empty(g.shape[0], dtype=torch.int64)
