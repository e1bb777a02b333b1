"""Static KV cache, allocated once.

Only layers that store KV own memory (E4B: 24 of 42). Layout per store layer: k, v [B, S, Hkv, D],
slot-major. Full layers: S = max_context, slot = position. Sliding layers: a ring buffer of
S = window + step_rows slots, slot = pos % S, with `ring_pos` [B, S] int32 holding the position in
each slot (-1 empty), shared by all sliding layers. The step_rows of slack let a step of up to
step_rows query rows (decode, speculative verify) write before it attends without evicting a key
that its first row still needs; a rejected speculative write is masked by its position and later
overwritten, so rollback costs nothing.
Bytes (bf16, E4B): a sliding store layer 2 * 2 * 256 * 2 = 2,048 B per slot; a full one 4,096 B.
"""
from __future__ import annotations

import torch

from ..model.config import ModelConfig


class CacheError(ValueError):
    pass


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, max_context: int, *, window: int | None = None,
                 step_rows: int = 16, device="cpu", dtype=torch.bfloat16):
        if max_context < 1:
            raise CacheError(f"max_context must be >= 1, got {max_context}")
        if max_context > cfg.max_position_embeddings:
            raise CacheError(f"max_context {max_context} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        self.window = int(window or cfg.sliding_window)
        if self.window < 1:
            raise CacheError(f"window must be >= 1, got {self.window}")
        self.batch, self.max_context, self.step_rows = batch, max_context, step_rows
        self.ring = min(self.window + step_rows, max_context)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for s in cfg.layer_specs():
            if not s.stores_kv:
                continue
            n = self.ring if s.sliding else max_context
            shape = (batch, n, s.num_kv_heads, s.head_dim)
            self.k[s.index] = torch.zeros(shape, device=device, dtype=dtype)
            self.v[s.index] = torch.zeros(shape, device=device, dtype=dtype)
        self.ring_pos = torch.full((batch, self.ring), -1, dtype=torch.int32, device=device)

    def reset(self):
        """Forget every sequence. Full-layer slots need no clearing: a query at position p only
        sees slots <= p, which the new sequence has written."""
        self.ring_pos.fill_(-1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
