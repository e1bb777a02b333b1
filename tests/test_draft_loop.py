"""kernels/draft_loop.py, the draft loop in one persistent kernel, in the interpreter (one program:
the same tiles and sums as P programs): its drafts and last hidden state against the drafter's own
step (tiny target + tiny drafter, fp32) for k = 1..8, over a wrapped sliding window and a full
layer; several key splits; the engine's speculative tokens with it equal AR's; refusals."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator
from fastgemma.engine.speculative import Replay, SpecGenerator, draft_steps
from fastgemma.kernels.decode_attention import decode_attention_ref
from fastgemma.kernels.draft_loop import DraftLoop, DraftLoopError
from fastgemma.model.drafter import synthetic_drafter
from fastgemma.transforms.fuse import MergeProjections
from fastgemma.weights.synthetic import synthetic_model

PROMPT = list(range(3, 27))  # 24 tokens: the window (12) wraps


@pytest.fixture(scope="module")
def target():
    m = synthetic_model(TINY, dtype=torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    return m


@pytest.fixture(scope="module")
def drafter():
    d = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    MergeProjections(qkv=False).apply(d.model)
    return d


@pytest.fixture(scope="module")
def primed(target):
    cache = KVCache(TINY, 1, 64, window=12, dtype=torch.float32)
    h = Generator(target, cache, prefill_chunk=16).prefill(torch.tensor([PROMPT]))
    return cache, h, torch.tensor([[len(PROMPT)]])


def reference(d, emb, cache, tok, hid, pos, k):
    """The engine's draft loop through the drafter's own (unfused) step."""
    drafts, h = draft_steps(d, emb, cache, decode_attention_ref, tok, hid, pos, k)
    return drafts[0].tolist(), h


def test_draft_loop_equals_the_drafter(target, drafter, primed):
    """k = 8 and then k = 2 on the same kernel (the barrier count reset between launches)."""
    cache, h, pos = primed
    emb = target.embed_tokens.weight
    loop = DraftLoop(drafter, emb, cache, splits=3)
    assert loop.P == 1 and loop.meta["NSPL"] == 3
    for k, tok in ((8, 42), (2, 7)):
        want, h_ref = reference(drafter, emb, cache, torch.tensor([[tok]]), h, pos, k)
        got = loop(torch.tensor([[tok]]), h, pos, k)
        assert got.tolist() == [want]
        assert (loop.hidden() - h_ref).abs().max().item() < 1e-4
    loop.check()
    assert loop.bar.tolist() == [0, 0]  # the last program out reset the barrier


def test_draft_loop_early_position(target, drafter):
    """Position 3: the ring is mostly empty and the full layer sees 3 keys (splits with none)."""
    cache = KVCache(TINY, 1, 64, window=12, dtype=torch.float32)
    h = Generator(target, cache, prefill_chunk=16).prefill(torch.tensor([PROMPT[:3]]))
    pos = torch.tensor([[3]])
    emb = target.embed_tokens.weight
    want, _ = reference(drafter, emb, cache, torch.tensor([[5]]), h, pos, 2)
    assert DraftLoop(drafter, emb, cache, splits=4)(torch.tensor([[5]]), h, pos, 2).tolist() == [want]


def test_spec_with_the_draft_loop_equals_ar(target):
    """The engine takes the kernel for its one-row draft loop (its drafts: the kernel's); the replayed
    tokens equal AR's."""
    from fastgemma.transforms.fuse_layers import FuseLayers

    m = synthetic_model(TINY, dtype=torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    FuseLayers(backend="torch").apply(m)
    d = m.fuse_drafter(synthetic_drafter(TINY, dtype=torch.float32, seed=0))
    d.loop_kernel = DraftLoop  # what fuse.draft_loop sets (it needs the triton backend)
    k, n = 3, 5
    cache = KVCache(TINY, 1, len(PROMPT) + n, window=12, dtype=torch.float32)
    gen = SpecGenerator(m, cache, d, k, replay=Replay("frontier", seed=k))
    assert gen.draft_kernel is not None
    g = gen.generate(PROMPT, n)
    cache2 = KVCache(TINY, 1, len(PROMPT) + n, window=12, dtype=torch.float32)
    assert g.tokens == Generator(m, cache2).generate(PROMPT, n).tokens


def test_draft_loop_refusals(target, drafter, primed):
    cache, h, pos = primed
    emb = target.embed_tokens.weight
    with pytest.raises(DraftLoopError, match="programs=2 must be in"):
        DraftLoop(drafter, emb, cache, programs=2)
    loop = DraftLoop(drafter, emb, cache)
    with pytest.raises(DraftLoopError, match="depth k=0"):
        loop(torch.tensor([[1]]), h, pos, 0)
    unmerged = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    with pytest.raises(DraftLoopError, match="gate|up merged"):
        DraftLoop(unmerged, emb, cache)
    big = KVCache(TINY, 2, 64, window=12, dtype=torch.float32)
    with pytest.raises(DraftLoopError, match="one row"):
        DraftLoop(drafter, emb, big)
    from fastgemma.transforms.fuse_layers import FuseLayers
    with pytest.raises(ValueError, match="fuse.draft_loop is one Triton kernel"):
        FuseLayers(backend="torch", draft_loop=True)
