"""A row gather as an opaque op for compiled steps.

ple=table's PLE input is one row of a [V, L * P] table per token, which every layer's PLE gate reads a slice of.
Left to inductor, the gather was inlined into each consumer: the fused GEMVs take realized inputs, so each
layer's slice became a launch of its own before that layer's PLE gate (E4B int4 step on an H100: 40 more kernels,
+0.1 ms, run LI). As a custom op the gather is one ATen launch whose output the layers read as views; outside
compile it is the same call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("fastgemma::gather_rows", mutates_args=())
def gather_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """w [N, D], ids [...] int64 -> w[ids] [..., D] as one buffer."""
    return F.embedding(ids, w)


@gather_rows.register_fake
def _(w, ids):
    return w.new_empty((*ids.shape, w.shape[1]))
