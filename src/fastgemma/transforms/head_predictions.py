"""The ids a model predicts over a text: its greedy pick (the full head's argmax) and the runners-up after it at
every position of the text, teacher-forced, for lm_head.source=predicted (a keepset of the ids the model itself
picks most often, then of those it nearly picks)."""
from __future__ import annotations

from collections import Counter

import torch

CHUNK = 256  # positions whose full-vocabulary logits are held at once (256 x 262,144 fp32: 268 MB)
NEAR = 32  # the runners-up counted at each position by default (lm_head.runners_up)


@torch.no_grad()
def predicted_counts(model, seqs: list[list[int]], window: int | None = None, chunk: int = CHUNK,
                     near: int = NEAR) -> tuple[Counter, Counter]:
    """({id: how many positions of `seqs` the model's full head picks it at}, {id: at how many it is among the
    `near` runners-up}): one prompt forward over the sequences as a batch (the sliding layers keeping `window`
    keys, None: the model's own; pads left out), then the head's top 1 + near `chunk` positions at a time.
    The head must still be the full one."""
    from .gptq import prompt_hidden

    if getattr(model, "logits_head", None) is not None or getattr(model, "pruned_head", None) is not None:
        raise ValueError("lm_head.source=predicted needs the model's full head; this one is already replaced")
    h, real = prompt_hidden(model, seqs, window)
    rows = h[real]
    top = torch.cat([model.compute_logits(rows[i:i + chunk]).topk(1 + near, dim=-1).indices
                     for i in range(0, rows.shape[0], chunk)])
    return Counter(top[:, 0].tolist()), Counter(top[:, 1:].flatten().tolist())
