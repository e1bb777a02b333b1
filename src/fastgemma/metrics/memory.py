"""Memory facts: peak device memory, bytes of weights a decode step reads, copy bandwidth.

Model bandwidth utilisation: mbu = weight_bytes_per_token * tps / copy bandwidth, where the copy
bandwidth is measured in this process (device-to-device copy, bytes read + written per second).
On a CPU these are None: no number is made up for a machine that was not measured.
"""
from __future__ import annotations

import torch


def reset_peak(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def vram_peak_gb(device: torch.device) -> dict:
    """{vram_peak_gb (allocated), vram_reserved_peak_gb}; None on a CPU."""
    if device.type != "cuda":
        return {"vram_peak_gb": None, "vram_reserved_peak_gb": None}
    torch.cuda.synchronize(device)
    return {"vram_peak_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
            "vram_reserved_peak_gb": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters and persistent buffers one decode step reads.

    Every body linear, norm and packed quantised buffer (whatever a quant transform left in the
    modules) counts in full, except copies a module lists in `derived_buffers` (Int4Linear's packed
    scale / zero words: a launch reads them or the scales and zeros, not both). Gathers count one
    row: the PLE table (ple_vocab x L*ple_dim) and, when a separate head replaces the tied one
    (model.logits_head), the embedding. With the tied head the embedding matrix is read whole by
    the head, so it counts once in full.
    """
    gathered = {"embed_tokens_per_layer.weight"}
    if getattr(model, "logits_head", None) is not None:
        gathered.add("embed_tokens.weight")
    seen = {id(getattr(m, b)) for m in model.modules() for b in getattr(m, "derived_buffers", ())}
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        if name in gathered:
            total += _nbytes(t[0])
        elif "inv_freq" in name:  # RoPE frequencies: computed buffers, not weights
            continue
        else:
            total += _nbytes(t)
    return total


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float | None:
    """Device-to-device copy, (read + write) bytes / s in GB/s: `iters` back-to-back copies of an
    `nbytes` buffer (1 GiB, far larger than any L2; twice that held briefly) timed as one span after 3
    untimed ones, a quarter of the size where that does not fit. None on a CPU (not measured there).
    The benchmarks and the bench task share it, so their `mbu` is against the same figure (the bench
    task's earlier one timed each 256 MiB copy alone, launch gaps included: 3.71-3.87 TB/s on the H200
    in runs EV-EX, where the benchmarks' back-to-back copies of 2 GiB read 4.27 the same day)."""
    if torch.device(device).type != "cuda":
        return None
    src = dst = None
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except torch.OutOfMemoryError:
        src = dst = None  # nothing of this size held while the smaller one is tried
        if nbytes <= 1 << 26:
            raise
        return copy_bandwidth_gbs(device, nbytes // 4, iters)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        dst.copy_(src)
    b.record()
    b.synchronize()
    t = a.elapsed_time(b) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return round(2 * nbytes / t / 1e9, 1)


def mbu(bytes_per_token: float | None, tps: float | None, copy_gbs: float | None) -> float | None:
    if not (bytes_per_token and tps and copy_gbs):
        return None
    return round(bytes_per_token * tps / (copy_gbs * 1e9), 4)
