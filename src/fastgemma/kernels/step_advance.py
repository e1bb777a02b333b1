"""The decode step's bookkeeping after its token is picked, in one launch: the token fed back as the next
step's input, each row's position + 1, the token kept in the emitted ids at the step count, the count + 1.

As torch ops these were four launches at the end of every captured step (copy_, add_, index_copy_, add_),
each a dependent kernel boundary on the step's critical path. One program does all rows (a decode batch is a
few rows), so the count is read before any row's write and advanced once. A count at or past the emitted
ids' width writes no id (index_copy_ would fault the device); the generator never steps that far.

`step_advance` launches (CUDA tensors, or any under TRITON_INTERPRET=1), `step_advance_ref` is the torch
twin (the four ops), `advance_fn(device)` picks one for a step's buffers once, at build time; a step that calls it
on the same buffers every token checks them on the first call only (`once=True`: a few us of Python a token).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _step_advance_kernel(nxt_ptr, tok_ptr, pos_ptr, out_ptr, count_ptr, stride_out, width,
                         B: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.arange(0, BLOCK)
    ok = b < B
    n = tl.load(count_ptr)
    t = tl.load(nxt_ptr + b, mask=ok)
    p = tl.load(pos_ptr + b, mask=ok)
    tl.store(tok_ptr + b, t, mask=ok)
    tl.store(pos_ptr + b, p + 1, mask=ok)
    tl.store(out_ptr + b * stride_out + n, t, mask=ok & (n < width))
    tl.store(count_ptr, n + 1)


def _check(nxt, tok, pos, out, count):
    B = tok.shape[0]
    for name, t in (("nxt", nxt), ("tok", tok), ("pos", pos)):
        if t.shape != (B, 1) or t.dtype != torch.long:
            raise ValueError(f"step_advance: {name} must be int64 [{B}, 1], got {t.dtype} {tuple(t.shape)}")
    if out.dim() != 2 or out.shape[0] != B or out.dtype != torch.long or out.stride(1) != 1:
        raise ValueError(f"step_advance: out must be int64 [{B}, width] with rows contiguous, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if count.shape != (1,) or count.dtype != torch.long:
        raise ValueError(f"step_advance: count must be int64 [1], got {count.dtype} {tuple(count.shape)}")
    if any(not t.is_contiguous() for t in (nxt, tok, pos)):
        raise ValueError("step_advance: nxt, tok and pos must be contiguous")


def step_advance(nxt, tok, pos, out, count) -> None:
    """nxt, tok, pos [B, 1] int64, out [B, width] int64, count [1] int64, all on one device, updated in place:
    tok = nxt, pos += 1, out[:, count] = nxt, count += 1. No host sync."""
    _check(nxt, tok, pos, out, count)
    if not (nxt.is_cuda or _INTERPRET):
        raise RuntimeError("step_advance runs on CUDA tensors (or with TRITON_INTERPRET=1); use step_advance_ref")
    _launch(nxt, tok, pos, out, count)


def _launch(nxt, tok, pos, out, count) -> None:
    B = tok.shape[0]
    _step_advance_kernel[(1,)](nxt, tok, pos, out, count, out.stride(0), out.shape[1],
                               B=B, BLOCK=max(2, triton.next_power_of_2(B)), num_warps=1)


def step_advance_ref(nxt, tok, pos, out, count) -> None:
    """The torch twin: the same updates as four ops."""
    tok.copy_(nxt)
    pos.add_(1)
    out.index_copy_(1, count, nxt)
    count.add_(1)


class _CheckedOnce:
    """step_advance on its first call, the bare launch after it: for a step whose buffers never change."""

    def __init__(self):
        self._fn = self._first

    def _first(self, *bufs) -> None:
        step_advance(*bufs)
        self._fn = _launch

    def __call__(self, *bufs) -> None:
        self._fn(*bufs)


def advance_fn(device: torch.device, once: bool = False):
    """The step's bookkeeping for buffers on `device`: the kernel on CUDA, the twin elsewhere. once: the buffers are
    checked on the first call only (a step that passes the same buffers every token)."""
    if torch.device(device).type != "cuda":
        return step_advance_ref
    return _CheckedOnce() if once else step_advance
