"""Speculative acceptance over a set of generations (names as in DESIGN.md)."""
from __future__ import annotations


def acceptance_summary(generations) -> dict:
    """accept_mean: accepted drafts per verify step (tokens per step - 1); accept_by_pos: the
    conditional rate of each draft position; over the counted steps of every generation."""
    gens = [g for g in generations if hasattr(g, "accept_hits")]  # SpecGeneration only
    if not gens:
        return {"accept_mean": None, "accept_by_pos": None}
    k = max(g.depth for g in gens)
    hits, tries = [0] * k, [0] * k
    for g in gens:
        for j, (h, t) in enumerate(zip(g.accept_hits, g.accept_tries)):
            hits[j] += h
            tries[j] += t
    steps = tries[0]  # every counted step tries draft 1
    return {"accept_mean": round(sum(hits) / steps, 4) if steps else None,
            "accept_by_pos": [round(h / t, 4) if t else None for h, t in zip(hits, tries)]}
