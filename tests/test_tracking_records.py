"""Tracking: the JSONL writer under concurrent writers, the reader's tolerance, W&B offline runs."""
from __future__ import annotations

import json
import time
import multiprocessing as mp

import pytest

from fgcli_helpers import TINY, results, run_job, wandb_offline_summary

from fastgemma.tracking.jsonl import append_jsonl, read_records
from fastgemma.tracking.record import METRICS, new_record, result_line


def _writer(path, k, n):
    for i in range(n):
        rec = new_record("bench", {"quant": "bf16"}, [], None, {}, None)
        rec.update(status="ok", metrics={"tps": float(k * 1000 + i)}, details={"pad": "x" * 3000})
        append_jsonl(path, rec)


def test_concurrent_appends_never_tear_a_line(tmp_path):
    path = tmp_path / "r.jsonl"
    procs = [mp.get_context("fork").Process(target=_writer, args=(path, k, 40)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = path.read_text().splitlines()
    assert len(lines) == 160
    tps = sorted(json.loads(x)["metrics"]["tps"] for x in lines)
    assert tps == sorted(float(k * 1000 + i) for k in range(4) for i in range(40))


def test_reader_skips_a_torn_line_and_says_where(tmp_path):
    path = tmp_path / "r.jsonl"
    rec = new_record("bench", {"quant": "bf16"}, [], None, {}, None)
    rec["status"] = "ok"
    append_jsonl(path, rec)
    with path.open("a") as f:
        f.write('{"schema": 1, "metrics": {"tps"\n')
    append_jsonl(path, rec)
    warnings = []
    recs = read_records([path], warn=warnings.append)
    assert len(recs) == 2 and len(warnings) == 1 and f"{path}:2:" in warnings[0]


def test_a_missing_results_path_says_where_results_come_from(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"results path .*nope\.jsonl does not exist \(task=bench runs .*"
                                                 r"task\.inputs="):
        read_records([tmp_path / "nope.jsonl"])


def test_record_is_json_safe_and_names_are_shared():
    rec = new_record("bench", {"quant": "int4"}, ["quant=int4"], None, {}, None)
    rec.update(status="ok", metrics={"tps": float("nan"), "ppl": 2.3})
    from fastgemma.tracking.record import to_json

    back = json.loads(to_json(rec))
    assert back["metrics"] == {"tps": None, "ppl": 2.3}
    assert "ppl=2.3" in result_line(rec) and "quant=int4" in result_line(rec)
    assert {"tps", "ttft_ms_p50", "itl_ms_p99", "mbu", "ppl", "identity_rate", "top1_agree_confident"} <= set(METRICS)


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    rec = run_job(TINY[:-2] + ["progress=false", "logger=wandb", "logger.mode=offline", "workload.num_prompts=1",
                               "workload.warmup=0", "window=w128"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    summary = wandb_offline_summary(runs[0])
    for _ in range(60):  # wandb's writer process may still be flushing on a loaded machine
        if "tps" in summary:
            break
        time.sleep(0.5)
        summary = wandb_offline_summary(runs[0])
    for k in ("tps", "itl_ms_p50", "ttft_ms_p50", "weight_bytes_per_token"):
        assert summary[k] == rec["metrics"][k], k
    assert summary["status"] == "ok"
    assert "window=w128" in summary["_tags"] and "model=gemma4_tiny" in summary["_tags"]
    assert results(tmp_path)[-1]["run_id"] == rec["run_id"]  # the JSONL line too


def test_wandb_disabled_writes_no_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    rec = run_job(TINY[:-2] + ["progress=false", "logger=wandb", "logger.mode=disabled", "workload.num_prompts=1",
                               "workload.warmup=0"], tmp_path)
    assert rec["status"] == "ok" and not (tmp_path / "wb").exists()
    assert len(results(tmp_path)) == 1
