"""Speculative decoding choices (the `spec` group).

- none: plain autoregressive decode, the Generator as it is.
- mtp: the Gemma 4 MTP drafter proposes `depth` tokens per step, one verify pass over depth + 1
  rows accepts the longest matching prefix plus the target's own next token (SpecGenerator).
- replay: the same drafter runs (its cost is counted) but its drafts are replaced by a reference
  greedy trace that is right with a configured per-position acceptance profile: speed figures
  for weights whose drafter is untrained (synthetic). Verify and accept are the same code.

A speculative method owns its decode loop and returns an object with the Generator's interface,
so the plain loop never branches on it. Graph capture follows the `graphs` choice: the draft loop,
the verify pass and the accept bookkeeping are captured when the AR step is a CUDA graph.
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..checks import is_int
from ..engine.generator import Generator

log = logging.getLogger("fastgemma")

SYNTHETIC_MTP = ("spec=mtp with spec.drafter=synthetic: the drafter's weights are random, so its drafts almost never "
                 "match the target's tokens (accept_mean ~0, ~1 token a step): tok/s measures its cost, not a trained "
                 "drafter's gain; spec=replay times the same step at a trained drafter's acceptance profile, "
                 "spec.drafter=DIR loads google/gemma-4-E4B-it-assistant")


def invariant_hint(model, depth: int) -> str | None:
    """What to tell a user whose speculative run takes fuse=layers' verify pass without fuse.batch_invariant (where
    the tensor-core kernels could take its depth + 1 rows), or None."""
    from ..kernels.mma_table import MAX_ROWS

    if getattr(model, "fused_verify", None) is None or getattr(model, "batch_invariant", False) or depth + 1 > MAX_ROWS:
        return None
    return (f"spec with fuse=layers and fuse.batch_invariant off (false, or auto: its log line says why): the verify "
            f"pass's {depth + 1} rows round otherwise than the one-row step, so the speculative tokens may leave the "
            "AR step's (synthetic E4B on an H100: from token 8, docs/h100.md); fuse.batch_invariant=true (depth <= 7) "
            "makes them the AR step's bit for bit, and on the int4 body its verify pass is the faster one (the "
            "README's k=7 recipe)")


class NoSpec:
    """One token per step from the engine's step. depth: accepted and unused (spec.depth may be swept across
    spec=none,mtp,replay); any non-negative count means plain AR."""

    needs_cuda = False

    def __init__(self, depth: int = 0):
        if not is_int(depth, 0, None):
            raise ValueError(f"spec depth must be a non-negative integer, got {depth!r}")

    def make_generator(self, model, cache, step, sampler, prefill_chunk: int) -> Generator:
        return Generator(model, cache, step, prefill_chunk=prefill_chunk, sampler=sampler)

    def describe(self) -> dict:
        return {"spec": "none"}


def _step_flags(step) -> tuple[bool, bool, int]:
    """(capture graphs, torch.compile, warm-up iterations) as the `graphs` choice set them on the step."""
    from ..engine.steps import GraphStep

    fwd = getattr(step, "forward", None)
    compiled = fwd is not None and hasattr(fwd, "_torchdynamo_orig_callable")
    return isinstance(step, GraphStep), compiled, int(getattr(step, "warmup_iters", 2))


class MtpSpec:
    """spec=mtp: depth k drafts per step from the drafter (synthetic or a checkpoint directory)."""

    needs_cuda = False
    kind = "mtp"

    def __init__(self, depth: int = 7, centroid_top_k: int | None = None, drafter: str = "synthetic",
                 drafter_seed: int = 0):
        if not is_int(depth, 1, 15):
            raise ValueError(f"spec depth must be an integer in [1, 15], got {depth!r}")
        if centroid_top_k is not None and not is_int(centroid_top_k, 1):
            raise ValueError(f"centroid_top_k must be a positive integer or null, got {centroid_top_k!r}")
        drafter = str(drafter)
        if drafter != "synthetic" and not Path(drafter).expanduser().is_dir():
            raise FileNotFoundError(f"spec.drafter: drafter checkpoint directory {drafter} does not exist "
                                    "(use synthetic, or a local copy of google/gemma-4-E4B-it-assistant)")
        self.depth, self.centroid_top_k, self.drafter, self.drafter_seed = depth, centroid_top_k, drafter, drafter_seed
        self._drafter_info: dict = {}

    def build_drafter(self, model):
        from ..model.drafter import load_drafter, synthetic_drafter

        w = model.embed_tokens.weight
        if self.drafter == "synthetic":
            if self.kind == "mtp":
                log.warning(SYNTHETIC_MTP)
            d = synthetic_drafter(model.config, device=w.device, dtype=w.dtype, seed=self.drafter_seed)
        else:
            d = load_drafter(self.drafter, model.config, device=w.device, dtype=w.dtype)
        d.set_top_k(self.centroid_top_k)
        if model.fuse_drafter is not None:  # fuse=layers: the drafter's one-row step fused too
            d = model.fuse_drafter(d)
        c = d.config
        self._drafter_info = {"drafter_name": c.name, "drafter_hidden": c.hidden_size,
                              "drafter_params": sum(p.numel() for p in d.parameters()),
                              "centroid_top_k_effective": d.top_k, "drafter_bytes_per_step": d.nbytes_per_step(),
                              "drafter_fused": d.fused_forward is not None,
                              "drafter_loop_kernel": getattr(d, "loop_kernel", None) is not None}
        return d

    def replay(self):
        return None

    def make_generator(self, model, cache, step, sampler, prefill_chunk: int):
        from ..engine.speculative import SpecGenerator

        graphs, compiled, warmup = _step_flags(step)
        hint = invariant_hint(model, self.depth)
        if hint:
            log.warning(hint)
        return SpecGenerator(model, cache, self.build_drafter(model), self.depth, step=step, sampler=sampler,
                             prefill_chunk=prefill_chunk, replay=self.replay(), graphs=graphs, compile=compiled,
                             warmup_iters=warmup)

    def describe(self) -> dict:
        return {"spec": self.kind, "depth": self.depth, "centroid_top_k": self.centroid_top_k,
                "drafter": self.drafter, "drafter_seed": self.drafter_seed, **self._drafter_info}


class ReplaySpec(MtpSpec):
    """spec=replay: mtp's drafter cost, drafts from the reference trace with `profile`'s odds."""

    kind = "replay"

    def __init__(self, depth: int = 7, centroid_top_k: int | None = None, drafter: str = "synthetic",
                 drafter_seed: int = 0, profile="frontier", replay_seed: int = 0):
        super().__init__(depth, centroid_top_k, drafter, drafter_seed)
        from ..engine.speculative import resolve_profile

        self.profile = resolve_profile(profile)
        self.profile_name = profile if isinstance(profile, str) else "custom"
        self.replay_seed = replay_seed

    def replay(self):
        from ..engine.speculative import Replay

        return Replay(self.profile, self.replay_seed)

    def describe(self) -> dict:
        from ..engine.speculative import expected_tokens_per_step

        return {**super().describe(), "profile": self.profile_name, "profile_rates": self.profile,
                "replay_seed": self.replay_seed,
                "expected_tokens_per_step": round(expected_tokens_per_step(self.profile, self.depth), 3)}
