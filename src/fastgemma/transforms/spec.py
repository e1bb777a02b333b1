"""Speculative decoding choices. `none` is plain autoregressive decode: the Generator as it is.

A speculative method owns its decode loop (a drafter, a verify step, acceptance) and returns an
object with the Generator's interface, so the plain loop never branches on it.
"""
from __future__ import annotations

from ..engine.generator import Generator


class NoSpec:
    """One token per step from the engine's step."""

    needs_cuda = False

    def make_generator(self, model, cache, step, sampler, prefill_chunk: int) -> Generator:
        return Generator(model, cache, step, prefill_chunk=prefill_chunk, sampler=sampler)

    def describe(self) -> dict:
        return {"spec": "none"}
