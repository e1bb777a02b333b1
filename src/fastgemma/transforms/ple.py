"""The `ple` group: how each token's per-layer inputs (PLE) are made.

Gemma 4's PLE input of token t is p(t) = (RMSNorm_256(W_plm x0(t) / sqrt(2560)) + E_ple[t] * 16) / sqrt(2), with
x0(t) = E[t] * sqrt(2560) (GEMMA4.md): a function of the token id alone, though the model computes it per token
with a 2560 x 10752 projection (W_plm: 13.8 MB of int4 words, or 55 MB in bf16, read every decode step, first on
its critical path) and a norm.

- project: as the model defines it (the baseline).
- table: p(t) computed once at build time for every id, in chunks of `chunk` ids through the model's own embed
  (the same ops, a GEMM's sums in place of the one-row GEMV's), written over E_ple's rows (no memory added), W_plm
  and its norm dropped. A step then gathers one 21.5 KB row (E4B), as it gathered E_ple's. Runs before quant, so
  the table comes from W_plm as loaded (its int4 rounding never enters). A model without PLE is left as it is.
"""
from __future__ import annotations

import torch

from ..checks import is_int


class PleProject:
    """The model's own per-token computation."""

    def apply(self, model):
        return model

    def describe(self) -> dict:
        return {"ple": "project"}


class PleTable:
    def __init__(self, chunk: int = 2048):
        if not is_int(chunk, 1):
            raise ValueError(f"ple.chunk must be a positive integer (token ids per build GEMM), got {chunk!r}")
        self.chunk = chunk
        self.rows = 0

    def apply(self, model):
        if model.ple_projected:  # (a second apply would copy the table onto itself)
            self.rows = build_ple_table(model, self.chunk)
        return model

    def describe(self) -> dict:
        return {"ple": "table", "chunk": self.chunk, "rows": self.rows}


@torch.no_grad()
def build_ple_table(model, chunk: int = 2048) -> int:
    """Overwrite model.embed_tokens_per_layer's rows with p(t) (model.embed's PLE output, flattened) and switch
    the model to gathering them (`model.use_ple_table`: W_plm and its norm dropped). -> rows computed."""
    c = model.config
    w = model.embed_tokens_per_layer.weight
    n = min(w.shape[0], c.vocab_size)  # ids past the token embedding's rows never reach embed()
    for a in range(0, n, chunk):
        ids = torch.arange(a, min(a + chunk, n), device=w.device)[None]
        _, p = model.embed(ids)  # reads rows a.. of E_ple, all of them before any is written
        w[a:a + ids.shape[1]] = p.reshape(ids.shape[1], -1).to(w.dtype)
    model.use_ple_table()
    return n
