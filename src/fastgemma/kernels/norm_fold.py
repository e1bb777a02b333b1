"""A residual update + RMSNorm between two one-row tensor-core int4 GEMVs folded into them: the GEMV
before it (the producer: o, the PLE projection) ends in a store that writes two activation rows and
its tiles' partial sums, the GEMV after it (the consumer: gate|up, the next layer's q|k|v or q)
reduces those partials and combines two sums in its store. No norm launch runs between them.

    h = (a + rmsnorm(y) * (post + off)) * s      (y the producer's output; s the layer scalar, else 1)
    x = rmsnorm(h) * (pre + off)                 (the consumer's input)

The consumer is linear in x. With p = pre + off, u = y (post + off), r1 = rsqrt(mean y^2 + eps) and
r2 = rsqrt(mean h^2 + eps):

    W x = r2 s (W (a p) + r1 W (u p)),    mean h^2 = s^2 (sum a^2 + 2 r1 sum a u + r1^2 sum u^2) / K

Each producer tile owns 16 or 32 entries of y: its store writes y, the entries of the rows a p and u p
(bf16) and its sums of y^2, a^2, a u and u^2 (fp32, one row of `parts` per tile, in one reduction);
its a, post and pre are loaded before its main loop (in the persistent kernel with one tile per
program, the norm weights before its PDL wait). The consumer reads
the two rows as two activation rows (the mma's B operand has 8 columns: the second costs no
instruction), loads the partials right after its PDL wait, adds them in tile order (the same order in
every program and every step; with one tile per program the compiled kernel adds them after its main
loop, in the kernel that loops over tiles before its first x loads: timed alike, run GD) and stores
r2 s (column 0 + r1 column 1). Its
first programs write h, rounded as the eager layer rounds (`fused_gemv._h_values`), for the next
residual update.

Unlike the norm computed inside every program of the consumer (run FV: four block reductions, the
rows stored and read back, paid again in each wave of gate|up's 640 programs), the consumer's extra
work here is one load of the partials and one small reduction (80 or 160 rows at E4B's shapes).
Rounding differs from kernels/residual_norm.py's (a p and u p are rounded, x is not; r2 comes from
h before its rounding): the outputs agree with the two launches' to bf16 rounding, not bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fused_gemv import _h_values, _rnd

N_PARTS = 4  # sum y^2, sum a^2, sum a u, sum u^2


@triton.jit
def _fold_rows_idx(it, ok, T: tl.constexpr):
    """A producer tile's [T*32, 4] sums at one row: output index and validity (element c of lane
    r % 32 = g*4 + tq: row g + 8 (c // 2) of tile it*T + r // 32, B column tq * 2 + c % 2; the one
    row is column 0)."""
    rt = tl.arange(0, T * 32)[:, None]
    c2 = tl.arange(0, 4)[None, :]
    rows = (it * T + rt // 32) * 16 + rt % 32 // 4 + 8 * (c2 // 2)
    return rows, (rt % 4 == 0) & (c2 % 2 == 0) & ok


@triton.jit
def _fold_weights(it, ok, post_ptr, pre_ptr, T: tl.constexpr):
    """The producer tile's post and pre at its output entries, as stored (weights: loadable before
    the PDL wait)."""
    rows, valid = _fold_rows_idx(it, ok, T)
    return tl.load(post_ptr + rows, mask=valid, other=0.0), tl.load(pre_ptr + rows, mask=valid, other=0.0)


@triton.jit
def _fold_res(it, ok, res_ptr, T: tl.constexpr):
    """The producer tile's a at its output entries (an earlier kernel's output: after the wait)."""
    rows, valid = _fold_rows_idx(it, ok, T)
    return tl.load(res_ptr + rows, mask=valid, other=0.0)


@triton.jit
def _fold_store(y, it, ok, out_ptr, a, pw, p, rows_ptr, parts_ptr, N, off, T: tl.constexpr):
    """The producer's store: y (rounded), rows_ptr[0] = a p and rows_ptr[1] = u p at the tile's
    entries (p = pre + off, u = y (post + off)), and parts[it] = (sum y^2, sum a^2, sum a u, sum u^2)
    over them, the four in one reduction."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    R: tl.constexpr = T * 32
    rows, valid = _fold_rows_idx(it, ok, T)
    yb = tl.where(valid, _rnd(y, DT), 0.0)
    tl.store(out_ptr + rows, yb.to(DT), mask=valid)
    a = a.to(tl.float32)
    u = yb * (pw.to(tl.float32) + off)
    p = p.to(tl.float32) + off
    tl.store(rows_ptr + rows, (a * p).to(DT), mask=valid)
    tl.store(rows_ptr + N + rows, (u * p).to(DT), mask=valid)
    # each lane's sums, then [R, 2, 2] -> [R, 4]: (y^2, a^2, a u, u^2) (a join nests its pair innermost),
    # the four added over the program in one reduction
    sq = tl.join(tl.join(tl.sum(yb * yb, axis=1), tl.sum(a * u, axis=1)),
                 tl.join(tl.sum(a * a, axis=1), tl.sum(u * u, axis=1)))
    tot = tl.sum(tl.reshape(sq, (R, 4)), axis=0)
    tl.store(parts_ptr + it * 4 + tl.arange(0, 4), tot, mask=(tl.arange(0, 4) < 4) & ok)


@triton.jit
def _fold_parts(parts_ptr, NPART: tl.constexpr, NP2: tl.constexpr):
    """The producer's partials [NP2, 4] (rows past NPART zero)."""
    i = tl.arange(0, NP2)[:, None]
    c = tl.arange(0, 4)[None, :]
    return tl.load(parts_ptr + i * 4 + c, mask=(i < NPART) & (c < 4), other=0.0)


@triton.jit
def _fold_scalars(pv, s, eps, K: tl.constexpr):
    """The partials [NP2, 4] added in tile order, the layer scalar s -> (r1, r2 s): the weights of the
    two rows' sums."""
    tot = tl.sum(pv, axis=0)
    c = tl.arange(0, 4)
    syy = tl.sum(tl.where(c == 0, tot, 0.0), axis=0)
    saa = tl.sum(tl.where(c == 1, tot, 0.0), axis=0)
    sau = tl.sum(tl.where(c == 2, tot, 0.0), axis=0)
    suu = tl.sum(tl.where(c == 3, tot, 0.0), axis=0)
    r1 = 1.0 / tl.sqrt(syy / K + eps)
    hh = s * s * (saa + r1 * (2.0 * sau + r1 * suu))
    return r1, s / tl.sqrt(hh / K + eps)


@triton.jit
def _norm_combine(y, r1, r2s, R: tl.constexpr):
    """The consumer's sums [R, 4] (element c of a lane: row g + 8 (c // 2), B column tq * 2 + c % 2) ->
    r2 s (column 0 + r1 column 1) in both elements of each row: the one output row, where tq = 0."""
    c0, c1 = tl.split(tl.reshape(y, (R, 2, 2)))
    comb = r2s * (c0 + r1 * c1)
    return tl.reshape(tl.join(comb, comb), (R, 4))


@triton.jit
def _h_post(post_ptr, pid, K: tl.constexpr, HB: tl.constexpr):
    """post at entries pid * HB .. + HB of h (none past K): a weight, loaded before the PDL wait."""
    k = pid * HB + tl.arange(0, HB)
    return tl.load(post_ptr + k, mask=k < K, other=0.0)


@triton.jit
def _h_inputs(a_ptr, y_ptr, pid, K: tl.constexpr, HB: tl.constexpr):
    """a and y at entries pid * HB .. + HB of h (none past K), loaded right after the PDL wait."""
    k = pid * HB + tl.arange(0, HB)
    ok = k < K
    return tl.load(a_ptr + k, mask=ok, other=0.0), tl.load(y_ptr + k, mask=ok, other=0.0)


@triton.jit
def _h_store(hin, post, r1, s, h_ptr, off, pid, K: tl.constexpr, HB: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Entries pid * HB .. + HB of h = (a + y r1 (post + off)) * s (hin = (a, y), s the layer scalar),
    rounded as the eager layer rounds (`fused_gemv._h_values`, the norm kernels' own)."""
    DT: tl.constexpr = h_ptr.dtype.element_ty
    a, y = hin
    k = pid * HB + tl.arange(0, HB)
    h = _h_values(a.to(tl.float32), y.to(tl.float32), post.to(tl.float32), r1, s, off, HAS_SCALE, DT)
    tl.store(h_ptr + k, h.to(DT), mask=k < K)


def parts_block(n_parts: int) -> int:
    """The consumer's block over the producer's partial rows."""
    return triton.next_power_of_2(max(1, n_parts))
