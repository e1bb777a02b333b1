"""Speculative decoding with the MTP drafter: k drafts, one verify pass over k+1 rows, accept.

One step, everything on the device (batch B; P = position of `tok`, the last accepted token, whose
K/V is not in the cache yet; `hid` = the target's final-norm hidden at P-1, which predicted tok):
  draft:  k drafter steps at the fixed RoPE position P, keys at positions < P   -> drafts [B, k]
          (replay: drafts replaced by the reference trace, right with the profile's odds)
  verify: model.step([tok, d1..dk], [P..P+k]) -> argmax per row t [B, k+1]    (split-KV attention)
  accept: n = longest prefix with d_i == t_{i-1}; emit t_0..t_n (d_1..d_n and the target's own
          t_n); tok = t_n at P+n+1, hid = row n's hidden.
Rollback is free: the step writes every row's K/V before attending, and every slot is tagged with
its position (full layers: slot == position; sliding: ring_pos). A rejected row's K/V sits at a
position > every later query until the next verify, which starts at P+n+1 and rewrites it. With
k+1 <= step_rows, a write at P+k evicts ring position P+k-(window+step_rows) <= P-window-1, which
no later query (positions >= P) keeps. The drafter masks at P-1, so it never sees a rejected row.

Host syncs: one per batch of steps, never per draft token. A batch is ceil(remaining / (k+1))
steps (so it cannot overshoot), then the count is read; ~log(max_new) syncs per request.
On CUDA with graphs=cuda_graph, prepare() captures the k-step draft loop as one graph, the verify
pass as another and the accept bookkeeping as a third; on a CPU the same code runs uncaptured. The
bookkeeping (and replay's drafts) is one kernel each (kernels/spec_accept.py) on CUDA and under
TRITON_INTERPRET, its torch twin (`_accept_torch`, `_replay_drafts_torch`) elsewhere.
"""
from __future__ import annotations

import functools
import math
import warnings
import zlib
from collections import deque
from dataclasses import dataclass, field

import torch

from ..checks import is_int
from ..metrics.timing import StepClock
from .compile import compile_step
from .eos_watch import copies_for
from .generator import Generation, GenerationError, Generator, prompt_compile_for
from .steps import PREFILL_BUCKET, argmax_sampler, warm_on_side_stream

# conditional per-position acceptance (P(accept draft j | drafts < j accepted)) measured in the
# Fast Gemma challenge: the frontier drafter at K=7 -> 3.85 tokens per step
FRONTIER = (0.729, 0.759, 0.793, 0.822, 0.835, 0.836, 0.847)


def expected_tokens_per_step(profile, k: int) -> float:
    """1 + sum_j prod_{i<=j} p_i over the first k positions (the last rate repeats past the profile)."""
    p = extend_profile(profile, k)
    out, run = 1.0, 1.0
    for x in p:
        run *= x
        out += run
    return out


def extend_profile(profile, k: int) -> list[float]:
    p = [float(x) for x in profile]
    if not p:
        raise ValueError("an acceptance profile needs at least one rate")
    bad = [x for x in p if not 0.0 <= x <= 1.0]
    if bad:
        raise ValueError(f"acceptance rates must be in [0, 1], got {bad}")
    return (p + [p[-1]] * k)[:k]


def profile_for(tokens_per_step: float, k: int, base=FRONTIER) -> list[float]:
    """base ** a with a solved so that the expected tokens per step at depth k hit the target:
    the frontier's shape at another drafter's quality (stock drafter 3.34 at K=6; chat 3.57 at K=7)."""
    lo, hi = 1e-3, 1e3
    if not 1.0 < tokens_per_step < k + 1:
        raise ValueError(f"tokens per step {tokens_per_step} must be in (1, {k + 1}) at depth {k}")
    for _ in range(200):
        a = math.sqrt(lo * hi)
        if expected_tokens_per_step([x ** a for x in base], k) > tokens_per_step:
            lo = a
        else:
            hi = a
    return [round(x ** math.sqrt(lo * hi), 4) for x in base]


PROFILES = {
    "frontier": list(FRONTIER),
    "stock": profile_for(3.34, 6),   # the stock google drafter, K=6
    "chat": profile_for(3.57, 7),    # chat-style prompts, K=7
}


def resolve_profile(profile) -> list[float]:
    if isinstance(profile, str):
        if profile not in PROFILES:
            raise ValueError(f"unknown acceptance profile {profile!r}; known: {sorted(PROFILES)} or a list of rates")
        return list(PROFILES[profile])
    return extend_profile(profile, len(list(profile)))


@dataclass
class SpecGeneration(Generation):
    """Generation plus acceptance counts: accept_hits[j] / accept_tries[j] is the conditional rate
    of draft position j+1 (over steps whose drafts all lie inside the request); accepted[s] the
    drafts step s accepted."""
    depth: int = 0
    accept_hits: list[int] = field(default_factory=list)
    accept_tries: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    replay_mismatch: int = 0     # replay: emitted tokens that differ from the reference trace


class Replay:
    """Drafts that follow a reference greedy trace: draft j is right with the profile's conditional
    odds, and every draft after the first miss is wrong. Uniforms are drawn per request on the host
    (seeded) and indexed on the device by step, so a captured graph replays them without RNG state."""

    def __init__(self, profile=FRONTIER, seed: int = 0):
        self.profile = resolve_profile(profile)
        self.seed = seed
        self.references: dict[tuple, list[int]] = {}

    def describe(self) -> dict:
        return {"profile": self.profile, "replay_seed": self.seed}

    @staticmethod
    def key(prompt_ids) -> tuple:
        """A prompt's key in `references`."""
        return tuple(int(x) for x in torch.as_tensor(prompt_ids).reshape(-1).tolist())

    def draw_seed(self, prompt_ids) -> int:
        """The seed of a request's acceptance draws: the replay's seed and the prompt's ids (CRC-32 of them as
        int64), not its reference trace, so two runs of one workload draw the same acceptances whatever numerics
        moved their greedy traces (a choice that rounds otherwise, another GPU) and their step times compare
        with their tok/s."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).cpu().numpy().astype("<i8")
        return self.seed * 1_000_003 + zlib.crc32(ids.tobytes())


def draft_steps(d, emb, cache, attn, tok, hid, pos, k: int):
    """k drafter steps at the fixed position P: tok, pos [B, 1] (the last accepted token and P), hid
    [B, 1, H] (the target's final-norm hidden state there) -> (drafts [B, k], the last h' [B, 1, H])."""
    rope = d.rope(pos, hid.dtype)
    q_pos = pos - 1  # keys strictly before P: P's own K/V is not computed yet
    out = []
    for _ in range(k):
        x = torch.cat([d.embed_input(tok, emb), hid], dim=-1)  # [B, 1, 2 H]
        g, hid = d(x, rope, q_pos, cache, attn)
        tok = d.next_token(g)  # [B, 1]
        out.append(tok)
    return torch.cat(out, 1), hid


class SpecGenerator(Generator):
    """generate(prompt_ids, max_new_tokens, ignore_eos) -> SpecGeneration, greedy-identical to AR."""

    def __init__(self, model, cache, drafter, depth: int, *, step=None, sampler=argmax_sampler,
                 prefill_chunk: int = 2048, replay: Replay | None = None, graphs: bool = False, compile: bool = False,
                 warmup_iters: int = 2, compile_prefill: bool | str | None = None,
                 prefill_bucket: int | None = None, fused_bookkeeping: bool | None = None):
        # `step` (the AR step) serves forced() only: teacher-forced logits do not depend on speculation.
        # The prompt follows the phases (compiled with them, captured per padded length with them)
        # unless the step or the arguments say otherwise
        if prefill_bucket is None:
            prefill_bucket = getattr(step, "prefill_bucket", PREFILL_BUCKET if graphs else 0)
        if compile_prefill is None:
            compile_prefill = getattr(step, "compile_prefill", prompt_compile_for(compile))
        super().__init__(model, cache, step, prefill_chunk=prefill_chunk, sampler=sampler,
                         compile_prefill=compile_prefill, prefill_bucket=prefill_bucket)
        if not is_int(depth, 1, cache.step_rows - 1):
            raise GenerationError(f"speculative depth must be an integer in [1, {cache.step_rows - 1}] (verify "
                                  f"runs depth + 1 rows, the cache's step_rows is {cache.step_rows}); got {depth!r}")
        rows = getattr(model, "max_verify_rows", None)
        if rows is not None and depth + 1 > rows:
            raise GenerationError(f"speculative depth {depth}: fuse.batch_invariant runs the verify pass's int4 "
                                  f"linears on the tensor-core kernel, at most {rows} rows, so depth <= {rows - 1} "
                                  "(or fuse.batch_invariant=false)")
        if graphs and cache.ring_pos.device.type != "cuda":
            raise RuntimeError("graphs=cuda_graph needs a CUDA device; use graphs=static or eager on a CPU")
        self.drafter, self.k, self.replay = drafter, depth, replay
        self.graphs, self.compile, self.warmup_iters = graphs, compile, warmup_iters
        self.split_timing = False      # bench: events between draft / verify / accept
        self.last_split_s: dict[str, list[float]] = {}
        self._graphs = None
        self._prepared = False
        self.attn = model.step_attention
        if self.attn is None:
            from ..kernels.decode_attention import decode_attention_ref
            self.attn = decode_attention_ref

        dev, B, k = self.device, cache.batch, depth
        L = cache.max_context
        w = model.embed_tokens.weight
        self.L = L
        long = dict(dtype=torch.long, device=dev)
        self.tok = torch.zeros(B, 1, **long)                   # last accepted token, not yet in the cache
        self.pos = torch.zeros(B, 1, **long)                   # its position P
        self.hid = torch.zeros(B, 1, model.config.hidden_size, dtype=w.dtype, device=dev)
        self.drafts = torch.zeros(B, k, **long)
        self.targets = torch.zeros(B, k + 1, **long)
        self.rows_h = torch.zeros(B, k + 1, model.config.hidden_size, dtype=w.dtype, device=dev)
        self.out = torch.zeros(B, L + k + 1, **long)           # emitted ids; a step writes k+1, keeps n+1
        self.count = torch.zeros(B, **long)
        self.n_log = torch.zeros(B, L, **long)                 # drafts accepted per step
        self.step_i = torch.zeros(1, **long)
        self.stat_end = torch.zeros(B, 1, **long)              # steps drafting past it are left out of stats
        self.hits = torch.zeros(B, k, **long)
        self.tries = torch.zeros(B, k, **long)
        self.ar_rows = torch.arange(k + 1, **long)
        self.ar_drafts = torch.arange(1, k + 1, **long)
        if replay is not None:
            self.ref = torch.zeros(B, L + k + 1, **long)       # reference token at each position
            self.ref_end = torch.zeros(B, 1, **long)            # positions >= ref_end have no reference
            self.uniform = torch.ones(L, k, dtype=torch.float32, device=dev)
            self.profile = torch.tensor(extend_profile(replay.profile, k), dtype=torch.float32, device=dev)
            self.mismatch = torch.zeros(B, **long)
        # fuse.draft_loop: the k draft steps of one row in one persistent kernel (nothing to compile)
        loop_kernel = getattr(drafter, "loop_kernel", None)
        self.draft_kernel = loop_kernel(drafter, w, cache) if loop_kernel is not None and B == 1 else None
        self._draft_fn = self._draft_loop
        self._verify_fn = self._verify_rows
        if self.draft_kernel is not None:
            self._draft_fn = functools.partial(self.draft_kernel, k=k)
        elif compile:
            # dynamic=False: one specialisation per depth; the cache writes are traced like StaticStep's
            self._draft_fn = compile_step(self._draft_loop)
        if compile:
            self._verify_fn = compile_step(self._verify_rows)
        # the accept bookkeeping and replay's drafts: one kernel each (kernels/spec_accept.py) on CUDA and
        # under TRITON_INTERPRET, else their torch twins below
        from ..kernels.gemv import _INTERPRET
        if fused_bookkeeping is None:
            fused_bookkeeping = dev.type == "cuda" or _INTERPRET
        self.fused_bookkeeping = fused_bookkeeping
        self._accept, self._set_replay_drafts = self._accept_torch, self._replay_drafts_torch
        if fused_bookkeeping:  # the launches bound to this generator's buffers (all updated in place)
            from ..kernels.spec_accept import accept, replay_drafts
            replay_bufs = (self.ref, self.ref_end, self.mismatch) if replay is not None else ()
            self._accept = functools.partial(accept, self.targets, self.drafts, self.rows_h, self.out, self.count,
                                             self.tok, self.hid, self.pos, self.hits, self.tries, self.n_log,
                                             self.step_i, self.stat_end, *replay_bufs)
            if replay is not None:
                self._set_replay_drafts = functools.partial(replay_drafts, self.uniform, self.profile, self.step_i,
                                                            self.pos, self.ref, self.drafts, model.config.vocab_size)

    # ---- the three phases (graph-capturable: static buffers in, static buffers out) -------------
    def _draft_loop(self, tok, hid, pos):
        """tok, pos [B, 1], hid [B, 1, H] -> drafts [B, k]: k drafter steps at the fixed position."""
        return draft_steps(self.drafter, self.model.embed_tokens.weight, self.cache, self.attn, tok, hid, pos,
                           self.k)[0]

    def _replay_drafts_torch(self):
        """self.drafts <- the reference's tokens where the profile accepts, wrong after a miss."""
        u = self.uniform.index_select(0, self.step_i)                # [1, k]
        ok = (u < self.profile).long().cumprod(1).bool()             # [1, k]
        idx = (self.pos + self.ar_drafts).clamp(max=self.ref.shape[1] - 1)
        want = self.ref.gather(1, idx)                               # [B, k]
        wrong = (want + 1) % self.model.config.vocab_size
        self.drafts.copy_(torch.where(ok, want, wrong))

    def _draft(self):
        drafts = self._draft_fn(self.tok, self.hid, self.pos)
        if self.replay is not None:  # the drafter ran (its cost counted); the trace decides the drafts
            self._set_replay_drafts()
        else:
            self.drafts.copy_(drafts)

    def _verify_rows(self, tok, drafts, pos):
        """[tok, d1..dk] at P..P+k through the target's static step -> argmax per row, hidden."""
        ids = torch.cat([tok, drafts], 1)                            # [B, k+1]
        # rows past the cache (only in the last step of a request; their tokens are cut) write slot L-1
        rows = (pos + self.ar_rows).clamp(max=self.L - 1)
        hidden = self.model.step(ids, rows, self.cache)              # [B, k+1, H]
        B, T, H = hidden.shape
        t, _ = self.sampler(self.model, hidden.reshape(B * T, 1, H))  # rows as a batch: [B*T, 1]
        return t.view(B, T), hidden

    def _verify(self):
        t, hidden = self._verify_fn(self.tok, self.drafts, self.pos)
        self.targets.copy_(t)
        self.rows_h.copy_(hidden)

    def _accept_torch(self):
        k, t, d = self.k, self.targets, self.drafts
        match = (d == t[:, :k]).long().cumprod(1)                    # [B, k]
        n = match.sum(1)                                             # drafts accepted [B]
        B = t.shape[0]
        self.out.scatter_(1, self.count[:, None] + self.ar_rows, t)  # t_0..t_k; t_0..t_n are kept
        # a last step drafting past the request's end (clamped rows, no reference) is not counted
        inside = (self.pos + k < self.stat_end).long()               # [B, 1]
        if self.replay is not None:
            # emitted t_j at P+1+j should equal the reference there (bf16 numerics can drift)
            at = self.pos + 1 + self.ar_rows
            ref = self.ref.gather(1, at.clamp(max=self.ref.shape[1] - 1))
            bad = (t != ref) & (self.ar_rows <= n[:, None]) & (at < self.ref_end)
            self.mismatch.add_(bad.long().sum(1))
        self.count.add_(n + 1)
        self.tok.copy_(t.gather(1, n[:, None]))
        self.hid.copy_(self.rows_h.gather(1, n[:, None, None].expand(B, 1, self.rows_h.shape[2])))
        self.pos.add_(n[:, None] + 1)
        self.hits.add_(match * inside)
        self.tries[:, :1].add_(inside)
        self.tries[:, 1:].add_(match[:, :-1] * inside)
        self.n_log.index_copy_(1, self.step_i, n[:, None])
        self.step_i.add_(1)

    # ---- capture ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self):
        """CUDA: warm up (compile, autotune) on a side stream, then capture draft / verify / accept
        as three graphs sharing one memory pool (replayed in capture order). CPU: nothing."""
        if self._prepared:
            return
        if not self.graphs:
            self._prepared = True
            return
        def phases():
            self._reset_state(0)
            self._draft()
            self._verify()
            self._accept()

        warm_on_side_stream(phases, self.warmup_iters)
        self._reset_state(0)
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for phase in (self._draft, self._verify, self._accept):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                phase()
            graphs.append(g)
        self._graphs = graphs
        self._prepared = True
        self.cache.reset()  # the warm-up wrote K/V at dummy positions 0..k

    def _reset_state(self, pos: int):
        self.pos.fill_(pos)
        self.count.zero_()
        self.step_i.zero_()
        self.hits.zero_()
        self.tries.zero_()
        if self.replay is not None:
            self.mismatch.zero_()

    def _phases(self):
        if self._graphs is not None:
            return [g.replay for g in self._graphs]
        return [self._draft, self._verify, self._accept]

    # ---- replay references -----------------------------------------------------------------------
    def prime(self, prompt_ids, max_new_tokens: int):
        """Record the reference trace replay drafts follow: this generator's own greedy output with
        every draft rejected, so the trace carries the verify pass's numerics at this depth (bf16
        GEMMs at k+1 rows round differently from one row)."""
        if self.replay is None:
            raise GenerationError("prime() is for spec=replay")
        key = Replay.key(prompt_ids)
        saved = self.profile.clone()
        self.profile.zero_()
        try:
            g = self._generate(prompt_ids, max_new_tokens, True, reference=[])
        finally:
            self.profile.copy_(saved)
        self.replay.references[key] = g.tokens
        return g.tokens

    @torch.inference_mode()
    def forced_verify(self, prompt_ids, forced_tokens) -> torch.Tensor:
        """Teacher-forced logits through the verify pass: forced_tokens go in k + 1 at a time, every
        draft right, so each row comes from the k+1-row pass that verifies drafts (its kernels, tiles,
        compiled function). -> fp32 logits [N, V] that predicted each forced token, row 0 from
        prefill: the rows of Generator.forced, so the two paths compare position by position."""
        ids = self._prompt(prompt_ids)
        forced = torch.as_tensor(forced_tokens, dtype=torch.long, device=self.device).reshape(1, -1)
        T, N, k = ids.shape[1], forced.shape[1], self.k
        self._check_room(T, N + k)  # the last pass may run past the forced tokens (padding rows)
        self.prepare()
        h = self.prefill(ids)
        _, logits = self.sampler(self.model, h)
        rows = [logits[0].float().clone()]
        padded = torch.cat([forced, forced[:, -1:].expand(1, k)], 1)
        for i in range(0, N - 1, k + 1):
            pos = torch.full((1, 1), T + i, dtype=torch.long, device=self.device)
            _, hidden = self._verify_fn(padded[:, i:i + 1], padded[:, i + 1:i + 1 + k], pos)
            lg = self.model.compute_logits(hidden[0]).float()  # [k + 1, V]
            rows.extend(lg[: min(k + 1, N - 1 - i)])
        return torch.stack(rows)

    def set_profile(self, profile):
        """Swap the acceptance profile in place (captured graphs read the buffer)."""
        if self.replay is None:
            raise GenerationError("set_profile() is for spec=replay")
        self.replay.profile = resolve_profile(profile)
        self.profile.copy_(torch.tensor(extend_profile(self.replay.profile, self.k), dtype=torch.float32))

    # ---- decode ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, ignore_eos: bool = True) -> SpecGeneration:
        reference = None
        if self.replay is not None:
            key = Replay.key(prompt_ids)
            reference = self.replay.references.get(key)
            if reference is None or len(reference) < max_new_tokens:
                warnings.warn("spec=replay: no reference trace for this prompt; priming it inside this request "
                              "(a whole greedy pass, counted in its time): call prime() before timing", stacklevel=2)
                reference = self.prime(prompt_ids, max_new_tokens)
        return self._generate(prompt_ids, max_new_tokens, ignore_eos, reference)

    @torch.inference_mode()
    def _generate(self, prompt_ids, max_new_tokens, ignore_eos, reference):
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = self._prompt(prompt_ids)
        T = ids.shape[1]
        self._check_room(T, max_new_tokens)
        self.prepare()
        k = self.k
        if reference is not None:
            self._load_reference(T, reference, self.replay.draw_seed(ids))
        clock = StepClock(self.device)
        clock.mark()
        h = self.prefill(ids)
        first, _ = self.sampler(self.model, h)
        self.tok.copy_(first)
        self.hid.copy_(h)
        self._reset_state(T)
        self.stat_end.fill_(T + max_new_tokens)
        clock.mark()
        phases = self._phases()
        split = self.split_timing
        remaining = max_new_tokens - 1
        eos = frozenset() if ignore_eos else self.eos
        first_end = bool(eos) and int(first[0, 0]) in eos  # (a host sync, once a request, where ends count)
        steps, eos_at = self._decode(phases, clock, split, 0 if first_end else remaining, eos)
        eos_at = 0 if first_end else eos_at
        done = int(self.count.min())
        times = clock.intervals()
        ttft, rest = times[0], times[1:]
        if split:
            d, v, a = rest[0::3], rest[1::3], rest[2::3]
            self.last_split_s = {"draft": d, "verify": v, "accept": a}
            rest = [x + y + z for x, y, z in zip(d, v, a)]
        tokens = [int(first[0, 0])] + self.out[0, :min(done, remaining)].tolist()
        tokens = tokens[:max_new_tokens]
        if eos_at is not None:
            tokens = tokens[:eos_at + 1]
        accepted = self.n_log[0, :steps].tolist()
        per_step, kept, step_s, acc = [], 0, [], []
        for n, s in zip(accepted, rest):  # cut the steps past the last kept token
            if kept >= len(tokens) - 1:
                break
            e = min(n + 1, len(tokens) - 1 - kept)
            per_step.append(e)
            step_s.append(s)
            acc.append(n)
            kept += e
        return SpecGeneration(
            tokens=tokens, prompt_len=T, ttft_s=ttft, step_s=step_s, tokens_per_step=per_step, depth=k,
            accept_hits=self.hits[0].tolist(), accept_tries=self.tries[0].tolist(), accepted=acc,
            replay_mismatch=int(self.mismatch[0]) if self.replay is not None else 0)

    def _decode(self, phases, clock, split: bool, remaining: int, eos: frozenset) -> tuple[int, int | None]:
        """Run steps until `remaining` tokens are out or an end id (of `eos`) is: -> (the steps run, the first end
        id's index among the request's tokens, the prompt's token being 0, or None). Each step's
        accepted counts (`n_log`, a slot a step) and the ids it may have kept are copied on a side stream
        (engine/eos_watch.py), each slot final once its step is done, and read once landed. A step is launched
        while the tokens known plus k + 1 a step in flight fall short of `remaining` and at most `eos_lag` steps
        are in flight unread; otherwise the oldest copy is waited for, which leaves the later steps queued (no
        drain but the last). An end id stops the launches, at most `eos_lag` steps past it. ReadAtOnce (lag 0, a
        CPU) reads each step as it is launched."""
        k, lag = self.k, self.eos_lag
        copies = copies_for(self.device, lag, (lag + 2) * (k + 2))  # a row: the unread steps' counts, their ids
        out, n_log = self.out[0], self.n_log[0]
        pending = deque()  # (tokens known, steps known, steps run) when each copy was put, its ticket
        known = seen = steps = 0  # tokens known out, the steps they came from, the steps run
        end = None
        while known < remaining and end is None:
            if known + len(pending) * (k + 1) < remaining and len(pending) <= lag:
                for ph in phases:
                    ph()
                    if split:
                        clock.mark()
                if not split:
                    clock.mark()
                steps += 1
                hi = min(known + (steps - seen) * (k + 1), out.numel())  # as far as the unread steps may keep
                pending.append((known, seen, steps, copies.put(n_log[seen:steps], out[known:hi])))
                if not copies.landed(pending[0][3]) and len(pending) <= lag:
                    continue
            lo, first, last, ticket = pending.popleft()
            row = copies.read(ticket).tolist()
            known, seen = lo + sum(row[:last - first]) + last - first, last
            # the copies are read in order and each covers the ids from the count known at its put: the first end
            # id seen is the first of all
            hit = next((j for j, t in enumerate(row[last - first:last - first + known - lo]) if t in eos), None)
            end = None if hit is None else lo + hit + 1
        copies.close()
        return steps, end

    def _load_reference(self, T: int, reference: list[int], seed: int):
        """Reference token at each absolute position: ref[T + i] = reference[i]; the acceptance draws from
        `seed` (Replay.draw_seed)."""
        ref = torch.zeros(self.ref.shape, dtype=torch.long)
        n = min(len(reference), self.ref.shape[1] - T)
        ref[:, T:T + n] = torch.as_tensor(reference[:n], dtype=torch.long)
        self.ref.copy_(ref)
        self.ref_end.fill_(T + n)
        g = torch.Generator().manual_seed(seed)
        self.uniform.copy_(torch.rand(self.uniform.shape, generator=g))

    def describe(self) -> dict:
        d = {"depth": self.k, "centroid_top_k": self.drafter.top_k, "drafter": self.drafter.config.name,
             "graphs": self.graphs, "compile": self.compile}
        if self.replay is not None:
            d.update(self.replay.describe())
        return d
