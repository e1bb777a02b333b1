"""The smallest dependent phase a decode step is made of, and its torch twin: what one kernel
boundary costs when there are no weights to stream.

A phase of P programs reads the whole vector the phase before it wrote (H fp32 values), takes its
dot with the program's own row of H weights (loaded before the wait: weights never depend on the
phase before) and writes that sum to its share of the next vector (H / P values, rounded up). Every
layer op of the step has this dependency: each program needs all of the previous op's output.
`work=False` keeps only the boundary: no loads, no stores.

- `phase_chain(x, w, n, style)`: n phases as n launches, stream ordered (`graph`) or with
  programmatic dependent launch (`pdl`: the next launch starts at once, its programs wait for this
  one's end before they read).
- `phase_persistent(x, w, n)`: n phases in one launch of P resident programs, a grid barrier
  (kernels/draft_loop.py's) between a phase and the next.
Both leave the n-th vector in x's pair buffer; `phase_ref` is their twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .draft_loop import SPIN_LIMIT, _leave, _sync
from .gemv import _pdl_trigger, _pdl_wait, pdl_args

STYLES = ("graph", "pdl", "barrier")


@triton.jit
def _dot_store(src, dst, w, pid, H, C, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < H, other=0.0)
    s = tl.sum(x * w, axis=0)
    cols = pid * C + tl.arange(0, BLOCK_C)
    tl.store(dst + cols, tl.zeros([BLOCK_C], tl.float32) + s, mask=(cols < (pid + 1) * C) & (cols < H))


@triton.jit
def _phase_kernel(src, dst, w_ptr, H, C, WORK: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if WORK:
        w = tl.load(w_ptr + pid * H + offs, mask=offs < H, other=0.0)
    _pdl_trigger(PDL)
    _pdl_wait(PDL)
    if WORK:
        _dot_store(src, dst, w, pid, H, C, BLOCK, BLOCK_C)


@triton.jit
def _persistent_kernel(x_ptr, w_ptr, bar_ptr, err_ptr, n, H, C, WORK: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_C: tl.constexpr, SPIN: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    if WORK:
        w = tl.load(w_ptr + pid * H + offs, mask=offs < H, other=0.0)
    nb = 0
    for i in range(n):
        if WORK:
            _dot_store(x_ptr + (i % 2) * H, x_ptr + ((i + 1) % 2) * H, w, pid, H, C, BLOCK, BLOCK_C)
        nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    _leave(bar_ptr, nprog)


class PhaseError(ValueError):
    pass


def _check(x: torch.Tensor, w: torch.Tensor, n: int):
    if x.dim() != 2 or x.shape[0] != 2 or x.dtype != torch.float32:
        raise PhaseError(f"x must be the pair of fp32 vectors [2, H] the phases alternate between; got "
                         f"{tuple(x.shape)} {x.dtype}")
    if w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != torch.float32:
        raise PhaseError(f"w must be fp32 [programs, H={x.shape[1]}]; got {tuple(w.shape)} {w.dtype}")
    if not 1 <= w.shape[0] <= x.shape[1]:
        raise PhaseError(f"programs must be in [1, H={x.shape[1]}]; got {w.shape[0]}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PhaseError(f"phases must be a positive integer; got {n!r}")


def _meta(x, w):
    H, P = x.shape[1], w.shape[0]
    C = triton.cdiv(H, P)
    return H, P, C, dict(BLOCK=triton.next_power_of_2(H), BLOCK_C=triton.next_power_of_2(C))


def phase_chain(x: torch.Tensor, w: torch.Tensor, n: int, style: str = "graph", work: bool = True):
    """n phases of w.shape[0] programs as n launches; phase i reads x[i % 2] and writes x[(i + 1) % 2]."""
    _check(x, w, n)
    if style not in ("graph", "pdl"):
        raise PhaseError(f"phase_chain's style is one of graph, pdl; got {style!r}")
    H, P, C, meta = _meta(x, w)
    launch = pdl_args(style == "pdl", x.device)
    for i in range(n):
        _phase_kernel[(P,)](x[i % 2], x[(i + 1) % 2], w, H, C, WORK=work, num_warps=4, **launch, **meta)


def phase_persistent(x: torch.Tensor, w: torch.Tensor, n: int, bar: torch.Tensor, err: torch.Tensor,
                     work: bool = True):
    """n phases in one launch of w.shape[0] programs, which must all be resident at once (at most one
    per multiprocessor is what the caller should ask for). bar: int32 [2] zeros, err: int32 [1]: set
    to 1 if a barrier gave up waiting (programs not all resident)."""
    _check(x, w, n)
    H, P, C, meta = _meta(x, w)
    if x.device.type == "cuda":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        if P > sms:
            raise PhaseError(f"a grid barrier needs every program resident: at most {sms} programs here; got {P}")
    _persistent_kernel[(P,)](x, w, bar, err, n, H, C, WORK=work, SPIN=SPIN_LIMIT, num_warps=4, **meta)


def ring_weights(programs: int, hidden: int, device="cpu") -> torch.Tensor:
    """w [programs, hidden] with one 1 per row: program p picks the first value of program p + 1's
    share (the last value where that program has none). The values stay the input's (sums of one product, exact), and each phase rotates them a
    program further, so a phase that read a stale vector gives another answer than the twin."""
    C = triton.cdiv(hidden, programs)
    w = torch.zeros(programs, hidden, dtype=torch.float32, device=device)
    p = torch.arange(programs, device=device)
    w[p, (((p + 1) % programs) * C).clamp(max=hidden - 1)] = 1.0
    return w


def phase_ref(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """The twin: the vector after n phases from x[0] (fp64 sums, returned in fp32)."""
    _check(x, w, n)
    H, P, C, _ = _meta(x, w)
    owner = torch.arange(H, device=x.device) // C
    v, wd = x[0].double(), w.double()
    for _ in range(n):
        v = (wd @ v)[owner]
    return v.float()
