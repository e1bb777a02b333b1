"""Decode-step runners: which engine step the generator calls once per token.

- Eager: model.forward with a host position (torch SDPA over the live cache).
- Static: model.step (writes first, attends through model.step_attention), device positions; the
  CPU twin of the captured step, same code without the capture.
- CudaGraph: the static step captured once in a torch.cuda.CUDAGraph and replayed (CUDA only);
  compile=True first runs the step body through torch.compile (elementwise fusion), and the
  prompt's forward too (dynamic=True: one compilation for every length; by default each decoder layer's
  regions, compile_prefill=True the whole forward). prefill_bucket > 0: the
  prompt is padded to a multiple of it and replayed from one CUDA graph per padded length
  (Generator.prefill; captured in the warm-up by Generator.warm_prefill). advance: the step's bookkeeping
  after its pick as four torch ops ("ops") or one launch ("kernel", kernels/step_advance.py).
"""
from __future__ import annotations

from ..checks import is_int
from ..engine.generator import is_prompt_compile, prompt_compile_for
from ..engine.steps import PREFILL_BUCKET, EagerStep, GraphStep, StaticStep, check_advance


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

    def __init__(self, warmup_iters: int = 2, compile: bool = False, prefill_bucket: int = PREFILL_BUCKET,
                 compile_prefill: bool | str | None = None, advance: str = "kernel"):
        if warmup_iters < 1:
            raise ValueError(f"warmup_iters must be >= 1, got {warmup_iters}")
        if not is_int(prefill_bucket, 0):
            raise ValueError(f"prefill_bucket must be an integer >= 0 (0: the prompt is not captured), "
                             f"got {prefill_bucket!r}")
        self.warmup_iters, self.compile, self.prefill_bucket = warmup_iters, bool(compile), prefill_bucket
        if compile_prefill is not None and not is_prompt_compile(compile_prefill):
            raise ValueError(f"compile_prefill must be true (the prompt's whole forward), layers (each decoder "
                             f"layer's regions, compiled once for every layer of a kind), false or null (layers "
                             f"with `compile`, else false), got {compile_prefill!r}")
        self.compile_prefill = prompt_compile_for(self.compile) if compile_prefill is None else compile_prefill
        check_advance(advance)  # here too: a bad choice stops the run before its model is built
        self.advance = advance

    def make_step(self, model, cache, sampler):
        return GraphStep(model, cache, sampler, compile=self.compile, warmup_iters=self.warmup_iters,
                         prefill_bucket=self.prefill_bucket, compile_prefill=self.compile_prefill,
                         advance=self.advance)

    def describe(self) -> dict:
        return {"graphs": "compiled" if self.compile else "cuda_graph", "warmup_iters": self.warmup_iters,
                "compile": self.compile, "prefill_bucket": self.prefill_bucket,
                "compile_prefill": self.compile_prefill, "advance": self.advance}
