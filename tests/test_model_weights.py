"""Checkpoint loading (both key layouts, sharded), bad input, synthetic weights, generation errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY, hf_text_config, randomize_
from fastgemma.engine.cache import CacheError, KVCache
from fastgemma.engine.generator import GenerationError, Generator
from fastgemma.model.config import ConfigError, from_hf_dict, preset, read_config_json
from fastgemma.weights.hf import CheckpointError, load_hf
from fastgemma.weights.synthetic import synthetic_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _logits(model, ids):
    cache = KVCache(model.config, 1, 128, dtype=torch.float32)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.shape[1])[None], cache, start=0))[0]


@pytest.fixture(scope="module")
def condgen_dir(tmp_path_factory):
    """Gemma4ForConditionalGeneration (text under model.language_model.*, vision and audio towers
    beside it), written sharded by transformers."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    v = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16)
    a = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          subsampling_conv_channels=[8, 8], output_proj_dims=32)
    cfg = Gemma4Config(text_config=hf_text_config().to_dict(), vision_config=v.to_dict(), audio_config=a.to_dict())
    torch.manual_seed(3)
    m = randomize_(Gemma4ForConditionalGeneration(cfg).float().eval(), seed=3)
    d = tmp_path_factory.mktemp("condgen")
    m.save_pretrained(d, max_shard_size="300KB")
    return d, m


def test_conditional_generation_layout(condgen_dir):
    d, hf = condgen_dir
    ours, report = load_hf(d, dtype=torch.float32)
    assert report.shards > 1 and report.skipped_other_modalities > 0
    ids = torch.randint(0, TINY.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0]
    err = (_logits(ours, ids) - ref).abs().max().item()
    print(f"ConditionalGeneration layout: max abs diff {err:.2e}")
    assert err < 5e-5


def test_shared_layer_kv_keys_are_ignored_and_counted(hf_tiny_dir, tmp_path):
    """Released checkpoints may carry k/v projections and norms for KV-shared layers; transformers
    ignores them (_keys_to_ignore_on_load_unexpected), so do we, and we count them."""
    d = _copy(hf_tiny_dir[0], tmp_path / "ckpt")
    shared = [s.index for s in TINY.layer_specs() if not s.stores_kv]
    extra = {}
    for i in shared:
        dim = (TINY.global_head_dim if TINY.layer_types[i] == "full_attention" else TINY.head_dim)
        extra[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.zeros(TINY.num_kv_heads * dim, TINY.hidden_size)
        extra[f"model.layers.{i}.self_attn.k_norm.weight"] = torch.ones(dim)
    save_file(extra, str(d / "extra.safetensors"))
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"].update({k: "extra.safetensors" for k in extra})
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    model, report = load_hf(d, dtype=torch.float32)
    assert sorted(report.ignored_shared_kv) == sorted(extra)
    assert "ignored 8 KV-shared" in report.summary()


def _first_shard(d):
    return sorted(d.glob("model-*.safetensors"))[0]


def test_missing_key_named(hf_tiny_dir, tmp_path):
    d = _copy(hf_tiny_dir[0], tmp_path / "ckpt")
    f = _first_shard(d)
    t = load_file(str(f))
    gone = sorted(t)[0]
    del t[gone]
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match=f"missing keys .*{gone.replace('.', '[.]')}"):
        load_hf(d, dtype=torch.float32)


def test_unexpected_key_named(hf_tiny_dir, tmp_path):
    d = _copy(hf_tiny_dir[0], tmp_path / "ckpt")
    f = _first_shard(d)
    t = load_file(str(f))
    t["model.layers.0.mlp.bogus.weight"] = torch.zeros(2)
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match="unexpected keys .*model.layers.0.mlp.bogus.weight"):
        load_hf(d, dtype=torch.float32)


def test_shape_mismatch_named_with_both_shapes(hf_tiny_dir, tmp_path):
    d = _copy(hf_tiny_dir[0], tmp_path / "ckpt")
    f = _first_shard(d)
    t = load_file(str(f))
    name = sorted(k for k in t if k.endswith("proj.weight"))[0]
    good = list(t[name].shape)
    t[name] = torch.zeros(good[0] + 1, good[1])
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match=rf"{name}: checkpoint \[{good[0] + 1}, {good[1]}\] vs model \[{good[0]}, {good[1]}\]"):
        load_hf(d, dtype=torch.float32)


def test_bad_directories(tmp_path, hf_tiny_dir):
    with pytest.raises(CheckpointError, match="no such directory"):
        load_hf(tmp_path / "nope")
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hf(f)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_hf(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="'llama' is not Gemma 4"):
        load_hf(empty)
    nosafe = tmp_path / "nosafe"
    nosafe.mkdir()
    shutil.copy(hf_tiny_dir[0] / "config.json", nosafe / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf(nosafe)
    corrupt = _copy(hf_tiny_dir[0], tmp_path / "corrupt")
    _first_shard(corrupt).write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_hf(corrupt)


def test_config_reader_layouts(hf_tiny_dir):
    top = json.loads((hf_tiny_dir[0] / "config.json").read_text())
    a = from_hf_dict(top)
    b = from_hf_dict({"model_type": "gemma4", "text_config": top})
    assert a.layer_specs() == b.layer_specs() == TINY.layer_specs()
    assert a.global_head_dim == TINY.global_head_dim and a.ple_dim == TINY.ple_dim
    # a released-style config with global_head_dim at the top level
    released = dict(top, global_head_dim=64)
    released.pop("per_layer_config", None)
    assert from_hf_dict(released).global_head_dim == 64
    assert read_config_json(hf_tiny_dir[0]).layer_types == TINY.layer_types
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("gemma9")


def test_e4b_preset_facts():
    c = preset("gemma4_e4b")
    counts = c.param_count()
    assert round(counts["total"] / 1e9, 3) == 7.463 and round(counts["mlp"] / 1e6, 1) == 3303.0
    specs = c.layer_specs()
    assert [s.index for s in specs if not s.sliding] == [5, 11, 17, 23, 29, 35, 41]
    assert sum(s.stores_kv for s in specs) == 24
    assert {s.kv_source for s in specs[24:]} == {22, 23}
    assert specs[41].kv_source == 23 and specs[40].kv_source == 22


def test_synthetic_is_seeded_and_finite():
    a = synthetic_model(TINY, dtype=torch.float32, seed=5)
    b = synthetic_model(TINY, dtype=torch.float32, seed=5)
    c = synthetic_model(TINY, dtype=torch.float32, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.mlp.up_proj.weight"], sc["layers.0.mlp.up_proj.weight"])
    bf = synthetic_model(TINY, dtype=torch.bfloat16, seed=5)
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    cache = KVCache(TINY, 1, 300, dtype=torch.bfloat16)  # 200 new tokens: the window (16) wraps 18 times
    gen = Generator(bf, cache, prefill_chunk=64)
    out = gen.generate(list(range(1, 100)), 200)
    assert len(out.tokens) == 200 and len(set(out.tokens)) > 20
    logits = gen.forced(list(range(1, 100)), out.tokens)
    assert torch.isfinite(logits).all()


def test_generation_errors():
    m = synthetic_model(TINY, dtype=torch.float32)
    gen = Generator(m, KVCache(TINY, 1, 64, dtype=torch.float32))
    with pytest.raises(GenerationError, match="empty prompt"):
        gen.generate([], 4)
    with pytest.raises(GenerationError, match="exceeds the cache's max_context 64"):
        gen.generate(list(range(1, 61)), 5)
    with pytest.raises(GenerationError, match="token id 512 is outside the vocabulary"):
        gen.generate([1, 512], 4)
    with pytest.raises(GenerationError, match="token id -1 is outside"):
        gen.generate([-1, 3], 4)
    with pytest.raises(GenerationError, match="max_new_tokens must be >= 1"):
        gen.generate([1, 2], 0)
    with pytest.raises(CacheError, match="exceeds the model's max_position_embeddings"):
        KVCache(TINY, 1, 10**6)
    # a failed call leaves the generator usable
    assert len(gen.generate([1, 2, 3], 5).tokens) == 5


def test_eos_stops_unless_ignored():
    m = synthetic_model(TINY, dtype=torch.float32)
    gen = Generator(m, KVCache(TINY, 1, 128, dtype=torch.float32))
    free = gen.generate([5, 6, 7], 40).tokens
    eos = free[3]
    gen.eos = {eos}
    stopped = gen.generate([5, 6, 7], 40, ignore_eos=False).tokens
    assert stopped == free[: free.index(eos) + 1]
    assert gen.generate([5, 6, 7], 40, ignore_eos=True).tokens == free
