"""A row gather as an opaque op for compiled steps.

ple=table's PLE input is one row of a [V, L * P] table per token, which every layer's PLE gate reads a slice of.
Left to inductor, the gather was inlined into each consumer: the fused GEMVs take realized inputs, so each
layer's slice became a launch of its own before that layer's PLE gate (E4B int4 step on an H100: 40 more kernels,
+0.1 ms, run LI). As a custom op the gather is one launch whose output the layers read as views.

On CUDA the launch is `gather_rows_triton` (a program per row and 4,096-element chunk: E4B's 10,752-element row in
three): ATen's embedding kernel took 6.9 us of the step's critical path for that 21 KB row (run LJ, 11 blocks).
Elsewhere, and as the twin, `F.embedding`. Both copy the same values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_INTERPRET = bool(triton.knobs.runtime.interpret)
CHUNK = 4096  # elements a program copies


@triton.jit
def _gather_rows_kernel(w_ptr, ids_ptr, out_ptr, D, stride_w, CHUNK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ok = c < D
    i = tl.load(ids_ptr + r).to(tl.int64)
    tl.store(out_ptr + r.to(tl.int64) * D + c, tl.load(w_ptr + i * stride_w + c, mask=ok), mask=ok)


def gather_rows_triton(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """w [N, D] (rows contiguous), ids [...] int64 -> w[ids] [..., D] in one launch (CUDA, or TRITON_INTERPRET=1)."""
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError(f"gather_rows: w must be [N, D] with rows contiguous, got {tuple(w.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gather_rows: ids must be integers, got {ids.dtype}")
    flat = ids.reshape(-1).contiguous()
    out = w.new_empty((flat.numel(), w.shape[1]))
    if flat.numel():
        _gather_rows_kernel[(flat.numel(), triton.cdiv(w.shape[1], CHUNK))](w, flat, out, w.shape[1], w.stride(0),
                                                                              CHUNK=CHUNK, num_warps=4)
    return out.reshape(*ids.shape, w.shape[1])


@torch.library.custom_op("fastgemma::gather_rows", mutates_args=())
def gather_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """w [N, D], ids [...] int64 -> w[ids] [..., D] as one buffer."""
    if w.is_cuda and w.stride(1) == 1:
        return gather_rows_triton(w, ids)
    return F.embedding(ids, w)


@gather_rows.register_fake
def _(w, ids):
    return w.new_empty((*ids.shape, w.shape[1]))
