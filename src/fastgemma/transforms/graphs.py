"""Decode-step runners: which engine step the generator calls once per token.

- Eager: model.forward with a host position (torch SDPA over the live cache).
- Static: model.step (writes first, attends through model.step_attention), device positions; the
  CPU twin of the captured step, same code without the capture.
- CudaGraph: the static step captured once in a torch.cuda.CUDAGraph and replayed (CUDA only);
  compile=True first runs the step body through torch.compile (elementwise fusion).
"""
from __future__ import annotations

from ..engine.steps import EagerStep, GraphStep, StaticStep


class Eager:
    needs_cuda = False

    def make_step(self, model, cache, sampler):
        return EagerStep(model, cache, sampler)

    def describe(self) -> dict:
        return {"graphs": "eager"}


class Static:
    needs_cuda = False

    def make_step(self, model, cache, sampler):
        return StaticStep(model, cache, sampler)

    def describe(self) -> dict:
        return {"graphs": "static"}


class CudaGraph:
    needs_cuda = True

    def __init__(self, warmup_iters: int = 2, compile: bool = False):
        if warmup_iters < 1:
            raise ValueError(f"warmup_iters must be >= 1, got {warmup_iters}")
        self.warmup_iters, self.compile = warmup_iters, bool(compile)

    def make_step(self, model, cache, sampler):
        return GraphStep(model, cache, sampler, compile=self.compile, warmup_iters=self.warmup_iters)

    def describe(self) -> dict:
        return {"graphs": "compiled" if self.compile else "cuda_graph", "warmup_iters": self.warmup_iters,
                "compile": self.compile}
