"""The ids a model predicts over a text: its greedy pick (the full head's argmax) at every position of the text,
teacher-forced, for lm_head.source=predicted (a keepset of the ids the model itself picks most often)."""
from __future__ import annotations

from collections import Counter

import torch

CHUNK = 256  # positions whose full-vocabulary logits are held at once (256 x 262,144 fp32: 268 MB)


@torch.no_grad()
def predicted_counts(model, seqs: list[list[int]], window: int | None = None, chunk: int = CHUNK) -> Counter:
    """{id: how many positions of `seqs` the model's full head picks it at}: one prompt forward over the
    sequences as a batch (the sliding layers keeping `window` keys, None: the model's own; pads left out),
    then the head's argmax `chunk` positions at a time. The head must still be the full one."""
    from .gptq import prompt_hidden

    if getattr(model, "logits_head", None) is not None or getattr(model, "pruned_head", None) is not None:
        raise ValueError("lm_head.source=predicted needs the model's full head; this one is already replaced")
    h, real = prompt_hidden(model, seqs, window)
    rows = h[real]
    picks = torch.cat([model.compute_logits(rows[i:i + chunk]).argmax(-1) for i in range(0, rows.shape[0], chunk)])
    return Counter(picks.tolist())
