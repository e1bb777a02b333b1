"""Perplexity through the ppl task equals an independent computation with transformers' own Gemma 4
on the same tiny weights (fp32, CPU), for both inputs: a {context_ids, target_ids} JSONL and a text
corpus; chunks smaller than the sliding window and unaligned with the sequences."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from fgcli_helpers import run_job

from fastgemma.metrics.ppl import Scored, cap_tokens, text_windows
from fastgemma.workloads.ids_jsonl import read_ppl_jsonl
from fastgemma.workloads.tokenizer import ByteTokenizer


@torch.no_grad()
def hf_nll(model, ids: list[int], score_from: int) -> tuple[float, int]:
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(input_ids=x).logits[0].double(), -1)   # [T, V]
    tgt = torch.tensor(ids[score_from:])
    return float(-logp[score_from - 1:-1].gather(1, tgt[:, None]).sum()), len(tgt)


def hf_ppl(model, seqs) -> float:
    nll = n = 0
    for ids, start in seqs:
        a, b = hf_nll(model, ids, start)
        nll, n = nll + a, n + b
    return math.exp(nll / n)


def _tiny_job(hf_dir, tmp_path, extra):
    return run_job(["weights=hf", f"weights.path={hf_dir}", "device=cpu", "dtype=fp32", "threads=1",
                    "logger=jsonl", "progress=false", "task=ppl", *extra], tmp_path)


def test_jsonl_ppl_matches_transformers(hf_tiny_dir, tmp_path):
    d, hf = hf_tiny_dir
    rng = random.Random(0)
    rows = []
    for ctx_len, tgt_len in [(5, 30), (40, 7), (17, 64), (1, 3)]:  # contexts/targets across the 16-key window
        ctx = [2] + [rng.randrange(4, 512) for _ in range(ctx_len - 1)]
        rows.append({"context_ids": ctx, "target_ids": [rng.randrange(4, 512) for _ in range(tgt_len)]})
    path = tmp_path / "ppl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = _tiny_job(d, tmp_path, [f"eval.jsonl={path}", "eval.chunk=6"])
    assert rec["status"] == "ok", rec["error"]
    want = hf_ppl(hf, [(r["context_ids"] + r["target_ids"], len(r["context_ids"])) for r in rows])
    got = rec["metrics"]["ppl"]
    assert rec["metrics"]["ppl_tokens"] == 30 + 7 + 64 + 3
    print(f"ppl ours {got} transformers {want} rel {abs(got - want) / want:.2e}")
    assert abs(got - want) / want < 1e-4, (got, want)
    assert rec["choices"]["model"] == "checkpoint" and rec["details"]["model"]["name"]


def test_text_corpus_ppl_matches_transformers(hf_tiny_dir, tmp_path):
    d, hf = hf_tiny_dir
    text = ("Perplexity is the exponential of the mean negative log-likelihood per token. " * 3
            + "Tokens after the window still see the full-attention layers.")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    rec = _tiny_job(d, tmp_path, [f"eval.corpus={corpus}", "eval.seq_len=50", "eval.chunk=7", "tokenizer=bytes"])
    assert rec["status"] == "ok", rec["error"]
    tok = ByteTokenizer(512)
    ids = tok.encode(text, add_special_tokens=False)
    seqs = [([2] + ids[i:i + 49], 1) for i in range(0, len(ids), 49)]
    want = hf_ppl(hf, seqs)
    assert rec["metrics"]["ppl_tokens"] == len(ids)
    assert abs(rec["metrics"]["ppl"] - want) / want < 1e-4, (rec["metrics"]["ppl"], want)


def test_windows_caps_and_reader_errors(tmp_path):
    seqs = text_windows(list(range(10, 30)), seq_len=8, bos_id=2)
    assert [s.ids[0] for s in seqs] == [2, 2, 2] and sum(len(s.ids) - 1 for s in seqs) == 20
    capped = cap_tokens([Scored([2, 5, 6, 7], 2), Scored([2, 8, 9], 1)], 3)
    assert [s.ids for s in capped] == [[2, 5, 6, 7], [2, 8]]
    bad = tmp_path / "bad.jsonl"
    for body, msg in [('{"context_ids": [2], "target_ids": [5]}\n[1, 2]\n', "bad.jsonl:2: expected a JSON object"),
                      ('{"context_ids": [2]}\n', "bad.jsonl:1: missing key(s) target_ids"),
                      ('{"context_ids": [], "target_ids": [5]}\n', "bad.jsonl:1: 'context_ids' is empty"),
                      ('{"context_ids": [2], "target_ids": [5, 600]}\n', "token id 600, outside the vocabulary"),
                      ('{"context_ids": [2], "target_ids": [5, "x"]}\n', "must be a list of integers")]:
        bad.write_text(body)
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            read_ppl_jsonl(bad, vocab_size=512)


def test_pruned_head_miss_rates_in_the_ppl_pass(tmp_path):
    """lm_head=pruned: the ppl pass counts targets outside the keepset and, with scatter=false (the
    full head still behind compute_logits, so ppl is unchanged), full-head argmaxes outside it."""
    from fgcli_helpers import TINY

    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.lm_head import PrunedHead
    from fastgemma.workloads.corpus import default_corpus_path, read_corpus

    job = TINY + ["task=ppl", "eval.max_tokens=600"]
    pruned = ["lm_head=pruned", "lm_head.rows=64"]
    full = run_job(job, tmp_path, "full")["metrics"]
    kept = run_job(job + pruned + ["lm_head.scatter=false"], tmp_path, "kept")["metrics"]
    scattered = run_job(job + pruned + ["lm_head.scatter=true"], tmp_path, "scattered")["metrics"]
    tok = ByteTokenizer(512)
    keep = set(PrunedHead(rows=64).bind_tokenizer(tok).keep_ids(GEMMA4_TINY)[0])
    targets = tok.encode(read_corpus(default_corpus_path()), add_special_tokens=False)[:600]
    want = sum(t not in keep for t in targets) / 600
    assert kept["ppl"] == full["ppl"] and "prune_miss_rate" not in full
    assert kept["prune_target_miss"] == scattered["prune_target_miss"] == round(want, 6) > 0
    assert 0 < kept["prune_miss_rate"] < 1 and "prune_miss_rate" not in scattered
    assert math.isinf(scattered["ppl"])  # a scored target outside the keepset (null in the JSON record)
