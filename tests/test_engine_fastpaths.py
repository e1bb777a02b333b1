"""Fast paths against their reference twins on the tiny model (fp32, CPU): merged projections,
the torch.compile'd static step, and the Triton decode attention inside the step (interpreter)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY
from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator
from fastgemma.engine.steps import EagerStep, StaticStep
from fastgemma.kernels.decode_attention import decode_attention_op, decode_attention_ref
from fastgemma.model.config import FULL, SLIDING
from fastgemma.transforms.fuse import MergeProjections
from fastgemma.weights.synthetic import synthetic_model

PROMPT = list(range(3, 43))  # 40 tokens: longer than the tiny window (16)


def _forced(model, step_cls, tokens, **kw):
    cache = KVCache(model.config, 1, 128, dtype=torch.float32)
    return Generator(model, cache, step_cls(model, cache, **kw), prefill_chunk=16).forced(PROMPT, tokens)


@pytest.fixture(scope="module")
def reference():
    model = synthetic_model(TINY, dtype=torch.float32, seed=3)
    model.step_attention = decode_attention_ref
    cache = KVCache(TINY, 1, 128, dtype=torch.float32)
    tokens = Generator(model, cache, EagerStep(model, cache)).generate(PROMPT, 24).tokens
    return model, tokens, _forced(model, EagerStep, tokens)


def test_merged_projections_match(reference):
    _, tokens, ref = reference
    model = synthetic_model(TINY, dtype=torch.float32, seed=3)
    model.step_attention = decode_attention_ref
    fuse = MergeProjections()
    fuse.apply(model)
    stores = sum(s.stores_kv for s in TINY.layer_specs())
    assert fuse.describe()["merged_modules"] == stores + TINY.num_layers
    assert not hasattr(model.layers[0].self_attn, "k_proj") and hasattr(model.layers[0].mlp, "gate_up_proj")
    for cls in (EagerStep, StaticStep):
        err = (_forced(model, cls, tokens) - ref).abs().max().item()
        print(f"merged {cls.__name__}: max abs diff {err:.2e}")
        assert err < 1e-4


def test_triton_attention_in_the_step(reference):
    """The step with the Triton kernel (CPU interpreter) against the eager reference."""
    model, tokens, ref = reference
    model.step_attention = decode_attention_op
    try:
        err = (_forced(model, StaticStep, tokens[:8]) - ref[:8]).abs().max().item()
    finally:
        model.step_attention = decode_attention_ref
    print(f"triton attention step: max abs diff {err:.2e}")
    assert err < 1e-4


def test_compiled_step_matches():
    """torch.compile of the static step (what graphs=compiled captures) emits the same logits. Four
    layers (sliding, full, and a KV-shared one reading each): compiling costs ~7 s a layer on a CPU."""
    cfg = dataclasses.replace(TINY, num_layers=4, num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * 2)
    model = synthetic_model(cfg, dtype=torch.float32, seed=3)
    model.step_attention = decode_attention_ref
    cache = KVCache(cfg, 1, 128, dtype=torch.float32)
    tokens = Generator(model, cache, EagerStep(model, cache)).generate(PROMPT, 6).tokens
    ref = _forced(model, EagerStep, tokens)
    torch._dynamo.reset()
    err = (_forced(model, StaticStep, tokens, compile=True) - ref).abs().max().item()
    print(f"compiled static step: max abs diff {err:.2e}")
    assert err < 1e-4


def test_compiled_step_with_the_fused_argmax_compiles_once(tmp_path):
    """sampler=fused_argmax keeps a logits buffer per head; made while torch.compile traced the step,
    it changed the dict the step's guards read and the second call recompiled the whole step (the
    frontier's step on the H200: 2 graphs compiled, run EW). StaticStep makes it first: one graph
    serves every step (a pruned head keeping every id, as the frontier's head: the full tied head's
    pick reads a data pointer, a graph break), with eager AR's tokens."""
    from torch._dynamo.utils import counters

    from fastgemma.transforms.lm_head import PrunedHead
    from fastgemma.transforms.sampler import FusedArgmax

    cfg = dataclasses.replace(TINY, num_layers=2, num_kv_shared_layers=0, layer_types=(SLIDING, FULL))
    model = synthetic_model(cfg, dtype=torch.float32, seed=4)
    model.step_attention = decode_attention_ref
    cache = KVCache(cfg, 1, 64, dtype=torch.float32)
    want = Generator(model, cache, EagerStep(model, cache)).generate(PROMPT[:12], 5).tokens
    keep = tmp_path / "all.txt"
    keep.write_text("\n".join(map(str, range(cfg.vocab_size))) + "\n")
    PrunedHead(rows=None, source="file", keepset=str(keep), tokenizer=None).apply(model)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    sampler = FusedArgmax("torch")
    cache = KVCache(cfg, 1, 64, dtype=torch.float32)
    step = StaticStep(model, cache, sampler, compile=True)
    with torch.inference_mode():  # the step first, as GraphStep.prepare warms it before any prompt
        for _ in range(2):
            step._body()
    cache.reset()
    gen = Generator(model, cache, step, sampler=sampler)
    assert gen.generate(PROMPT[:12], 5).tokens == want
    assert counters["stats"]["unique_graphs"] - before == 1
