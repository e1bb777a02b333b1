"""The drafter's post-projection folded into the next step's pre-projection (spec.post_fold, fp32, CPU): a loop's
steps after the first take [embedding ; g] through W_pre's embedding half beside W_pre's hidden half @ W_post, so
the drafts equal the unfolded loop's and nothing reads W_post; unfused, fused (the twins and the Triton kernels in
the interpreter) and through the config.
"""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator
from fastgemma.engine.speculative import Replay, SpecGenerator, draft_steps
from fastgemma.engine.steps import EagerStep
from fastgemma.kernels.decode_attention import decode_attention_ref
from fastgemma.model.drafter import DrafterError, synthetic_drafter
from fastgemma.weights.synthetic import synthetic_model

PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    m = synthetic_model(TINY, dtype=torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    return m


def _state(model, n_extra=4):
    """A prefilled cache (window 12 < context) and the last position's hidden state, position and token."""
    cache = KVCache(TINY, 1, 64, window=12, dtype=torch.float32)
    ids = torch.tensor([PROMPT + list(range(30, 30 + n_extra))])
    h = Generator(model, cache, prefill_chunk=16).prefill(ids)
    return cache, h, torch.tensor([[ids.shape[1]]]), torch.tensor([[42]])


def _poison_post(d):
    """W_post set to NaN: a folded loop that still read it would draft from NaNs."""
    with torch.no_grad():
        d.post_projection.weight.fill_(float("nan"))


def test_folded_weight_is_the_embedding_half_beside_the_product():
    d = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    assert d.pre_folded is None
    d.fold_post_projection()
    H, n = TINY.hidden_size, d.config.hidden_size
    w = d.pre_projection.weight
    assert d.pre_folded.weight.shape == (n, H + n) and not d.pre_folded.weight.requires_grad
    assert torch.equal(d.pre_folded.weight[:, :H], w[:, :H])
    torch.testing.assert_close(d.pre_folded.weight[:, H:], w[:, H:] @ d.post_projection.weight)


def test_bytes_per_step_count_the_folded_projection_alone():
    d = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    before = d.nbytes_per_step()
    d.fold_post_projection()
    size = lambda lin: lin.weight.numel() * lin.weight.element_size()  # noqa: E731
    assert d.nbytes_per_step() == before - size(d.pre_projection) - size(d.post_projection) + size(d.pre_folded)
    assert d.nbytes_per_step() < before


def test_fold_refuses_a_projection_that_is_not_a_dense_linear():
    from torch import nn

    d = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    d.post_projection = nn.Linear(d.config.hidden_size, TINY.hidden_size, bias=True)
    with pytest.raises(DrafterError, match="post_projection"):
        d.fold_post_projection()


def _fused_drafter(backend):
    from fastgemma.transforms.fuse_layers import FuseLayers

    m = synthetic_model(TINY, dtype=torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    FuseLayers(backend=backend, tail_norm=backend == "triton").apply(m)
    return m.fuse_drafter(synthetic_drafter(TINY, dtype=torch.float32, seed=0))


@pytest.mark.parametrize("path", ["unfused", "torch", "triton"])
def test_folded_loop_drafts_as_the_unfolded_loop(target, path, wide_tiles):
    """k = 6 steps from one state: the same drafts and the same last g with W_post folded (and then poisoned),
    on the unfused drafter, fuse=layers' twins and its Triton kernels (interpreter)."""
    def make():
        return synthetic_drafter(TINY, dtype=torch.float32, seed=0) if path == "unfused" else _fused_drafter(path)

    cache, h, pos, tok = _state(target)
    emb = target.embed_tokens.weight
    ref = make()
    g_ref = {}  # the unfused step's last final-norm state
    ref.model.norm.register_forward_hook(lambda mod, i, o: g_ref.__setitem__("g", o))
    want, h_last = draft_steps(ref, emb, cache, decode_attention_ref, tok, h, pos, 6)
    assert h_last.shape[-1] == TINY.hidden_size  # unfolded: the last h'
    d = make().fold_post_projection()
    _poison_post(d)
    got, g_last = draft_steps(d, emb, cache, decode_attention_ref, tok, h, pos, 6)
    assert torch.equal(got, want)
    assert g_last.shape[-1] == d.config.hidden_size and torch.isfinite(g_last).all()
    if path == "unfused":  # the unfolded loop's last final-norm state, from the hook
        torch.testing.assert_close(g_last, g_ref["g"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_spec_with_the_folded_drafter_equals_ar(target, k):
    """Replayed speculative decoding with the folded (and poisoned) drafter: AR's tokens, window 12 < context."""
    d = synthetic_drafter(TINY, dtype=torch.float32, seed=0).fold_post_projection()
    _poison_post(d)
    cache = KVCache(TINY, 1, len(PROMPT) + 28, window=12, dtype=torch.float32)
    g = SpecGenerator(target, cache, d, k, replay=Replay("frontier", seed=k)).generate(PROMPT, 28)
    ar_cache = KVCache(TINY, 1, 64, window=12, dtype=torch.float32)
    assert g.tokens == Generator(target, ar_cache, EagerStep(target, ar_cache)).generate(PROMPT, 28).tokens


@pytest.mark.parametrize("extra,folded", [([], True), (["spec.post_fold=false"], False),
                                          (["fuse=layers", "fuse.backend=torch"], True)])
def test_spec_config_folds_the_drafter(extra, folded):
    """spec.post_fold (default true) folds the drafter the spec builds, recorded; the parameter count leaves the
    folded copy out."""
    from fgcli_helpers import TINY as TINY_CLI, compose_cfg
    from hydra.core.hydra_config import HydraConfig

    from fastgemma.build import build_context

    cfg = compose_cfg([*TINY_CLI, "spec=replay", "spec.depth=3", "graphs=static", *extra])
    HydraConfig.instance().set_config(cfg)
    ctx = build_context(cfg, dict(cfg.hydra.runtime.choices), "/tmp")
    eng = ctx.factory.engine(64)
    d = eng.generator.drafter
    info = ctx.factory.parts.spec.describe()
    assert (d.pre_folded is not None) == folded and info["drafter_post_folded"] is folded
    assert info["post_fold"] is ("spec.post_fold=false" not in extra)
    assert info["drafter_params"] == sum(p.numel() for n, p in d.named_parameters() if not n.startswith("pre_folded"))
    assert info["drafter_bytes_per_step"] == d.nbytes_per_step()


def test_the_draft_loop_kernel_keeps_both_projections(target, monkeypatch):
    """fuse.draft_loop's persistent kernel runs W_pre and W_post itself: the spec leaves that drafter unfolded."""
    from fastgemma.transforms.spec import MtpSpec

    def fuse(d):
        d.loop_kernel = object()
        return d

    monkeypatch.setattr(target, "fuse_drafter", fuse, raising=False)
    spec = MtpSpec(depth=3)
    d = spec.build_drafter(target)
    assert d.pre_folded is None and spec.describe()["drafter_post_folded"] is False
    monkeypatch.setattr(target, "fuse_drafter", None, raising=False)
    assert MtpSpec(depth=3).build_drafter(target).pre_folded is not None


def test_post_fold_must_be_a_bool():
    from fastgemma.transforms.spec import MtpSpec, ReplaySpec

    with pytest.raises(ValueError, match="spec.post_fold must be true or false"):
        MtpSpec(post_fold="yes")
    assert ReplaySpec(post_fold=False).describe()["post_fold"] is False
