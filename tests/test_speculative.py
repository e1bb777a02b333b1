"""Speculative decoding on the tiny target + tiny drafter (fp32, CPU): token-for-token equal to the
plain AR decode for k = 1..8 (and the 16-row limit, k = 15) with a window shorter than the context,
so rejected rows land in wrapped ring buffers; rollback leaves the cache equivalent to one that
never saw the rejected rows; replay's acceptance follows its profile.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY, Launches
from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator, GenerationError
from fastgemma.engine.speculative import (
    FRONTIER, PROFILES, Replay, SpecGeneration, SpecGenerator, expected_tokens_per_step,
)
from fastgemma.engine.steps import EagerStep
from fastgemma.kernels import decode_attention as da
from fastgemma.kernels.decode_attention import decode_attention_ref
from fastgemma.metrics.acceptance import acceptance_summary
from fastgemma.model.drafter import synthetic_drafter
from fastgemma.weights.synthetic import synthetic_model

PROMPT = list(range(3, 23))  # 20 tokens; + 28 new = 48 positions, 3x the native window (16)
NEW = 28
MAX_CTX = 64


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # the CPU is shared; tiny matrices gain nothing from threads
    m = synthetic_model(TINY, dtype=torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    return m


@pytest.fixture(scope="module")
def drafter():
    return synthetic_drafter(TINY, dtype=torch.float32, seed=0)


_AR = {}


def ar_tokens(model, window, n=NEW, prompt=tuple(PROMPT)):
    key = (window, n, prompt)
    if key not in _AR:
        cache = KVCache(TINY, 1, MAX_CTX if n <= NEW else 512, window=window, dtype=torch.float32)
        _AR[key] = Generator(model, cache, EagerStep(model, cache)).generate(list(prompt), n).tokens
    return _AR[key]


def spec(model, drafter, k, window=None, replay=None, max_ctx=len(PROMPT) + NEW):
    """max_ctx = prompt + new exactly: a verify near the end has rows past the cache (clamped)."""
    cache = KVCache(TINY, 1, max_ctx, window=window, dtype=torch.float32)
    return SpecGenerator(model, cache, drafter, k, replay=replay)


@pytest.mark.parametrize("k", range(1, 9))
def test_mtp_equals_ar(model, drafter, k):
    """The untrained drafter's drafts are almost all rejected: every step rolls back k rows."""
    g = spec(model, drafter, k).generate(PROMPT, NEW)
    assert g.tokens == ar_tokens(model, None)
    assert sum(g.tokens_per_step) == NEW - 1 and len(g.step_s) == len(g.tokens_per_step)
    assert len(g.accept_hits) == k and 0 < g.accept_tries[0] <= len(g.accepted)


def leading_draws(gen, steps, profile):
    """Drafts each step's replay draws accept: the leading run of (u < p) over the depth."""
    p = torch.tensor(gen.profile.tolist())
    return (gen.uniform[:steps] < p).long().cumprod(1).sum(1).tolist()


@pytest.mark.parametrize("k", [*range(1, 9), 15])
def test_replay_equals_ar(model, drafter, k):
    """Drafts accepted and rejected at every depth, window override 12 < context; what the verify
    pass accepts is exactly what the replay draws said (nothing accepted by accident)."""
    gen = spec(model, drafter, k, window=12, replay=Replay("frontier", seed=k))
    ar = ar_tokens(model, 12)
    if k == 15:
        assert gen.prime(PROMPT, NEW) == ar  # the reference trace, from the verify pass itself
    else:
        gen.replay.references[tuple(PROMPT)] = ar  # fp32: the AR trace is the same
    g = gen.generate(PROMPT, NEW)
    assert g.tokens == ar
    assert g.replay_mismatch == 0
    assert sum(g.tokens_per_step) == NEW - 1
    assert g.accepted[:-1] == leading_draws(gen, len(g.accepted), FRONTIER)[:-1]
    if k > 1:
        assert max(g.tokens_per_step) > 2, g.tokens_per_step


def test_full_acceptance_emits_k_plus_1(model, drafter):
    k = 5
    gen = spec(model, drafter, k, replay=Replay([1.0]))
    gen.prime(PROMPT, NEW)
    g = gen.generate(PROMPT, NEW)
    assert g.tokens == ar_tokens(model, None)
    assert g.tokens_per_step[:-1] == [k + 1] * (len(g.tokens_per_step) - 1)
    assert g.accepted[:-1] == [k] * (len(g.accepted) - 1)
    assert g.accept_hits == g.accept_tries  # every counted step accepted every draft


def test_eos_stops_like_ar(model, drafter):
    ref = ar_tokens(model, None)
    eos = ref[9]
    cut = ref[: ref.index(eos) + 1]
    cache = KVCache(TINY, 1, MAX_CTX, dtype=torch.float32)
    ar = Generator(model, cache, EagerStep(model, cache))
    ar.eos = {eos}
    assert ar.generate(PROMPT, NEW, ignore_eos=False).tokens == cut
    gen = spec(model, drafter, 3, replay=Replay("frontier"))
    gen.prime(PROMPT, NEW)
    gen.eos = {eos}
    g = gen.generate(PROMPT, NEW, ignore_eos=False)
    assert g.tokens == cut and sum(g.tokens_per_step) == len(cut) - 1


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_steps_read_from_side_copies_stop_at_the_end_and_at_the_limit(model, drafter, monkeypatch, lag):
    """The steps' counts and ids read lag steps late at most (a copier whose copies never land on their own, the
    side stream's worst case): the end's tokens, at most `lag` steps past it; no end: not one step more than the
    request needs."""
    import fastgemma.engine.speculative as speculative
    from fastgemma.engine.eos_watch import ReadAtOnce
    from test_eos_watch import NeverLanded

    copiers = []
    monkeypatch.setattr(speculative, "copies_for",
                        lambda device, lag, width=1: copiers.append(NeverLanded() if lag else ReadAtOnce())
                        or copiers[-1])
    ref = ar_tokens(model, None)
    eos = ref[9]
    cut = ref[: ref.index(eos) + 1]
    gen = spec(model, drafter, 3, replay=Replay("frontier"))
    gen.set_eos_lag(lag)
    gen.prime(PROMPT, NEW)
    runs = []
    decode = gen._decode
    gen._decode = lambda *a: runs.append(decode(*a)) or runs[-1]
    free = gen.generate(PROMPT, NEW)
    assert free.tokens == ref and runs[-1] == (len(free.tokens_per_step), None)
    gen.eos = {eos}
    g = gen.generate(PROMPT, NEW, ignore_eos=False)
    assert g.tokens == cut and sum(g.tokens_per_step) == len(cut) - 1
    assert len(g.tokens_per_step) <= runs[-1][0] <= len(g.tokens_per_step) + lag and runs[-1][1] == len(cut) - 1
    if lag:
        assert max(c.most_unread for c in copiers if isinstance(c, NeverLanded)) <= lag + 1


@torch.no_grad()
def test_rollback_is_free(model, drafter):
    """k = 15 (16 verify rows, the cache's step_rows) rejected rows before every step: the target's
    hidden and the drafter's output equal those of a cache that never saw a rejected row, across
    several laps of the window-12 ring (28 slots)."""
    k, W, T = 15, 12, 30
    caches = [KVCache(TINY, 1, 128, window=W, dtype=torch.float32) for _ in range(2)]
    ids = torch.tensor([PROMPT + PROMPT[:T - len(PROMPT)]])
    hs = [Generator(model, c).prefill(ids) for c in caches]
    tok = model.compute_logits(hs[0]).argmax(-1)
    junk = torch.randint(5, TINY.vocab_size, (1, k), generator=torch.Generator().manual_seed(0))
    emb = model.embed_tokens.weight
    for P in range(T, T + 40):
        pos = torch.tensor([[P]])
        model.step(torch.cat([tok, junk], 1), P + torch.arange(k + 1)[None], caches[0])  # all rejected
        outs = []
        for c, h in zip(caches, hs):
            x = torch.cat([drafter.embed_input(tok, emb), h], -1)
            g, hp = drafter(x, drafter.rope(pos, h.dtype), pos - 1, c, decode_attention_ref)
            outs.append((g, hp, model.step(tok, pos, c)))
        for a, b in zip(*outs):
            assert (a - b).abs().max().item() < 1e-5, f"position {P}"
        hs = [outs[0][2], outs[1][2]]
        tok = model.compute_logits(hs[1]).argmax(-1)
        junk = (junk * 7 + 3) % TINY.vocab_size


@torch.no_grad()
def test_replay_draws_follow_the_prompt_not_its_trace(model, drafter):
    """Two references for one prompt (numerics that moved the greedy trace) draw the same acceptances; another
    prompt or another replay seed draws others."""
    gen = spec(model, drafter, 3, replay=Replay("frontier"))
    draws = []
    for prompt, trace, seed in (([5, 6, 7], [9] * 20, 0), ([5, 6, 7], [11, 12] * 10, 0), ([5, 6, 8], [9] * 20, 0),
                                ([5, 6, 7], [9] * 20, 1)):
        gen.replay.seed = seed
        gen._load_reference(3, trace, gen.replay.draw_seed(torch.tensor([prompt])))
        draws.append(gen.uniform.clone())
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[3])
    assert gen.replay.draw_seed([5, 6, 7]) == gen.replay.draw_seed(torch.tensor([[5, 6, 7]]))  # any form of the ids


def test_replay_acceptance_follows_the_profile(model, drafter):
    """The replay draws and the accept bookkeeping over ~4,000 steps against a target that always
    continues the reference (draft and accept phases only; the model-level tests above show the
    verify pass accepts exactly the drawn drafts): conditional rates within 4 sigma of the profile."""
    k, profile = 4, [0.8, 0.65, 0.5, 0.9]
    gens = []
    for s in range(2):
        gen = spec(model, drafter, k, replay=Replay(profile, seed=s), max_ctx=4096)
        n_new = 4096 - 8 - k - 2
        trace = torch.randint(5, TINY.vocab_size, (n_new,), generator=torch.Generator().manual_seed(s)).tolist()
        gen._load_reference(8, trace, gen.replay.draw_seed(list(range(8))))
        gen._reset_state(8)
        gen.stat_end.fill_(8 + n_new)
        while int(gen.pos) + 2 * k + 2 < 8 + n_new and int(gen.step_i) < 2000:
            gen._set_replay_drafts()
            at = gen.pos + 1 + gen.ar_rows
            gen.targets.copy_(gen.ref.gather(1, at))  # the target continues the reference
            gen._accept()
        steps = int(gen.step_i)
        assert gen.n_log[0, :steps].tolist() == leading_draws(gen, steps, profile)
        assert int(gen.mismatch) == 0
        gens.append(SpecGeneration(tokens=[], prompt_len=8, ttft_s=0.0, depth=k, accept_hits=gen.hits[0].tolist(),
                                   accept_tries=gen.tries[0].tolist(), accepted=gen.n_log[0, :steps].tolist()))
    summary = acceptance_summary(gens)
    hits = [sum(g.accept_hits[j] for g in gens) for j in range(k)]
    tries = [sum(g.accept_tries[j] for g in gens) for j in range(k)]
    for j, (p, h, t) in enumerate(zip(profile, hits, tries)):
        sigma = math.sqrt(p * (1 - p) / t)
        print(f"position {j + 1}: {h}/{t} = {h / t:.3f} vs {p} (sigma {sigma:.3f})")
        assert abs(h / t - p) < 4 * sigma
        assert summary["accept_by_pos"][j] == round(h / t, 4)
    mean = 1 + summary["accept_mean"]
    want = expected_tokens_per_step(profile, k)
    print(f"tokens per step {mean:.3f} vs expected {want:.3f}")
    assert abs(mean - want) < 0.05


def test_profiles_hit_the_published_figures():
    assert expected_tokens_per_step(FRONTIER, 7) == pytest.approx(3.85, abs=0.005)
    assert expected_tokens_per_step(PROFILES["stock"], 6) == pytest.approx(3.34, abs=0.005)
    assert expected_tokens_per_step(PROFILES["chat"], 7) == pytest.approx(3.57, abs=0.005)
    with pytest.raises(ValueError, match="unknown acceptance profile"):
        Replay("nope")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        Replay([0.5, 1.5])


def test_bad_depth_is_refused(model, drafter):
    for k in (0, 16, True):
        with pytest.raises(GenerationError, match="depth"):
            spec(model, drafter, k)


def test_spec_group_builds_through_the_factory():
    """spec=replay from the real config: the builder hands the cache window and the static step to
    the speculative generator, and its tokens equal the reference engine's."""
    from fgcli_helpers import TINY as TINY_CLI, compose_cfg
    from hydra.core.hydra_config import HydraConfig

    from fastgemma.build import build_context

    cfg = compose_cfg([*TINY_CLI, "spec=replay", "spec.depth=3", "graphs=static", "window=w128"])
    HydraConfig.instance().set_config(cfg)
    ctx = build_context(cfg, dict(cfg.hydra.runtime.choices), "/tmp")
    eng = ctx.factory.engine(64)
    assert eng.cache.window == 128 and eng.generator.k == 3
    assert ctx.factory.parts.spec.describe()["expected_tokens_per_step"] == pytest.approx(2.72, abs=0.01)
    with pytest.warns(UserWarning, match="priming"):
        g = eng.generator.generate(PROMPT, 20)
    m = ctx.factory.model
    cache = KVCache(m.config, 1, 64, window=128, dtype=m.embed_tokens.weight.dtype)
    assert g.tokens == Generator(m, cache, EagerStep(m, cache)).generate(PROMPT, 20).tokens
    forced = eng.generator.forced(PROMPT, g.tokens)  # teacher-forced logits still come from the AR step
    assert forced.argmax(-1).tolist() == g.tokens


@pytest.fixture(scope="module")
def fused_pair():
    """fuse=layers on a copy of the tiny target (torch twins of the fused GEMVs) and its drafter."""
    from fastgemma.transforms.fuse_layers import FuseLayers

    m = synthetic_model(TINY, dtype=torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    FuseLayers(backend="torch").apply(m)
    return m, m.fuse_drafter(synthetic_drafter(TINY, dtype=torch.float32, seed=0))


@pytest.mark.parametrize("backend", ["torch", "triton", "triton+qkv", "triton+attn_qkv", "triton+attn_qkv+dmerge",
                                     "torch+tail", "triton+tail"])
def test_fused_drafter_step_matches_the_drafter(model, drafter, backend, wide_tiles, monkeypatch):
    """fuse=layers' drafter step (the twins, and the Triton kernels in the interpreter, also with the
    q kernel and the attention's PDL option, or the q norm + RoPE inside the attention's split kernel (its
    splits merged there too with fuse.draft_merge, the target's step keeping its combine), or the last update +
    final norm in kernels/residual_norm.py: fuse.tail_norm) gives the unfused drafter's final-norm state and
    projected hidden state on one row, over a window shorter than the context; its merged gate|up also serves
    the unfused path (batches) unchanged."""
    from fastgemma.transforms.fuse_layers import FuseLayers

    m = synthetic_model(TINY, dtype=torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    qkv, attn_qkv, tail = backend == "triton+qkv", "+attn_qkv" in backend, backend.endswith("+tail")
    dmerge = backend.endswith("+dmerge")
    FuseLayers(backend=backend.split("+")[0], attn_pdl=qkv, qkv_kernel=qkv, attn_merge=qkv, attn_qkv=attn_qkv,
               tail_norm=tail, draft_merge=dmerge).apply(m)
    fused = m.fuse_drafter(synthetic_drafter(TINY, dtype=torch.float32, seed=0))
    assert fused.fused_forward.keywords["attn_merge"] == (qkv or dmerge)
    assert m.fused_decode.keywords["attn_merge"] == qkv  # the target's step: fuse.attn_merge's alone
    assert fused.fused_forward is not None and hasattr(fused.model.layers[0].mlp, "gate_up_proj")
    assert fused.fused_forward.keywords["qkv_kernel"] == qkv and fused.fused_forward.keywords["attn_pdl"] == qkv
    assert fused.fused_forward.keywords["attn_qkv"] == attn_qkv and fused.fused_forward.keywords["tail_norm"] == tail
    assert fused.fused_forward.keywords["triton_ops"] == backend.startswith("triton")
    cache = KVCache(TINY, 1, MAX_CTX, window=12, dtype=torch.float32)
    ids = torch.tensor([PROMPT + [7, 9, 11, 13]])
    h = Generator(model, cache, prefill_chunk=16).prefill(ids)
    pos = torch.tensor([[ids.shape[1]]])
    rope = drafter.rope(pos, h.dtype)
    tok = torch.tensor([[42]])
    combines = Launches(da._combine_kernel)  # the attention's combine launches: none where its splits merge
    monkeypatch.setattr(da, "_combine_kernel", combines)
    for _ in range(3):  # draft steps, each state fed to the next
        x = torch.cat([drafter.embed_input(tok, model.embed_tokens.weight), h], -1)
        g_ref, h_ref = drafter(x, rope, pos - 1, cache, decode_attention_ref)
        combines.n = 0
        g, hf = fused(x, rope, pos - 1, cache, decode_attention_ref)
        if attn_qkv:
            assert (combines.n == 0) == dmerge, combines.n
        assert (g - g_ref).abs().max().item() < 1e-4 and (hf - h_ref).abs().max().item() < 1e-4
        fused_forward, fused.fused_forward = fused.fused_forward, None
        g2, h2 = fused(x, rope, pos - 1, cache, decode_attention_ref)  # merged gate|up, unfused step
        fused.fused_forward = fused_forward
        assert (g2 - g_ref).abs().max().item() < 1e-4 and (h2 - h_ref).abs().max().item() < 1e-4
        tok, h = drafter.next_token(g_ref), h_ref


@pytest.mark.parametrize("k", [1, 4, 7])
def test_fused_spec_equals_ar(model, fused_pair, k):
    """fuse=layers throughout (one-row AR step and drafter fused, the k+1-row verify unfused): the
    replayed speculative tokens equal plain AR's, window 12 < context."""
    m, d = fused_pair
    cache = KVCache(TINY, 1, len(PROMPT) + NEW, window=12, dtype=torch.float32)
    g = SpecGenerator(m, cache, d, k, replay=Replay("frontier", seed=k)).generate(PROMPT, NEW)
    assert g.tokens == ar_tokens(model, 12)


def test_fuse_drafter_refuses_non_dense_layers():
    from fastgemma.transforms.fused_steps import fuse_drafter
    from fastgemma.transforms.quant import Int4Quant

    d = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    Int4Quant(group_size=32, backend="torch").apply(d.model)
    with pytest.raises(ValueError, match="drafter layers.0.self_attn.q_proj is Int4Linear"):
        fuse_drafter(d, gemv=None, gemv4=None)


def test_spec_with_fuse_layers_fuses_the_drafter_through_the_factory():
    """fuse=layers + spec=replay from the config: the drafter is built fused (recorded), and the
    speculative tokens equal the fused engine's own AR tokens."""
    from fgcli_helpers import TINY as TINY_CLI, compose_cfg
    from hydra.core.hydra_config import HydraConfig

    from fastgemma.build import build_context

    cfg = compose_cfg([*TINY_CLI, "spec=replay", "spec.depth=3", "graphs=static", "fuse=layers", "fuse.backend=torch"])
    HydraConfig.instance().set_config(cfg)
    ctx = build_context(cfg, dict(cfg.hydra.runtime.choices), "/tmp")
    eng = ctx.factory.engine(64)
    assert eng.generator.drafter.fused_forward is not None
    assert ctx.factory.parts.spec.describe()["drafter_fused"] is True
    with pytest.warns(UserWarning, match="priming"):
        g = eng.generator.generate(PROMPT, 20)
    m = ctx.factory.model
    cache = KVCache(m.config, 1, 64, dtype=m.embed_tokens.weight.dtype)
    assert g.tokens == Generator(m, cache, EagerStep(m, cache)).generate(PROMPT, 20).tokens


def test_fused_spec_with_the_drafter_head_kernel_equals_ar(model, wide_tiles):
    """fuse=layers (the GEMVs' twins) with kernels/draft_head.py as the drafter's head (the Triton op
    in the interpreter, what `model.draft_head` is on a GPU): the drafts come from the kernel, the
    tokens still equal AR's. The fused drafter takes `model.draft_head` by default (the twin on the
    torch backend), torch's topk path with head=None."""
    from fastgemma.kernels.draft_head import draft_head_op, draft_head_ref
    from fastgemma.transforms.fuse_layers import FuseLayers

    m = synthetic_model(TINY, dtype=torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    FuseLayers(backend="torch").apply(m)
    assert m.draft_head is draft_head_ref
    assert m.fuse_drafter(synthetic_drafter(TINY, dtype=torch.float32, seed=0)).head_fn is draft_head_ref
    assert m.fuse_drafter(synthetic_drafter(TINY, dtype=torch.float32, seed=0), head=None).head_fn is None
    d = m.fuse_drafter(synthetic_drafter(TINY, dtype=torch.float32, seed=0), head=draft_head_op, pdl=True)
    assert d.head_fn.func is draft_head_op and d.head_fn.keywords == {"pdl": True}  # fuse.pdl: the head's too
    d = m.fuse_drafter(synthetic_drafter(TINY, dtype=torch.float32, seed=0), head=draft_head_op)
    assert d.head_fn is draft_head_op
    # 12 new tokens (the prompt already wraps the window): each draft step runs the kernel's two
    # launches in the interpreter, for the reference trace and again for the tokens
    cache = KVCache(TINY, 1, len(PROMPT) + 12, window=12, dtype=torch.float32)
    g = SpecGenerator(m, cache, d, 4, replay=Replay("frontier", seed=4)).generate(PROMPT, 12)
    assert g.tokens == ar_tokens(model, 12, 12)


def test_a_fused_verify_pass_without_batch_invariant_is_pointed_at_it(caplog):
    """spec on fuse=layers' verify pass without fuse.batch_invariant: the user is told its tokens may leave the AR
    step's and which switch makes them equal; not with the switch on, not past its 8 rows, not without the fused
    pass."""
    import logging

    from fastgemma.engine.steps import StaticStep
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.spec import MtpSpec, invariant_hint

    plain = synthetic_model(TINY, "cpu", torch.float32, seed=0)
    assert invariant_hint(plain, 7) is None  # no fused verify pass
    fused = synthetic_model(TINY, "cpu", torch.float32, seed=0)
    FuseLayers(backend="torch").apply(fused)
    hint = invariant_hint(fused, 7)
    assert hint and "fuse.batch_invariant=true" in hint and "8 rows" in hint
    assert invariant_hint(fused, 8) is None  # 9 rows: the invariant pass cannot take them
    inv = synthetic_model(TINY, "cpu", torch.float32, seed=0)
    FuseLayers(backend="torch", qkv_kernel=True, batch_invariant=True).apply(inv)
    assert inv.batch_invariant and invariant_hint(inv, 7) is None
    # the spec group says it once, when it builds the generator
    cache = KVCache(TINY, 1, 64, device="cpu", dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="fastgemma"):
        MtpSpec(depth=3, drafter_seed=1).make_generator(fused, cache, StaticStep(fused, cache), None, 64)
    assert [r.getMessage() for r in caplog.records].count(invariant_hint(fused, 3)) == 1
