"""Greedy token pick after the head. `argmax`: logits = compute_logits(hidden), then argmax."""
from __future__ import annotations

from ..engine.steps import argmax_sampler


class Argmax:
    """hidden [B, T, hidden] -> (ids [B, 1], fp32 logits [B, V]) of the last row."""

    needs_cuda = False

    def __call__(self, model, hidden):
        return argmax_sampler(model, hidden)

    def describe(self) -> dict:
        return {"sampler": "argmax"}
