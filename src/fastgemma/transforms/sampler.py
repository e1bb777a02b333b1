"""Greedy token pick after the head (the `sampler` group): argmax | fused_argmax.

- argmax: logits = compute_logits(hidden) (fp32 [B, V]), then argmax.
- fused_argmax: one fused head GEMV + argmax (kernels/sparse_argmax.py) straight to token ids, for
  the full tied head, an int8 head or a pruned head (int4 heads: the w4a16 GEMV, then an argmax).
  The argmax is taken before the softcap. The same launch writes the softcapped logits of the
  computed rows into a [B, V] fp32 buffer that this sampler owns and fills with -inf once, so the
  returned logits are the head's logits scattered to the vocabulary (-inf outside a keepset) at
  4 bytes per kept row of extra writes, and teacher-forced identity reads them as usual.
  Trap: the buffer is reused by the next call (as a CUDA graph's outputs are): copy it to keep it.
"""
from __future__ import annotations

import weakref

import torch

from ..engine.steps import argmax_sampler
from ..kernels.sparse_argmax import _INTERPRET


class Argmax:
    """hidden [B, T, hidden] -> (ids [B, 1], fp32 logits [B, V]) of the last row."""

    needs_cuda = False

    def __call__(self, model, hidden):
        return argmax_sampler(model, hidden)

    def describe(self) -> dict:
        return {"sampler": "argmax"}


_BACKENDS = ("auto", "triton", "torch")


class FusedArgmax:
    """hidden [B, T, hidden] -> (ids [B, 1] int64, fp32 logits [B, V] scattered, a reused buffer).
    backend: auto (the Triton kernel on CUDA, the torch twin elsewhere) | triton | torch."""

    def __init__(self, backend: str = "auto"):
        if backend not in _BACKENDS:
            raise ValueError(f"sampler backend must be one of {_BACKENDS}, got {backend!r}")
        self.backend = backend
        # head -> {(rows, device): logits buffer}; dies with the head
        self._bufs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @property
    def needs_cuda(self) -> bool:
        return self.backend == "triton"

    def _buffer(self, head, x):
        return self._make_buffer(head, x.shape[0], x.device)

    def _make_buffer(self, head, rows: int, device):
        per_head = self._bufs.get(head)
        if per_head is None:
            per_head = self._bufs[head] = {}
        key = (rows, device)
        buf = per_head.get(key)
        if buf is None:  # made once (warm-up, before any graph capture); -inf stays where no row writes
            with torch.inference_mode(False):  # an inference tensor could not be written outside inference mode
                buf = per_head[key] = head.new_logits(rows, device)
        return buf

    def prepare(self, model, rows: int, device) -> None:
        """Make the logits buffer of `rows` rows before a step is compiled: a buffer made while
        torch.compile traces the step changes the dict its guards read, and the step's second call
        recompiled it (the frontier's step: 2 graphs compiled instead of 1, run EW)."""
        from .lm_head import decode_head

        self._make_buffer(decode_head(model), rows, torch.device(device))

    def __call__(self, model, hidden):
        from .lm_head import decode_head

        x = hidden[:, -1]  # [B, hidden]
        head = decode_head(model)
        backend = self.backend if self.backend != "auto" else ("triton" if x.is_cuda else "torch")
        if backend == "triton" and not (x.is_cuda or _INTERPRET):
            raise RuntimeError(f"sampler=fused_argmax backend=triton needs CUDA tensors, got {x.device}; "
                               "use backend=torch")
        logits = self._buffer(head, x)
        # fuse.batch_invariant: one head config at every row count (a verify pass's rows = the AR step's)
        ids = head.pick(x, logits, backend, row_invariant=getattr(model, "batch_invariant", False))
        return ids[:, None], logits

    def describe(self) -> dict:
        return {"sampler": "fused_argmax", "backend": self.backend}
