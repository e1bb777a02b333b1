"""workload.corpus: prompts cut from a text through the model's tokenizer (real text for real
weights), here with the tiny model's byte tokenizer; and the result table (`task.table=true`)."""
from __future__ import annotations

import pytest

from fgcli_helpers import TINY, run_job

from fastgemma.workloads.prompts import Workload, corpus_prompts
from fastgemma.workloads.tokenizer import ByteTokenizer


def test_corpus_prompts_are_consecutive_slices_and_wrap():
    got = corpus_prompts(list(range(10, 20)), [4, 6, 5], bos_id=2)
    assert [p.ids for p in got] == [[2, 10, 11, 12], [2, 13, 14, 15, 16, 17], [2, 18, 19, 10, 11]]


def test_workload_from_a_corpus_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcdefghij")
    wl = Workload("t", num_prompts=3, max_new_tokens=2, lengths=[3, 5], corpus=str(f))
    assert wl.needs_tokenizer and wl.describe()["corpus"] == str(f)
    tok = ByteTokenizer(512)
    ids = [p.ids for p in wl.prompts(512, 2, tokenizer=tok)]
    assert ids == [[2] + tok.encode(s, add_special_tokens=False) for s in ("ab", "cdef", "gh")]
    with pytest.raises(ValueError, match="need a tokenizer"):
        wl.prompts(512, 2)
    with pytest.raises(FileNotFoundError, match="corpus file .*missing.txt does not exist"):
        Workload("t", 1, 2, lengths=[3], corpus=str(tmp_path / "missing.txt"))
    assert Workload("d", 1, 2, lengths=[3], corpus="default").corpus.endswith("GPL-3")


def test_identity_on_text_prompts_prints_the_table(tmp_path, capsys):
    over = TINY + ["task=identity", "workload=text", "workload.lengths=[9,30]", "workload.num_prompts=2",
                   "workload.max_new_tokens=4", "task.table=true", "graphs=static"]
    rec = run_job(over, tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["metrics"]["identity_rate"] == 1.0 and rec["details"]["workload"]["prompt_len_max"] == 30
    out = capsys.readouterr().out
    assert "| identity_rate | 1 |" in out and "| workload | text: 2 prompts of 9-30 tokens" in out
