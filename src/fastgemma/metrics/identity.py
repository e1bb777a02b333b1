"""Greedy identity of a config against the reference decode (plain eager AR, same weights).

- identity_rate: share of prompts whose whole greedy continuation equals the reference's.
- identity_prefix_mean: mean length (tokens) of the common prefix of the two continuations.
- top1_agree: teacher-forced along the reference continuation, the share of positions where both
  paths pick the same argmax; top1_agree_confident: the same over positions whose reference
  top-1 minus top-2 logit margin exceeds `margin` (near-ties flip under rounding: bf16 on random
  weights has them everywhere, so the confident rate is the one that separates bugs from rounding).
"""
from __future__ import annotations

import torch


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [N, V] -> (argmax [N], top-1 minus top-2 margin [N])."""
    v, i = logits.float().topk(2, dim=-1)
    return i[:, 0], v[:, 0] - v[:, 1]


def top1_agreement(ref: torch.Tensor, logits: torch.Tensor, margin: float = 0.1, ref_margins=None) -> dict:
    """Teacher-forced logits [N, V] of a reference and a candidate on the same positions ->
    top1 (share of equal argmaxes), top1_confident (over positions whose reference margin >
    `margin`; `ref_margins` [N] overrides the margins, e.g. a third path's), their count, the
    largest |logit| difference and the largest margin among flipped positions."""
    ref_top1, margins = top2(ref)
    if ref_margins is not None:
        margins = ref_margins
    hit = ref_top1 == top2(logits)[0]
    conf = margins > margin
    return dict(top1=hit.float().mean().item(),
                top1_confident=hit[conf].float().mean().item() if conf.any() else float("nan"),
                confident_positions=int(conf.sum()), max_abs_diff=_max_abs_diff(ref, logits),
                worst_flipped_margin=margins[~hit].max().item() if (~hit).any() else 0.0)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, where equal entries count 0: -inf in both (a pruned head's unkept rows) is no
    difference, -inf against a finite logit is an infinite one."""
    a, b = a.float(), b.float()
    return torch.where(a == b, 0.0, (a - b).abs()).max().item()


class IdentityTally:
    def __init__(self, margin: float = 0.1):
        self.margin = margin
        self.same = self.prompts = self.prefix = 0
        self.agree = self.positions = self.agree_conf = self.conf = 0

    def add(self, ref_tokens: list[int], cand_tokens: list[int], ref_top1, ref_margin, cand_top1):
        self.prompts += 1
        self.same += int(ref_tokens == cand_tokens)
        self.prefix += common_prefix(ref_tokens, cand_tokens)
        eq = ref_top1.cpu() == cand_top1.cpu()
        confident = ref_margin.cpu() > self.margin
        self.agree += int(eq.sum())
        self.positions += eq.numel()
        self.agree_conf += int((eq & confident).sum())
        self.conf += int(confident.sum())

    def metrics(self) -> dict:
        def ratio(a, b):
            return round(a / b, 6) if b else None

        return {"identity_rate": ratio(self.same, self.prompts),
                "identity_prefix_mean": ratio(self.prefix, self.prompts),
                "top1_agree": ratio(self.agree, self.positions),
                "top1_agree_confident": ratio(self.agree_conf, self.conf),
                "confident_frac": ratio(self.conf, self.positions),
                "identity_prompts": self.prompts, "identity_positions": self.positions,
                "identity_margin": self.margin}
