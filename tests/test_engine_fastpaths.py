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
