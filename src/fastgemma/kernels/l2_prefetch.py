"""Weights asked into the L2 ahead of the kernel that reads them, from a side branch of the CUDA graph.

A one-row decode kernel streams its weights at 0.7-2.8 TB/s of the H200's ~4.2 (docs/results.md: its
few waves and its boundary); a kernel launched beside it, on another stream, can use the rest of the
bandwidth to bring the next kernel's weights into the L2, so that kernel reads them from there.
`l2_prefetch` launches one program per `LANES * CHUNK` bytes of a tensor; each lane asks for its
CHUNK bytes with one `cp.async.bulk.prefetch.L2` (sm_90: the copy engine fetches them; no registers
held, nothing waited for, nothing written), so the program exits at once. `ahead` forks such launches
onto a side stream after the work queued so far (a CUDA graph capture records a side branch that runs
beside the next kernels) and `join` joins them back before the capture ends.

The prefetch is a hint: no output changes with it. Off CUDA (the interpreter, CPUs) it does nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16 << 10  # bytes a lane asks for: one bulk prefetch
LANES = 32  # lanes a program (one warp)


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Bytes [pid * LANES * CHUNK, ...) of base, CHUNK a lane, sizes rounded down to 16 bytes (the
    bulk copy's unit: a tensor's last < 16 bytes are left out)."""
    off = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = (tl.minimum(tl.maximum(nbytes - off, 0), CHUNK) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_supported(device) -> bool:
    """The bulk prefetch needs sm_90 or later."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch(tensors, chunk: int = CHUNK, lanes: int = LANES) -> int:
    """Ask every tensor of `tensors` (contiguous) into the L2 on the current stream; returns the
    launches made (0 off sm_90 CUDA: nothing to do)."""
    if chunk < 16 or chunk % 16 or chunk >= 1 << 31:
        raise ValueError(f"l2_prefetch chunk must be a multiple of 16 bytes below 2 GiB, got {chunk}")
    if lanes < 1 or lanes & (lanes - 1):
        raise ValueError(f"l2_prefetch lanes must be a power of two, got {lanes}")
    launches = 0
    for t in tensors:
        if not prefetch_supported(t.device):
            continue
        if not t.is_contiguous():
            raise ValueError("l2_prefetch asks for contiguous tensors (one range of bytes each)")
        nbytes = t.numel() * t.element_size()
        if nbytes >= 16:
            b = t.view(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.view(-1)
            _l2_prefetch_kernel[(triton.cdiv(nbytes, chunk * lanes),)](b, nbytes, CHUNK=chunk, LANES=lanes,
                                                                      num_warps=max(1, lanes // 32))
            launches += 1
    return launches


class Ahead:
    """Side-stream prefetches: `fork(tensors)` queues l2_prefetch of them on a side stream after all the
    work queued so far on the current stream (so, under capture, the launch runs beside the kernels
    queued next); `join()` makes the current stream wait for every forked launch (before a capture
    ends: a graph's side branches must come back to the capturing stream)."""

    def __init__(self, device, chunk: int = CHUNK, lanes: int = LANES):
        self.on = prefetch_supported(device)
        self.side = torch.cuda.Stream(device) if self.on else None
        self.chunk, self.lanes, self.forked = chunk, lanes, False

    def fork(self, tensors) -> None:
        if not self.on:
            return
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            l2_prefetch(tensors, self.chunk, self.lanes)
        self.forked = True

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.side)
            self.forked = False
