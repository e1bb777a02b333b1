"""Decode steps: one token per call, tokens kept on the device (no host sync per token).

- EagerStep: model.forward with a host position (torch attention over the live cache).
- StaticStep: model.step (writes first, attends through model.step_attention), device positions.
- GraphStep: StaticStep captured once in a torch.cuda.CUDAGraph and replayed; the graph advances
  its own position and feeds its token back, so a decode loop is N replays and nothing else.
A static step's bookkeeping after its pick (token fed back, position + 1, the id kept, count + 1) is four
torch ops (`advance="ops"`) or one launch on CUDA (`advance="kernel"`: kernels/step_advance.py).
All return the next token ids [B, 1]; `last_logits` holds the fp32 logits [B, V] of the last call.
"""
from __future__ import annotations

import torch

from ..kernels.argmax import argmax_last
from .compile import compile_step


# a static step's bookkeeping: the four torch ops, or kernels/step_advance.py's one launch (CUDA; the ops elsewhere)
ADVANCE = ("ops", "kernel")


def check_advance(advance: str) -> None:
    if advance not in ADVANCE:
        raise ValueError(f"advance must be ops (the step's bookkeeping as four torch ops) or kernel (one launch, "
                         f"kernels/step_advance.py), got {advance!r}")

# prompts are padded to a multiple of this and replayed from one CUDA graph per padded length
# (graphs=cuda_graph / compiled; Generator.prefill)
PREFILL_BUCKET = 64


def warm_on_side_stream(fn, iters: int) -> None:
    """fn() `iters` times on a side stream, then the current stream waits for it: compilation,
    autotuning and lazy allocations happen before a CUDA-graph capture, outside it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(s)


def argmax_sampler(model, hidden):
    """hidden [B, 1, hidden] -> ids [B, 1], logits [B, V] fp32."""
    logits = model.compute_logits(hidden[:, -1])
    return argmax_last(logits), logits


class EagerStep:
    name = "eager"

    def __init__(self, model, cache, sampler=argmax_sampler):
        self.model, self.cache, self.sampler = model, cache, sampler
        self.last_logits = None

    def prepare(self):
        pass

    def begin(self, pos: int):
        """Called after prefill: the next step decodes at position `pos`."""
        self.pos, self.emitted = pos, []

    def __call__(self, tok):
        p = torch.full_like(tok, self.pos)
        h = self.model(tok, p, self.cache, start=self.pos)
        self.pos += 1
        nxt, self.last_logits = self.sampler(self.model, h)
        self.emitted.append(nxt)
        return nxt

    def tokens(self):
        """[B, n] ids emitted since begin()."""
        return torch.cat(self.emitted, 1)

    def emitted_at(self, i: int):
        """[B, 1] the i-th id emitted since begin() (from 0), on the device; it keeps its value until begin()."""
        return self.emitted[i]


class StaticStep:
    name = "static"

    def __init__(self, model, cache, sampler=argmax_sampler, compile: bool = False, advance: str = "kernel"):
        check_advance(advance)
        self.model, self.cache, self.sampler = model, cache, sampler
        if hasattr(sampler, "prepare"):  # its buffers exist before the step is traced (no recompile)
            sampler.prepare(model, cache.batch, cache.ring_pos.device)
        fwd = lambda ids, pos: sampler(model, model.step(ids, pos, cache))  # noqa: E731
        # torch.compile fuses the elementwise work between GEMVs (norms, RoPE, GeGLU, residuals);
        # the CUDA graph (GraphStep) then removes the launch gaps
        self.forward = compile_step(fwd) if compile else fwd
        dev = cache.ring_pos.device
        b = cache.batch
        self.tok = torch.zeros(b, 1, dtype=torch.long, device=dev)   # static input
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(b, cache.max_context, dtype=torch.long, device=dev)  # emitted ids
        self.count = torch.zeros(1, dtype=torch.long, device=dev)
        from ..kernels.step_advance import advance_fn, step_advance_ref

        self._advance = advance_fn(dev, once=True) if advance == "kernel" else step_advance_ref
        self.n = 0
        self.last_logits = None

    def prepare(self):
        pass

    def begin(self, pos: int):
        self.pos.fill_(pos)
        self.count.zero_()
        self.n = 0

    def _body(self):
        nxt, logits = self.forward(self.tok, self.pos)
        self._advance(nxt, self.tok, self.pos, self.out, self.count)
        return nxt, logits

    def __call__(self, tok):
        self.tok.copy_(tok)
        nxt, self.last_logits = self._body()
        self.n += 1
        return nxt

    def tokens(self):
        return self.out[:, : self.n]

    def emitted_at(self, i: int):
        return self.out[:, i:i + 1]


class GraphStep(StaticStep):
    """Captured once in prepare() (the warm-up); replay() per token. The input token buffer is
    overwritten by the graph's own output, so a plain decode loop never copies anything in."""
    name = "cuda_graph"

    def __init__(self, model, cache, sampler=argmax_sampler, compile: bool = False, warmup_iters: int = 2,
                 prefill_bucket: int = PREFILL_BUCKET, compile_prefill: bool | str = False, advance: str = "kernel"):
        super().__init__(model, cache, sampler, compile, advance)
        # the generator's prompt path (Generator): padded to prefill_bucket and captured, compiled
        # with compile_prefill
        self.prefill_bucket, self.compile_prefill = prefill_bucket, compile_prefill
        if cache.ring_pos.device.type != "cuda":
            raise RuntimeError("graphs=cuda_graph needs a CUDA device; use graphs=eager on a CPU")
        self.warmup_iters = warmup_iters
        self.graph = None

    def prepare(self):
        if self.graph is not None:
            return
        warm_on_side_stream(self._body, self.warmup_iters)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out_tok, self.out_logits = self._body()
        self.cache.reset()  # capture wrote into the cache at a dummy position

    def __call__(self, tok):
        if tok is not self.out_tok:
            self.tok.copy_(tok)
        self.graph.replay()
        self.n += 1
        self.last_logits = self.out_logits
        return self.out_tok
