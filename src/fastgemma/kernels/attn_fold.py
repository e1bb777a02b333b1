"""The split-KV attention's combine folded into the GEMV after it (o): one row's partials as the
tensor-core kernel's B columns, weighed per head in its accumulators. No combine launch.

A one-row split-KV attention leaves, per KV head, NS <= 8 splits' outputs o_s (normalised, bf16:
kernels/decode_attention.py's `parts` mode, an empty split's zeros) and their lse_s (log2). The
combine computes x = sum_s w_s o_s with w_s = 2^(lse_s - max) / sum 2^(lse_s' - max), per query
head, and o computes W x. Since o is linear in x,

    W x = sum_s w_s (W o_s)          (w_s constant over the k of one head)

kernels/mma_w4a16.py's mma takes up to 8 activation rows as the B operand's columns: here column
c is split c's o (lane g*4 + tq of the mma reads split g's x, as it reads row g of a many-row x).
A group of G k lies in one head when the head dim is a multiple of G, so each group's sums, one per
column, are weighed by that head's w before they are added to the accumulator, and the 8 columns
are added in the store (`_col_sum`). The weights are made from the NS lse values of the head, in
each thread that needs them (no cross-thread reduction).

Rounding: the combine rounds x once to bf16; here each o_s is rounded to bf16 and x is never
rounded, so o agrees with the combine + o launches to bf16 rounding, not bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLITS = 8  # the mma's B columns


@triton.jit
def _part_x_ptrs(x_ptr, r, oj, NS: tl.constexpr, PG: tl.constexpr, PD: tl.constexpr):
    """The lane's column base in the partials [Hkv, NS, PG, PD] (bf16, as int32 words): split
    min(g, NS - 1) for lane g*4 + tq (columns past NS read the last split; their weight is 0) and the
    lane's 16 k of a 64-k block, as `_x_ptrs` takes them."""
    lane = r % 32
    return x_ptr.to(tl.pointer_type(tl.int32)) + tl.minimum(lane // 4, NS - 1) * (PG * PD // 2) + (lane % 4) * 8 + oj


@triton.jit
def _part_head(r, g, K: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, W: tl.constexpr, PG: tl.constexpr,
               PD: tl.constexpr):
    """Group g of each row's warp K slice: (its KV head, its query head within the KV head, its first k
    within the head), [R, 1] each."""
    k0 = ((r // 32) // T) * (K // W) + g * GROUP
    hd = k0 // PD
    return hd // PG, hd % PG, k0 % PD


@triton.jit
def _part_group_ptrs(xc_ptrs, r, g, NS: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr,
                     W: tl.constexpr, PG: tl.constexpr, PD: tl.constexpr):
    """Group g's first x words (`_group_acc`'s xg) from the lane's column base."""
    kvh, rr, kd = _part_head(r, g, K, GROUP, T, W, PG, PD)
    # in 64-k blocks (32 words; a group starts a whole number of them into its head), so the compiler sees
    # 16-byte aligned lane loads
    return xc_ptrs + ((kvh * NS * PG + rr) * (PD // 64) + kd // 64) * 32


@triton.jit
def _part_weights(lse_ptr, r, oj, g, NS: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr,
                  W: tl.constexpr, PG: tl.constexpr, PD: tl.constexpr):
    """The combine's weights for group g's head at the accumulator's elements [R, 4] (element c of lane
    g*4 + tq: column tq*2 + c % 2), 0 for the columns past NS: 2^(lse_s - max) / sum, as
    `_combine_kernel` weighs (an empty split's lse is -inf: weight 0)."""
    kvh, rr, _ = _part_head(r, g, K, GROUP, T, W, PG, PD)
    base = lse_ptr + kvh * (NS * PG) + rr
    ls = ()
    for s in tl.static_range(NS):
        ls = ls + (tl.load(base + s * PG),)
    mx = ls[0]
    for s in tl.static_range(1, NS):
        mx = tl.maximum(mx, ls[s])
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    col = (r % 32 % 4) * 2 + oj % 2
    tot = tl.zeros_like(mx)
    w = tl.zeros((r.shape[0], 4), dtype=tl.float32)
    for s in tl.static_range(NS):
        e = tl.exp2(ls[s] - mx)
        tot += e
        w = tl.where(col == s, e, w)
    return w / tl.where(tot > 0.0, tot, 1.0)


@triton.jit
def _col_sum(y, T: tl.constexpr):
    """A program tile's sums [T*32, 4] -> the sum of each row's 8 columns, in every column (the store
    reads column 0): lane g*4 + tq, element h*2 + p holds row g + 8h, column tq*2 + p."""
    v = tl.reshape(y, (T * 8, 4, 2, 2))
    s = tl.sum(tl.sum(v, axis=3), axis=1)  # [T*8, 2]
    return tl.reshape(tl.broadcast_to(tl.reshape(s, (T * 8, 1, 2, 1)), (T * 8, 4, 2, 2)), (T * 32, 4))


def parts_shape_problem(heads: int, head_dim: int, splits: int, K: int, group_size: int) -> str | None:
    """Why `splits` partials of `heads` heads of head_dim cannot be the x of a GEMV of K entries in
    groups of group_size, or None."""
    if heads * head_dim != K:
        return f"the partials hold {heads} heads of {head_dim} = {heads * head_dim} entries, the GEMV takes K={K}"
    if not 1 <= splits <= MAX_SPLITS:
        return f"at most {MAX_SPLITS} splits (the mma's B columns), got {splits}"
    if head_dim % group_size:
        return f"a group of {group_size} k must lie in one head (head dim {head_dim})"
    return None


def parts_problem(o_part, lse, K: int, group_size: int) -> str | None:
    """Why the partials o_part [Hkv, NS, PG, PD] bf16 / lse [Hkv, NS, PG] fp32 cannot be a GEMV's x
    of K entries in groups of group_size, or None."""
    if o_part.dim() != 4 or o_part.dtype != torch.bfloat16 or not o_part.is_contiguous():
        return f"o_part must be [Hkv, splits, heads per KV head, head dim] bf16, contiguous, got " \
               f"{tuple(o_part.shape)} {o_part.dtype}"
    hkv, ns, pg, pd = o_part.shape
    if lse.shape != (hkv, ns, pg) or lse.dtype != torch.float32 or not lse.is_contiguous():
        return f"lse must be [{hkv}, {ns}, {pg}] fp32, contiguous, got {tuple(lse.shape)} {lse.dtype}"
    return parts_shape_problem(hkv * pg, pd, ns, K, group_size)


def combine_parts_ref(o_part, lse):
    """The twin of the fold's x: the partials [Hkv, NS, PG, PD] combined as `_combine_kernel` combines
    them, in fp32, not rounded -> [1, Hkv * PG * PD]."""
    mx = lse.amax(dim=1, keepdim=True)
    w = torch.exp2(lse - torch.where(mx == float("-inf"), 0.0, mx))  # [Hkv, NS, PG]
    x = (w[..., None] * o_part.float()).sum(1) / w.sum(1).clamp_min(1e-30)[..., None]
    return x.reshape(1, -1)
