"""Our decoder against transformers' Gemma4ForCausalLM on the same tiny random weights, fp32.

The tiny config keeps the real structure: 5:1 sliding/full pattern, PLE, KV sharing with both layer
types shared, head dims 32/64, proportional partial RoPE, softcap, a window (16) shorter than the prompt.
"""
from __future__ import annotations

import pytest
import torch

from conftest import TINY, make_hf_causal
from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator
from fastgemma.engine.steps import EagerStep, StaticStep
from fastgemma.kernels.decode_attention import decode_attention_ref
from fastgemma.weights.hf import load_hf

PROMPT, STEPS = 40, 64


@pytest.fixture(scope="module")
def pair(hf_tiny_dir):
    d, hf = hf_tiny_dir
    ours, report = load_hf(d, dtype=torch.float32)
    ours.step_attention = decode_attention_ref
    return hf, ours, report


@pytest.fixture(scope="module")
def hf_trace(pair):
    """transformers' own greedy decode with its cache: per-step logits and tokens."""
    hf, _, _ = pair
    ids = torch.randint(0, TINY.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        logits = [out.logits[0, -1]]
        prefill = out.logits[0]
        for _ in range(STEPS):
            tok = logits[-1].argmax()[None, None]
            out = hf(tok, cache=out.cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return ids, prefill, torch.stack(logits)


def test_load_report(pair):
    _, ours, report = pair
    assert report.shards > 1
    assert report.loaded == len(ours.state_dict())
    assert report.ignored_shared_kv == [] and report.skipped_tied_head is False


def test_prefill_logits_match(pair, hf_trace):
    _, ours, _ = pair
    ids, ref, _ = hf_trace
    cache = KVCache(TINY, 1, 256, dtype=torch.float32)
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(PROMPT)[None], cache, start=0))
    err = (got[0] - ref).abs().max().item()
    print(f"prefill max abs diff {err:.2e}")
    assert err < 5e-5


@pytest.mark.parametrize("step_cls", [EagerStep, StaticStep])
@pytest.mark.parametrize("chunk", [2048, 16, 7])
def test_decode_matches_transformers(pair, hf_trace, step_cls, chunk):
    """Chunked prefill (chunks shorter than the window and than the prompt), then 64 greedy
    steps: logits within ~1e-5 of transformers' and the same tokens."""
    _, ours, _ = pair
    ids, _, ref = hf_trace
    cache = KVCache(TINY, 1, 256, dtype=torch.float32)
    gen = Generator(ours, cache, step_cls(ours, cache), prefill_chunk=chunk)
    hf_tokens = ref.argmax(-1)
    got = gen.forced(ids, hf_tokens)
    err = (got - ref).abs().max().item()
    print(f"{step_cls.__name__} chunk={chunk}: decode max abs diff over {STEPS} steps {err:.2e}")
    assert err < 5e-5
    out = gen.generate(ids, STEPS + 1)
    assert out.tokens == hf_tokens.tolist()


def test_hf_generate_identical(pair):
    """transformers' own generate() (greedy) emits the same tokens as ours."""
    hf, ours, _ = pair
    ids = torch.randint(0, TINY.vocab_size, (1, 23), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 23:].tolist()
    cache = KVCache(TINY, 1, 128, dtype=torch.float32)
    got = Generator(ours, cache, StaticStep(ours, cache)).generate(ids, 32).tokens
    assert got == ref


def test_cache_memory_is_window_sized():
    """Sliding store layers own window + step_rows slots whatever the context; shared layers none."""
    cache = KVCache(TINY, 1, 4096, dtype=torch.float32)
    specs = TINY.layer_specs()
    stores = [s for s in specs if s.stores_kv]
    assert set(cache.k) == {s.index for s in stores}
    for s in stores:
        assert cache.k[s.index].shape[1] == (TINY.sliding_window + 16 if s.sliding else 4096)
