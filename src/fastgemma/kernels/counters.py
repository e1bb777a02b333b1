"""Arrival counters for kernels whose last program to finish a tile does the tile's final step
(the int4 split-K fixup, the drafter head's argmax, the attention's merge of its splits): one int32
per tile, zero between launches (the last program resets its own), shared per device, so such
launches must not run concurrently: one stream, and under programmatic dependent launch every
kernel waits for the one before it (griddepcontrol.wait) before it touches a counter.

`arrival_flag`: the words of fuse.flag_wait (a GEMM raises the flag when its last program has stored, the
residual norm after it spins on the flag instead of waiting for the GEMM's grid to end), apart from the
counters above, which the GEMM's own split-K fixup uses while the norm spins."""
from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_FLAGS: dict[torch.device, torch.Tensor] = {}
FLAG_WORDS = 3  # the producer's arrivals, the flag, the waiting programs' departures


def arrival_counters(device: torch.device, n: int, who: str = "kernel") -> torch.Tensor:
    """At least n zeroed int32 counters on `device`, allocated once, outside any CUDA-graph capture
    (run the shape once before capturing)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{who}: {n} arrival counters needed while capturing a CUDA graph; run the "
                               "shape once before capture")
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def arrival_flag(device: torch.device, who: str = "kernel") -> torch.Tensor:
    """The device's FLAG_WORDS zeroed int32 words of fuse.flag_wait (one producer and its waiter at a time: each
    resets what it used), allocated once, outside any CUDA-graph capture."""
    buf = _FLAGS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{who}: the arrival flag is needed while capturing a CUDA graph; run the shape "
                               "once before capture")
        buf = _FLAGS[device] = torch.zeros(FLAG_WORDS, dtype=torch.int32, device=device)
    return buf
