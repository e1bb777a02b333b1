"""GPTQ's column loop inside one block of columns, as one Triton launch.

GPTQ rounds a weight's columns one after another, each column's rounding error spread over the columns
after it through the upper Cholesky factor U of the inverse Hessian. Within a block of B columns that is
B steps of a handful of tiny ops each (the torch twin below: ~10 launches a column, so E4B's ~740k
columns spend their time in launches on a GPU). Every row of the weight only ever touches its own
values, so the whole block is one launch here: a program holds BN rows of the block in registers and
walks its columns, storing each code and error as it goes.

The arithmetic is the twin's, operation for operation (IEEE division, round half to even, no fused
multiply-adds), so the codes and errors are the twin's bit for bit (tests/test_gptq_columns.py, interpreter; on
an H100 every E4B shape too, bench.gptq, run KR: the model's 211 linears in 7.3 s against the twin's 143.9)."""
import torch
import triton
import triton.language as tl

ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + ROUND) - ROUND is v rounded half to even in fp32 for |v| < 2^22
ROWS = 16  # rows a program walks the block with
OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}  # the launch's: no a * b + c contracted to one rounding


def columns_torch(W1: torch.Tensor, U1: torch.Tensor, S1: torch.Tensor, Z1: torch.Tensor, j0: int, j1: int,
                  Q1: torch.Tensor, E1: torch.Tensor) -> None:
    """The twin: columns j0..j1-1 of the block W1 [N, B] (fp32, updated in place), U1 [B, B] the block's part
    of U, S1 / Z1 [j1 - j0, N] each column's scale and zero rows (fp32, 0 scale: a constant group, code 0);
    codes into Q1 [N, B] (uint8), scaled errors into E1 [N, B]."""
    live = S1 > 0
    safe = torch.where(live, S1, 1.0)
    for j in range(j0, j1):
        s, z = S1[j - j0], Z1[j - j0]
        x = W1[:, j]
        q = torch.where(live[j - j0], torch.round((x - z) / safe[j - j0]), 0.0).clamp_(0, 15)
        Q1[:, j] = q.to(torch.uint8)
        e = (x - (q * s + z)) / U1[j, j]
        W1[:, j:] -= e[:, None] * U1[j, j:][None, :]
        E1[:, j] = e


@triton.jit
def _columns(W, U, S, Z, Q, E, N, B, sw, su, ss, sq, se, J0: tl.constexpr, J1: tl.constexpr, BN: tl.constexpr,
             BB: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.arange(0, BB)
    rmask = rows < N
    tile = rmask[:, None] & (cols < B)[None, :]
    w = tl.load(W + rows[:, None] * sw + cols[None, :], mask=tile, other=0.0)
    for j in range(J0, J1):
        s = tl.load(S + (j - J0) * ss + rows, mask=rmask, other=1.0)
        z = tl.load(Z + (j - J0) * ss + rows, mask=rmask, other=0.0)
        x = tl.sum(tl.where(cols[None, :] == j, w, 0.0), axis=1)
        safe = tl.where(s > 0, s, 1.0)
        v = tl.math.div_rn(x - z, safe)
        q = tl.where(s > 0, (v + ROUND) - ROUND, 0.0)
        q = tl.minimum(tl.maximum(q, 0.0), 15.0)
        tl.store(Q + rows * sq + j, q.to(tl.uint8), mask=rmask)
        e = tl.math.div_rn(x - (q * s + z), tl.load(U + j * su + j))
        u = tl.load(U + j * su + cols, mask=(cols >= j) & (cols < B), other=0.0)
        w = tl.where(cols[None, :] >= j, w - e[:, None] * u[None, :], w)
        tl.store(E + rows * se + j, e, mask=rmask)
    tl.store(W + rows[:, None] * sw + cols[None, :], w, mask=tile)


def columns_triton(W1: torch.Tensor, U1: torch.Tensor, S1: torch.Tensor, Z1: torch.Tensor, j0: int, j1: int,
                   Q1: torch.Tensor, E1: torch.Tensor) -> None:
    """`columns_torch` in one launch; the same arguments (S1 / Z1 may be one row expanded: stride 0)."""
    N, B = W1.shape
    for t in (W1, U1, Q1, E1, S1, Z1):
        if t.stride(-1) != 1:
            raise ValueError(f"gptq columns: tensors must be contiguous along their last dim, got strides {t.stride()}")
    if S1.stride() != Z1.stride():
        raise ValueError("gptq columns: scales and zeros must share one layout")
    _columns[(triton.cdiv(N, ROWS),)](W1, U1, S1, Z1, Q1, E1, N, B, W1.stride(0), U1.stride(0), S1.stride(0),
                                      Q1.stride(0), E1.stride(0), J0=j0, J1=j1, BN=ROWS,
                                      BB=triton.next_power_of_2(B), **OPTIONS)


def loop_for(t: torch.Tensor):
    """The column loop for tensors on t's device: the kernel on CUDA, the twin elsewhere."""
    return columns_triton if t.is_cuda else columns_torch


def columns(W1: torch.Tensor, *args) -> None:
    loop_for(W1)(W1, *args)
