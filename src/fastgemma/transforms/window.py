"""Sliding-layer window: how many past keys the sliding layers keep (ring-buffer KV slots).

The cache is the only thing that changes: `KVCache(window=...)` sizes the ring to window + step_rows
slots and masks keys with kpos <= qpos - window. Full-attention layers are untouched. Lossy: a window
below the trained one (E4B: 512) is measured by perplexity and identity rate, never assumed.
"""
from __future__ import annotations

from ..checks import is_int


class SlidingWindow:
    """size=None keeps the model's own window (the `native` choice)."""

    needs_cuda = False

    def __init__(self, size: int | None = None):
        if size is not None and not is_int(size, 1):
            raise ValueError(f"window size must be a positive integer or null (native), got {size!r}")
        self.size = size

    def cache_window(self, cfg) -> int | None:
        """The `window` argument for KVCache (None: cfg.sliding_window)."""
        return self.size

    def describe(self) -> dict:
        return {"window": self.size if self.size is not None else "native"}
