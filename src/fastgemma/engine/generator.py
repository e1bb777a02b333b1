"""Prefill, then greedy decode one step at a time from the static cache."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..metrics.timing import StepClock
from .cache import KVCache
from .steps import EagerStep, argmax_sampler


class GenerationError(ValueError):
    pass


@dataclass
class Generation:
    tokens: list[int]                   # generated ids (batch row 0), the first from prefill
    prompt_len: int
    ttft_s: float                       # prompt in -> first token ready
    step_s: list[float] = field(default_factory=list)   # one entry per decode step after the first token
    tokens_per_step: list[int] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.ttft_s + sum(self.step_s)


class Generator:
    """generate(prompt_ids, max_new_tokens, ignore_eos) on top of a model, a cache and a step."""

    def __init__(self, model, cache: KVCache, step=None, *, prefill_chunk: int = 2048, sampler=argmax_sampler):
        self.model, self.cache = model, cache
        self.step = step or EagerStep(model, cache, sampler)
        self.sampler = sampler
        self.prefill_chunk = prefill_chunk
        self.device = cache.ring_pos.device
        self.eos = set(model.config.eos_ids)

    # ---- validation ----------------------------------------------------------------------------
    def _prompt(self, prompt_ids) -> torch.Tensor:
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise GenerationError("empty prompt: at least one token id is needed")
        if ids.shape[0] != self.cache.batch:
            raise GenerationError(f"batch of {ids.shape[0]} prompts for a cache built for {self.cache.batch}")
        v = self.model.config.vocab_size
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= v:
            bad = lo if lo < 0 else hi
            raise GenerationError(f"token id {bad} is outside the vocabulary [0, {v})")
        return ids.to(self.device)

    def _check_room(self, n_prompt: int, n_new: int):
        if n_prompt + n_new > self.cache.max_context:
            raise GenerationError(f"prompt ({n_prompt}) + new tokens ({n_new}) = {n_prompt + n_new} exceeds the "
                                  f"cache's max_context {self.cache.max_context}; raise max_context")

    # ---- prefill -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] on the device -> hidden [B, 1, hidden] of the last position. Chunked: chunks
        before the last stop at the first KV-shared layer (nothing after it writes the cache)."""
        self.cache.reset()
        T = ids.shape[1]
        c = self.prefill_chunk
        h = None
        for start in range(0, T, c):
            chunk = ids[:, start:start + c]
            pos = torch.arange(start, start + chunk.shape[1], device=self.device)[None].expand_as(chunk)
            last = start + c >= T
            h = self.model(chunk, pos, self.cache, start=start, need="last" if last else "none")
        return h

    # ---- decode --------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, ignore_eos: bool = True) -> Generation:
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = self._prompt(prompt_ids)
        T = ids.shape[1]
        self._check_room(T, max_new_tokens)
        clock = StepClock(self.device)
        clock.mark()
        h = self.prefill(ids)
        tok, _ = self.sampler(self.model, h)
        clock.mark()
        first = tok
        self.step.begin(T)
        n = 1
        while n < max_new_tokens:
            if not ignore_eos and int(tok[0, 0]) in self.eos:
                break
            tok = self.step(tok)
            clock.mark()
            n += 1
        times = clock.intervals()
        out = torch.cat([first, self.step.tokens()], 1) if n > 1 else first
        tokens = out[0].tolist()
        if not ignore_eos:
            for i, t in enumerate(tokens):
                if t in self.eos:
                    tokens = tokens[: i + 1]
                    break
        return Generation(tokens=tokens, prompt_len=T, ttft_s=times[0], step_s=times[1:],
                          tokens_per_step=[1] * (len(times) - 1))

    @torch.inference_mode()
    def forced(self, prompt_ids, forced_tokens) -> torch.Tensor:
        """Teacher-forced decode through this generator's step: feeds forced_tokens[:-1] after the
        prompt and returns the fp32 logits [N, V] that predicted each forced token (row 0 from prefill)."""
        ids = self._prompt(prompt_ids)
        forced = torch.as_tensor(forced_tokens, dtype=torch.long, device=self.device).reshape(1, -1)
        self._check_room(ids.shape[1], forced.shape[1])
        h = self.prefill(ids)
        _, logits = self.sampler(self.model, h)
        rows = [logits[0].clone()]
        self.step.begin(ids.shape[1])
        for i in range(forced.shape[1] - 1):
            self.step(forced[:, i:i + 1])
            rows.append(self.step.last_logits[0].clone())
        return torch.stack(rows)
