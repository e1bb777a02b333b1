"""Quality of a pruned LM head.

prune_miss_rate: the share of positions whose full-vocabulary argmax falls outside the keepset, i.e.
where a pruned head cannot emit the plain model's greedy token (it picks the best kept id instead).
Elsewhere the pruned argmax equals the full argmax exactly (up to rounding of near-ties on a GPU).
"""
from __future__ import annotations

import torch


def prune_miss_rate(full_argmax_ids, keepset) -> float:
    """full_argmax_ids: ids [n] (any shape; a tensor or a list) of the full head's argmax at each
    position; keepset: the kept ids (a tensor, list or set). -> misses / positions, in [0, 1]."""
    ids = torch.as_tensor(full_argmax_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("prune_miss_rate: no positions")
    keep = torch.as_tensor(sorted(keepset) if isinstance(keepset, (set, frozenset)) else keepset,
                           dtype=torch.long).reshape(-1)
    if keep.numel() == 0:
        raise ValueError("prune_miss_rate: the keepset is empty")
    hit = torch.isin(ids.cpu(), keep.cpu())
    return float((~hit).sum()) / ids.numel()
