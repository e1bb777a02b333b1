"""A kernel that only reads: the bandwidth floor of the weight-streaming benchmarks (bench_util.read_floor)."""
from __future__ import annotations

import triton
import triton.language as tl

from .gemv import _pdl_trigger, _pdl_wait


@triton.jit
def _read_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_trigger(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(ptr + offs, mask=offs < n, other=0)
    _pdl_wait(PDL)
    tl.store(out_ptr + tl.program_id(0), tl.sum(v & 1, axis=0))  # every word read; no int32 overflow
