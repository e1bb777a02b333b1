"""A kernel that only reads: the bandwidth floor the weight-streaming benchmarks hold their kernels against."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import _pdl_trigger, _pdl_wait, pdl_args


@triton.jit
def _read_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_trigger(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(ptr + offs, mask=offs < n, other=0)
    _pdl_wait(PDL)
    tl.store(out_ptr + tl.program_id(0), tl.sum(v & 1, axis=0))  # every word read; no int32 overflow


def read_floor(words: torch.Tensor, block: int, warps: int, pdl: bool) -> torch.Tensor:
    """Read every int32 of `words` (block per program, the loads before the PDL wait as the GEMVs
    issue them) and store one sum per program."""
    flat = words.reshape(-1)
    n = flat.numel()
    out = torch.empty(triton.cdiv(n, block), device=words.device, dtype=torch.int32)
    _read_kernel[(out.numel(),)](flat, out, n, BLOCK=block, num_warps=warps, **pdl_args(pdl, words.device))
    return out
