"""Prefill, then greedy decode one step at a time from the static cache."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch.fx.experimental import _config as fx_config

from ..checks import is_int
from ..metrics.timing import StepClock, compiled_graphs
from ..model.decoder import PromptRegions
from .cache import KVCache
from .compile import compile_step
from .eos_watch import EOS_LAG, EosWatch, check_eos_lag
from .steps import EagerStep, argmax_sampler, warm_on_side_stream


log = logging.getLogger("fastgemma")


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


PROMPT_COMPILE = (False, True, "layers")  # compile_prefill's values: eager, the whole forward, each layer's regions


def is_prompt_compile(v) -> bool:
    """v one of PROMPT_COMPILE (a bool or the string: 1, "true" and the like are not)."""
    return isinstance(v, (bool, str)) and v in PROMPT_COMPILE


def prompt_compile_for(compile: bool) -> bool | str:
    """The prompt's path when the step is compiled (`compile`) and nothing else is said: the layer regions,
    at the whole forward's TTFT for a quarter of its compile (H200, 100-1,024 tokens, runs LH / LF: within
    -0.2..+1.1%, 47 s against 187 s), or eager."""
    return "layers" if compile else False


MIN_LAST_CHUNK = 8  # a chunked prompt's last chunk is at least this long (or the whole prompt)


def chunk_starts(T: int, chunk: int) -> list[int]:
    """Where a T-token prompt's chunks start: every `chunk` tokens, except that the last chunk takes
    MIN_LAST_CHUNK tokens (at most `chunk`) from the one before it when it would be shorter. A compiled forward
    specializes a 1-token chunk (and its guards a 2-token one): a 4,097-token prompt compiled the prompt path
    again before its first token (tests/test_prefill.py: 9 more graphs of the tiny model's regions)."""
    starts = list(range(0, T, chunk))
    want = min(MIN_LAST_CHUNK, chunk)
    if len(starts) > 1 and T - starts[-1] < want:
        starts[-1] = T - want
    return starts


class Generator:
    """generate(prompt_ids, max_new_tokens, ignore_eos) on top of a model, a cache and a step."""

    def __init__(self, model, cache: KVCache, step=None, *, prefill_chunk: int = 2048, sampler=argmax_sampler,
                 compile_prefill: bool | str | None = None, prefill_bucket: int | None = None):
        """compile_prefill: torch.compile(dynamic=True) the prompt chunks' forward (one compilation
        serves every prompt length; the first prefill pays it); "layers": compile a layer's pieces
        instead (model/decoder.py PromptRegions: q / k / v, the cache writes, the attention, the rest; one
        compilation serves every layer of a kind). prefill_bucket > 0: a prompt that fits
        in one chunk is padded in front to a multiple of it (pads sit at the next position, invisible
        to the prompt) and, on CUDA, replayed from one CUDA graph per padded length (captured on first
        use or by warm_prefill). None: what the step says (graphs=cuda_graph / compiled set both)."""
        if prefill_chunk < 1:
            raise GenerationError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model, self.cache = model, cache
        self.step = step or EagerStep(model, cache, sampler)
        self.sampler = sampler
        self.prefill_chunk = prefill_chunk
        self.device = cache.ring_pos.device
        self.eos = set(model.config.eos_ids)
        self.eos_lag = EOS_LAG  # decode steps queued past the end-of-sequence check (set_eos_lag)
        if compile_prefill is None:
            compile_prefill = getattr(self.step, "compile_prefill", False)
        if prefill_bucket is None:
            prefill_bucket = int(getattr(self.step, "prefill_bucket", 0))
        self._compiled_forward = self._regions = None
        self.set_prefill(compile_prefill, prefill_bucket)

    def set_eos_lag(self, lag: int) -> None:
        """Decode steps the queue may run ahead of the end-of-sequence check (engine/eos_watch.py): a request
        that ends runs at most this many steps past its end, their tokens dropped; 0: each token read as it is
        made (a host sync a token). SpecGenerator reads its steps' counts the same way."""
        self.eos_lag = check_eos_lag(lag)

    def set_prefill(self, compile: bool | str, bucket: int) -> None:
        """The prompt's path: torch.compile(dynamic=True) of the chunk forward (True), of each layer's
        regions ("layers") or neither (False), compiled once, on first use, and kept; padding bucket (0:
        none; > 0 on CUDA: one graph per padded length). Captured graphs are dropped (they hold the old path)."""
        if not is_int(bucket, 0):
            raise GenerationError(f"prefill_bucket must be an integer >= 0 (0: no padding), got {bucket!r}")
        if not is_prompt_compile(compile):
            raise GenerationError(f"compile_prefill must be true (the whole forward), \"layers\" (each layer's "
                                  f"pieces, PromptRegions) or false, got {compile!r}")
        self.compile_prefill, self.prefill_bucket = compile, bucket
        if compile is True and self._compiled_forward is None:
            self._compiled_forward = compile_step(self._forward, dynamic=True)
        if compile == "layers" and self._regions is None:
            self._regions = PromptRegions(*(compile_step(f, dynamic=True) for f in PromptRegions()))
        self._chunk_forward = {True: self._dynamic_forward, False: self._forward,
                               "layers": self._regional_forward}[compile]
        self.capture_prefill = bucket > 0 and self.device.type == "cuda"
        self._prefill_graphs: dict[int, tuple] = {}  # padded length -> (graph, ids, pos, hidden)
        self._warm_lengths: set[int] = set()  # prompt lengths run once untimed on this uncaptured path (warm_prefill)
        self.capture_s: dict[int, float] = {}  # padded length -> seconds its capture took (warm_prefill)
        # and a new pool for the next captures: torch releases a private pool with its last graph,
        # and capturing into the released pool's handle fails an allocator assert
        self._graph_pool = None

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
        T = ids.shape[1]
        c = self.prefill_chunk
        padded = self.padded_length(T)
        if padded is not None:
            return self._padded_prefill(ids, padded)
        self.cache.reset()
        h = None
        starts = chunk_starts(T, c)
        for start, end in zip(starts, starts[1:] + [T]):
            # a fresh inference tensor like the padded path's and the graphs' inputs (their dispatch
            # keys and strides are guards of the compiled forward)
            chunk = ids[:, start:end].clone(memory_format=torch.contiguous_format)
            pos = torch.arange(start, end, device=self.device)[None].expand_as(chunk)
            h = self._chunk_forward(chunk, pos, start, "last" if end == T else "none")
        return h

    def _forward(self, chunk, pos, start: int, need: str):
        return self.model(chunk, pos, self.cache, start=start, need=need)

    def _regional_forward(self, chunk, pos, start: int, need: str):
        # no duck sizing while the regions trace: a prompt length equal to a weight's static size (64 rows
        # against a head_dim of 64) took that size's symbol, the regions compiled for that length alone, and
        # every other length recompiled them (sweeps/probes/prompt_compile.py --prompt-lens 64,5)
        with fx_config.patch(use_duck_shape=False):
            return self.model(chunk, pos, self.cache, start=start, need=need, regions=self._regions)

    def _dynamic_forward(self, chunk, pos, start: int, need: str):
        # the prompt length marked dynamic from the first call: on the H200 the first compile (a
        # 256-row prompt) had it static, and the next length (64 rows) recompiled the whole forward,
        # 150 s (run EW)
        torch._dynamo.maybe_mark_dynamic(chunk, 1)
        torch._dynamo.maybe_mark_dynamic(pos, 1)
        return self._compiled_forward(chunk, pos, start, need)

    def padded_length(self, T: int) -> int | None:
        """The length a T-token prompt is prefilled at: T rounded up to the bucket, within one chunk
        and the cache; None (chunked, unpadded) without a bucket, for prompts longer than a chunk,
        or when the cache has no slot left for the pads' position."""
        b = self.prefill_bucket
        if not b or T > self.prefill_chunk or T >= self.cache.max_context:
            return None
        return min(-(-T // b) * b, self.prefill_chunk, self.cache.max_context)

    def _padded_prefill(self, ids: torch.Tensor, padded: int) -> torch.Tensor:
        """One chunk of `padded` rows: padded - T pads in front, all at position T (the first position
        after the prompt), then the prompt at 0..T-1. Every prompt row's keys are at positions below T,
        so no pad is visible to it. The pads' writes: full layers' slot T, overwritten by the first
        decode or verify write at T before it attends (the MTP drafter masks keys >= T); the ring slot
        of T, marked empty afterwards (its old position T - ring is outside every window), since the
        eager step attends over the ring before it writes. The last row is the prompt's last:
        need="last" is unchanged."""
        T = ids.shape[1]
        x, pos = self._pad(ids, padded)
        if not self.capture_prefill:
            self.cache.reset()
            h = self._chunk_forward(x, pos, 0, "last")
        else:
            g = self._prefill_graphs.get(padded) or self._capture_prefill(padded)
            self.cache.reset()  # after any capture: its dummy rows wrote into the cache
            g[1].copy_(x)
            g[2].copy_(pos)
            g[0].replay()
            h = g[3]
        self.cache.ring_pos[:, T % self.cache.ring] = -1
        return h

    def _pad(self, ids, padded: int):
        B, T = ids.shape
        n = padded - T
        x = torch.cat([ids.new_zeros(B, n), ids], 1)
        pos = torch.cat([torch.full((n,), T, device=ids.device, dtype=torch.long),
                         torch.arange(T, device=ids.device)])[None].expand(B, -1)
        return x, pos

    def _capture_prefill(self, padded: int):
        """Capture the one-chunk prefill of `padded` rows (static ids / positions in, the last
        hidden out); the bucket graphs share one memory pool (they never run at the same time)."""
        B = self.cache.batch
        ids = torch.zeros(B, padded, dtype=torch.long, device=self.device)
        pos = torch.arange(padded, device=self.device)[None].repeat(B, 1)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        self.cache.reset()
        warm_on_side_stream(lambda: self._chunk_forward(ids, pos, 0, "last"), 1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            h = self._chunk_forward(ids, pos, 0, "last")
        self._prefill_graphs[padded] = (graph, ids, pos, h)
        return self._prefill_graphs[padded]

    @torch.inference_mode()
    def warm_prefill(self, max_len: int, lengths=()) -> int:
        """Capture the prefill graph of every padded length up to max_len's (the warm-up: no prompt
        pays a capture later). Each capture's seconds go to capture_s, logged at debug level with the
        graphs torch.compile compiled meanwhile. A path without prompt graphs runs one untimed prefill of each of
        `lengths` instead (token id 0, nothing kept: not the prompts themselves), so that kernels built per prompt
        shape (Triton specializes a row count divisible by 16, the int4 tiles go by row buckets) are built before a
        timed prompt of that shape; the bench task passes its timed prompts' lengths on a CUDA device. Returns the
        number of graphs held."""
        if not self.capture_prefill:
            todo = sorted(set(lengths) - self._warm_lengths)
            for n in todo:
                self.prefill(torch.zeros(self.cache.batch, n, dtype=torch.long, device=self.device))
                self._warm_lengths.add(n)
            if todo:
                self.cache.reset()
        else:
            for n in sorted({self.padded_length(t) for t in range(1, max_len + 1)} - {None}):
                if n not in self._prefill_graphs:
                    t0, graphs = time.perf_counter(), compiled_graphs()
                    self._capture_prefill(n)
                    torch.cuda.synchronize(self.device)
                    self.capture_s[n] = round(time.perf_counter() - t0, 3)
                    k = compiled_graphs() - graphs
                    log.debug("prompt graph of %d rows: %.1f s, %d graph%s compiled", n, self.capture_s[n], k,
                              "s" * (k != 1))
            self.cache.reset()
        return len(self._prefill_graphs)

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
        if ignore_eos:
            while n < max_new_tokens:
                tok = self.step(tok)
                clock.mark()
                n += 1
        else:  # the end found `eos_lag` steps late at most (engine/eos_watch.py), their tokens dropped below
            watch = EosWatch(self.eos, self.device, self.eos_lag)
            watch.push(first, 0)
            while n < max_new_tokens and watch.end is None:
                tok = self.step(tok)
                clock.mark()
                watch.push(self.step.emitted_at(n - 1), n)
                n += 1
            watch.close()
        times = clock.intervals()
        out = torch.cat([first, self.step.tokens()], 1) if n > 1 else first
        tokens = out[0].tolist()
        if not ignore_eos and watch.end is not None:  # the first end id (the watch read every token made)
            tokens = tokens[: watch.end + 1]
        step_s = times[1:len(tokens)]  # the steps that made kept tokens (not those run past the end)
        return Generation(tokens=tokens, prompt_len=T, ttft_s=times[0], step_s=step_s,
                          tokens_per_step=[1] * len(step_s))

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
