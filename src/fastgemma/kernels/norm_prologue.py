"""The residual update and RMSNorm before a one-row int4 GEMV, computed inside the GEMV
(kernels/mma_w4a16.py's persistent kernel with `mma_w4a16_norm`), instead of one launch of
kernels/residual_norm.py (one program) before it. Every program of the GEMV does it after its PDL
wait, while the weight words it loaded before the wait are in flight.

    h = (a + rmsnorm(y) * (post + off)) * s      (y given; s the layer scalar, 1 without)
    x = rmsnorm(h) * (pre + off)

The GEMV is linear in x, so the norms need not be applied to x first. With p = pre + off,
u = y (post + off), r1 = rsqrt(mean(y^2) + eps), h = s (a + r1 u) and r2 = rsqrt(mean(h^2) + eps):

    W x = r2 s (W (a p) + r1 W (u p)),    mean(h^2) = s^2 (sum a^2 + 2 r1 sum a u + r1^2 sum u^2) / K

so a program writes two bf16 rows, a p and u p, into its own rows of a scratch buffer while it sums
y^2, a^2, a u and u^2 (one pass over the inputs, one reduction), and the GEMV reads them as two
activation rows: the mma's B operand has 8 columns, so the second row costs no instruction. The store
combines the two sums. Each program also writes its slice of h, rounded as the eager layer rounds
(the next residual update reads it), from `fused_gemv._h_block`.

Rounding differs from the two launches' (residual_norm rounds h and x to bf16; here a p and u p are
rounded, x is not, and r2 comes from h before its rounding): the outputs agree to bf16 rounding,
not bit for bit, so `fuse.batch_invariant` (the verify pass's rows equal to the AR step's) keeps
the separate launch.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fused_gemv import _h_block


@triton.jit
def _norm_rows(a_ptr, y_ptr, post_ptr, pre_ptr, xs_ptr, off, K: tl.constexpr, CHUNK: tl.constexpr,
               HAS_Y: tl.constexpr):
    """xs[0, :] = a p and (HAS_Y) xs[1, :] = u p, rounded to xs' dtype -> the fp32 sums of y^2, a^2,
    a u and u^2 (zeros without y)."""
    DT: tl.constexpr = xs_ptr.dtype.element_ty
    c = tl.arange(0, CHUNK)
    saa = tl.zeros([CHUNK], dtype=tl.float32)
    syy = tl.zeros([CHUNK], dtype=tl.float32)
    sau = tl.zeros([CHUNK], dtype=tl.float32)
    suu = tl.zeros([CHUNK], dtype=tl.float32)
    for i in tl.static_range((K + CHUNK - 1) // CHUNK):
        k = i * CHUNK + c
        ok = k < K
        a = tl.load(a_ptr + k, mask=ok, other=0.0).to(tl.float32)
        p = tl.load(pre_ptr + k, mask=ok, other=0.0).to(tl.float32) + off
        tl.store(xs_ptr + k, (a * p).to(DT), mask=ok)
        saa += a * a
        if HAS_Y:
            y = tl.load(y_ptr + k, mask=ok, other=0.0).to(tl.float32)
            u = y * (tl.load(post_ptr + k, mask=ok, other=0.0).to(tl.float32) + off)
            tl.store(xs_ptr + K + k, (u * p).to(DT), mask=ok)
            syy += y * y
            sau += a * u
            suu += u * u
    return tl.sum(syy, axis=0), tl.sum(saa, axis=0), tl.sum(sau, axis=0), tl.sum(suu, axis=0)


@triton.jit
def _norm_scalars(syy, saa, sau, suu, scale_ptr, eps, K: tl.constexpr, HAS_Y: tl.constexpr,
                  HAS_SCALE: tl.constexpr):
    """-> (r1, r2 s): the weights of the two rows' sums (r1 = 0 without y)."""
    r1 = syy * 0.0
    if HAS_Y:
        r1 = 1.0 / tl.sqrt(syy / K + eps)
    s = 1.0
    if HAS_SCALE:
        s = tl.load(scale_ptr).to(tl.float32)
    hh = s * s * (saa + r1 * (2.0 * sau + r1 * suu))
    return r1, s / tl.sqrt(hh / K + eps)


@triton.jit
def _h_slice(a_ptr, y_ptr, post_ptr, scale_ptr, h_ptr, r1, off, pid, K: tl.constexpr, CH: tl.constexpr,
             HAS_SCALE: tl.constexpr):
    """This program's CH entries of h (from pid * CH), rounded as the eager layer rounds."""
    DT: tl.constexpr = h_ptr.dtype.element_ty
    k = pid * CH + tl.arange(0, CH)
    s = 1.0
    if HAS_SCALE:
        s = tl.load(scale_ptr).to(tl.float32)
    h = _h_block(a_ptr, y_ptr, post_ptr, 0, k, r1, s, off, K, CH, HAS_SCALE, DT)
    tl.store(h_ptr + k, h.to(DT), mask=k < K)


@triton.jit
def _norm_combine(y, r1, r2s, R: tl.constexpr):
    """The store's sums [R, 4] (element c of a lane: row g + 8 (c // 2), B column tq * 2 + c % 2) ->
    r2 s (column 0 + r1 column 1) in both elements of each row: the one output row, where tq = 0."""
    c0, c1 = tl.split(tl.reshape(y, (R, 2, 2)))
    comb = r2s * (c0 + r1 * c1)
    return tl.reshape(tl.join(comb, comb), (R, 4))


def prologue_tiles(K: int, programs: int) -> tuple[int, int]:
    """(CHUNK, CH): the width of a pass over the inputs and each program's slice of h."""
    return min(512, triton.next_power_of_2(K)), triton.next_power_of_2(triton.cdiv(K, programs))
