"""The lm_head group (full / int8 / int4 / pruned) and sampler=fused_argmax on the tiny model (fp32, CPU):
keepsets and their errors, scatter vs full logits, quantised heads close to the full one, the fused
sampler equal to the plain argmax, the embedding left alone, and runs through the builder and the CLI."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # the sampler's Triton path runs in the interpreter here

import json
from collections import Counter

import pytest
import torch

from fastgemma.engine.steps import argmax_sampler
from fastgemma.metrics.head import prune_miss_rate
from fastgemma.model.config import GEMMA4_TINY
from fastgemma.transforms.lm_head import (
    FullHead, Int4Head, Int8Head, PrunedHead, keepset_from_counts, keepset_hash, read_keepset, write_keepset,
)
from fastgemma.transforms.sampler import Argmax, FusedArgmax
from fastgemma.weights.synthetic import synthetic_model
from fgcli_helpers import CONF, TINY, cli, compose_cfg, results, run_job

V = GEMMA4_TINY.vocab_size  # 512
HID = GEMMA4_TINY.hidden_size  # 64


@pytest.fixture
def model():
    torch.manual_seed(0)
    return synthetic_model(GEMMA4_TINY, device="cpu", dtype=torch.float32, seed=0).eval()


def _hidden(B=3, T=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, HID, generator=g) * 3


def _full_logits(model, h):
    lh, model.logits_head = model.logits_head, None
    try:
        return model.compute_logits(h)
    finally:
        model.logits_head = lh


def _file(tmp_path, text, name="keep.txt"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ---- keepsets --------------------------------------------------------------------------------
def test_keepset_file_formats(tmp_path):
    assert read_keepset(_file(tmp_path, "5\n# a comment\n\n3  # eos\n1\n"), V) == [5, 3, 1]
    assert read_keepset(_file(tmp_path, "[7, 2, 9]", "k.json"), V) == [7, 2, 9]
    p = write_keepset(tmp_path / "w.txt", [9, 4, 1])
    assert read_keepset(p, V) == [9, 4, 1]
    assert keepset_hash([1, 4, 9]) == keepset_hash([9, 4, 1]) != keepset_hash([1, 4, 8])


@pytest.mark.parametrize("text,match", [
    ("1\n2\n512\n", r"1 id\(s\) outside the vocabulary \[0, 512\), e.g. 512"),
    ("1\n-3\n", r"outside the vocabulary"),
    ("1\n2\n2\n", r"1 duplicate id\(s\), e.g. 2"),
    ("# nothing\n\n", r"is empty"),
    ("[]", r"is empty"),
    ("1\ntwo\n", r":2: 'two' is not an integer token id"),
    ("[1, 2.5]", r"JSON must be a list of integers"),
    ("[1, 2", r"not valid JSON"),
])
def test_bad_keepset_files(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        read_keepset(_file(tmp_path, text), V)


def test_keepset_from_counts_order_specials_and_fill():
    counts = Counter({10: 5, 11: 9, 12: 5, 13: 1})
    ids, filled = keepset_from_counts(counts, 6, V, always=(1, 0))
    assert ids == [1, 0, 11, 10, 12, 13] and filled == 0  # always-kept first; count ties by id
    ids, filled = keepset_from_counts(counts, 8, V, always=(1,))
    assert ids == [1, 11, 10, 12, 13, 0, 2, 3] and filled == 3  # unseen ids fill, ascending
    with pytest.raises(ValueError, match="exceeds the vocabulary size 512"):
        keepset_from_counts(counts, V + 1, V)
    with pytest.raises(ValueError, match="positive integer"):
        keepset_from_counts(counts, 0, V)
    with pytest.raises(ValueError, match="wrong tokenizer"):
        keepset_from_counts(Counter({600: 1}), 4, V)


def test_pruned_head_argument_errors(tmp_path, model):
    with pytest.raises(ValueError, match="source must be one of"):
        PrunedHead(source="web")
    with pytest.raises(ValueError, match="source=file needs lm_head.keepset"):
        PrunedHead(source="file")
    with pytest.raises(ValueError, match="is read with source=file"):
        PrunedHead(keepset="x.txt")
    with pytest.raises(ValueError, match="dtype must be one of"):
        PrunedHead(dtype="fp8")
    with pytest.raises(ValueError, match="rows=null is only for source=file"):
        PrunedHead(rows=None)
    with pytest.raises(ValueError, match="exceeds the vocabulary size 512"):
        PrunedHead(rows=V + 1).apply(model)
    with pytest.raises(ValueError, match="holds 3 ids"):
        PrunedHead(rows=5, source="file", keepset=_file(tmp_path, "1\n2\n3\n")).apply(model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PrunedHead(rows=None, source="file", keepset=str(tmp_path / "none.txt")).apply(model)
    assert model.logits_head is None  # nothing installed by a failed apply


# ---- pruned head ------------------------------------------------------------------------------
def test_pruned_head_from_corpus_scatters_and_keeps_the_embedding(model):
    emb = model.embed_tokens.weight
    before, ptr = emb.detach().clone(), emb.data_ptr()
    h = _hidden()
    full = _full_logits(model, h)
    PrunedHead(rows=64, extra_ids=[105]).apply(model)
    head = model.logits_head
    keep = head.keep_ids
    assert keep.numel() == 64 and torch.equal(keep, keep.sort().values)
    assert {0, 1, 2, 106, 105} <= set(keep.tolist())  # pad, eos, bos, eos, extra
    got = model.compute_logits(h)
    assert got.shape == full.shape and got.dtype == torch.float32
    kept = torch.zeros(V, dtype=torch.bool)
    kept[keep] = True
    torch.testing.assert_close(got[..., kept], full[..., kept])
    assert torch.isneginf(got[..., ~kept]).all()  # scatter: -inf outside the keepset
    assert emb.data_ptr() == ptr and torch.equal(emb, before) and model.embed_tokens.weight is emb


def test_pruned_describe_and_miss_rate(model):
    tr = PrunedHead(rows=64)
    tr.apply(model)
    d = tr.describe()
    assert d["rows"] == 64 and d["keepset_source"] == "corpus" and d["scatter"] is True
    assert d["head_bytes_per_token"] == 64 * HID * 4 + 64 * 8  # fp32 rows + int64 keep ids
    assert d["dense_head_bytes"] == V * HID * 4
    assert d["keepset_hash"] == keepset_hash(model.logits_head.keep_ids.tolist())
    assert d["corpus"].endswith("MPL-2.0") and d["tokenizer"] == "ByteTokenizer"
    assert 0.9 < d["corpus_coverage"] <= 1.0 and d["corpus_tokens"] > 10000
    assert tr.priority[:4] == [0, 2, 1, 106]  # pad, bos, eos... first, then by frequency
    # pruned argmax == full argmax wherever the full argmax is kept; the miss rate counts the rest
    h = _hidden(B=8, T=4, seed=2).reshape(32, 1, HID)
    full_ids = _full_logits(model, h[:, 0]).argmax(-1)
    ids, _ = argmax_sampler(model, h)
    keep = model.logits_head.keep_ids
    hit = torch.isin(full_ids, keep)
    assert torch.equal(ids[hit, 0], full_ids[hit])
    assert prune_miss_rate(full_ids, keep) == pytest.approx(1 - hit.float().mean().item())


def test_pruned_from_file_scatter_false_and_fused_sampler(tmp_path, model):
    keep_list = [300, 7, 1, 106, 2, 0] + list(range(20, 60))
    path = _file(tmp_path, json.dumps(keep_list), "keep.json")
    h = _hidden(B=2, T=3)
    full = _full_logits(model, h)
    tr = PrunedHead(rows=None, source="file", keepset=path, scatter=False)
    tr.apply(model)
    assert model.logits_head is None and model.pruned_head.rows == len(keep_list)
    torch.testing.assert_close(model.compute_logits(h), full)  # scatter=false: full head for logits
    for backend in ("torch", "triton"):
        ids, logits = FusedArgmax(backend)(model, h)
        keep = torch.tensor(sorted(keep_list))
        ref = torch.full((2, V), float("-inf"))
        ref[:, keep] = full[:, -1, keep]
        assert ids.shape == (2, 1) and torch.equal(ids[:, 0], ref.argmax(-1))
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-5)
    assert tr.describe()["keepset"] == path and tr.describe()["scatter"] is False


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_pruned_quantised_rows(model, dtype):
    h = _hidden()
    full = _full_logits(model, h)
    tr = PrunedHead(rows=128, dtype=dtype, group_size=32)
    tr.apply(model)
    keep = model.logits_head.keep_ids
    got = model.compute_logits(h)[..., keep]
    rel = ((got - full[..., keep]).norm() / full[..., keep].norm()).item()
    print(f"pruned {dtype}: relative logit error {rel:.2e}")
    assert rel < (0.01 if dtype == "int8" else 0.1)
    assert tr.describe()["dtype"] == dtype
    bytes_rows = 128 * HID if dtype == "int8" else 128 * HID // 2
    assert tr.describe()["head_bytes_per_token"] > bytes_rows


# ---- int8 / int4 heads --------------------------------------------------------------------------
@pytest.mark.parametrize("make,tol", [(lambda: Int8Head(), 0.01), (lambda: Int4Head(group_size=32), 0.1),
                                      (lambda: Int8Head(backend="triton"), 0.01)],
                         ids=["int8", "int4", "int8-triton"])
def test_quantised_heads_are_close_to_full(model, make, tol):
    emb = model.embed_tokens.weight.detach().clone()
    h = _hidden()
    full = _full_logits(model, h)
    tr = make()
    tr.apply(model)
    got = model.compute_logits(h)
    rel = ((got - full).norm() / full.norm()).item()
    agree = (got.argmax(-1) == full.argmax(-1)).float().mean().item()
    print(f"{tr.describe()}: relative logit error {rel:.2e}, top-1 agreement {agree:.2f}")
    assert rel < tol and agree >= 0.5
    assert torch.equal(model.embed_tokens.weight, emb)  # untied copy
    d = tr.describe()
    assert d["rows"] == V and d["head_bytes_per_token"] < d["dense_head_bytes"]
    ids, logits = FusedArgmax("torch")(model, h)
    assert torch.equal(ids[:, 0], got[:, -1].argmax(-1))


def test_int4_head_rejects_a_group_that_does_not_divide_hidden(model):
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4Head(group_size=48)
    with pytest.raises(ValueError, match="does not divide hidden 64"):
        Int4Head(group_size=128).apply(model)


# ---- fused sampler ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_sampler_equals_argmax_on_the_full_head(model, backend):
    FullHead().apply(model)
    h = _hidden(B=4, T=2)
    ref_ids, ref_logits = Argmax()(model, h)
    s = FusedArgmax(backend)
    ids, logits = s(model, h)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-5)
    ids2, logits2 = s(model, _hidden(B=4, T=1, seed=9))
    assert logits2 is logits  # one reused buffer per (head, batch, device)


def test_fused_sampler_on_pruned_head_matches_argmax_sampler(model):
    PrunedHead(rows=100).apply(model)
    h = _hidden(B=5, T=1, seed=3)
    ref_ids, ref_logits = Argmax()(model, h)
    for backend in ("torch", "triton"):
        ids, logits = FusedArgmax(backend)(model, h)
        assert torch.equal(ids, ref_ids)
        assert torch.equal(logits.isinf(), ref_logits.isinf())
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-5)


def test_fused_sampler_flags():
    with pytest.raises(ValueError, match="sampler backend must be one of"):
        FusedArgmax("cuda")
    assert FusedArgmax("triton").needs_cuda and not FusedArgmax().needs_cuda
    assert PrunedHead(backend="triton").needs_cuda and not Int8Head().needs_cuda


# ---- builder and CLI ---------------------------------------------------------------------------
def test_new_choices_compose_and_build():
    from hydra.core.hydra_config import HydraConfig

    from fastgemma import build

    for group, choice, cls in [("lm_head", "int8", Int8Head), ("lm_head", "int4", Int4Head),
                               ("lm_head", "pruned", PrunedHead), ("sampler", "fused_argmax", FusedArgmax)]:
        assert (CONF / group / f"{choice}.yaml").is_file()
        cfg = compose_cfg([f"{group}={choice}"])
        HydraConfig.instance().set_config(cfg)
        obj = build.instantiate_group(cfg, group, {group: choice})
        assert isinstance(obj, cls)
    cfg = compose_cfg(["lm_head=pruned"])
    assert cfg.lm_head.rows == 12288 and cfg.lm_head.source == "corpus"


def test_bad_keepset_through_the_builder_is_one_clear_line(tmp_path, capsys):
    bad = _file(tmp_path, "1\n2\n9999\n")
    with pytest.raises(SystemExit):
        run_job(TINY + ["task=generate", "lm_head=pruned", "lm_head.source=file", f"lm_head.keepset={bad}",
                        "lm_head.rows=null"], tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert "lm_head=pruned: keepset file" in err[0] and "e.g. 9999" in err[0] and "[0, 512)" in err[0]


def test_identity_in_process_with_pruned_head_and_fused_sampler(tmp_path):
    run_job(TINY + ["task=identity", "lm_head=pruned", "lm_head.rows=200", "sampler=fused_argmax",
                    "graphs=static", "workload.num_prompts=2"], tmp_path)
    (rec,) = results(tmp_path)
    text = json.dumps(rec)
    assert '"keepset_hash"' in text and '"fused_argmax"' in text
    m = rec.get("metrics", rec)
    assert 0.0 <= m["top1_agree"] <= 1.0


def test_bench_through_the_cli_with_a_pruned_head(tmp_path):
    r = cli(TINY + ["task=bench", "lm_head=pruned", "lm_head.rows=96", "sampler=fused_argmax",
                    "workload.num_prompts=1", "workload.warmup=0", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "lm_head=pruned" in r.stdout + r.stderr and "sampler=fused_argmax" in r.stdout + r.stderr
    (rec,) = results(tmp_path)
    assert '"rows": 96' in json.dumps(rec)
