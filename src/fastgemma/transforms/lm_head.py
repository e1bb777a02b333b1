"""Output head choices. `full` is the tied embedding head (V x hidden, softcapped), left as built."""
from __future__ import annotations


class FullHead:
    """The full-vocabulary head: apply() changes nothing."""

    needs_cuda = False

    def apply(self, model):
        return model

    def describe(self) -> dict:
        return {"lm_head": "full"}
