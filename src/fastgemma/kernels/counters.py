"""Arrival counters for kernels whose last program to finish a tile does the tile's final step
(the int4 split-K fixup, the drafter head's argmax, the attention's merge of its splits): one int32
per tile, zero between launches (the last program resets its own), shared per device, so such
launches must not run concurrently: one stream, and under programmatic dependent launch every
kernel waits for the one before it (griddepcontrol.wait) before it touches a counter."""
from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


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
