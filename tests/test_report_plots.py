"""report: table, Pareto front, marginal gains and PNGs from hand-made records (failed ones listed)."""
from __future__ import annotations

from fgcli_helpers import run_job

from fastgemma.tracking.compare import marginal_gains, merge, pareto_front, shared_choices, unequal_outputs
from fastgemma.tracking.jsonl import append_jsonl
from fastgemma.tracking.record import new_record

BASE = {"model": "gemma4_e4b", "weights": "synthetic", "window": "native", "fuse": "none", "quant": "bf16", "lm_head": "full",
        "spec": "none", "graphs": "eager", "attention": "torch", "sampler": "argmax", "workload": "challenge"}


def _rec(task, metrics, status="ok", error=None, **choices):
    r = new_record(task, {**BASE, "task": task, **choices}, [], None, {}, None)
    r.update(status=status, error=error, metrics=metrics, hardware={"gpu_name": "H200", "device": "cuda:0"})
    if "tps" in metrics:
        r["details"] = {"cdf": {"itl_ms": [metrics["itl"] * (1 + i / 200) for i in range(101)]}}
    return r


def _records():
    return [
        _rec("bench", {"tps": 100.0, "itl": 10.0}),
        _rec("ppl", {"ppl": 2.30}, workload="smoke"),  # ppl joins every workload of its stack
        _rec("bench", {"tps": 120.0, "itl": 8.0}, window="w192"),
        _rec("ppl", {"ppl": 2.35}, window="w192"),
        _rec("bench", {"tps": 250.0, "itl": 4.0}, quant="int4"),
        _rec("ppl", {"ppl": 2.40}, quant="int4"),
        _rec("bench", {"tps": 90.0, "itl": 11.0}, window="w128"),
        _rec("ppl", {"ppl": 2.60}, window="w128"),
        _rec("bench", {"tps": 300.0, "itl": 3.0}, quant="int4", graphs="cuda_graph"),
        _rec("bench", {}, status="error", error="BuildError: graphs=cuda_graph needs a CUDA GPU", graphs="cuda_graph"),
    ]


def test_merge_pareto_and_gains():
    rows, failed = merge(_records())
    assert len(rows) == 5 and len(failed) == 1
    by = {r.label(BASE): r.metrics for r in rows}
    assert by["baseline"]["ppl"] == 2.30 and by["quant=int4"]["ppl"] == 2.40
    gains = {k: round(v, 6) for k, v in marginal_gains(rows, BASE)}
    assert gains == {"quant=int4": 1.5, "window=w192": 0.2, "window=w128": -0.1}  # two-group rows have no bar
    pts = [(100, 2.30), (120, 2.35), (250, 2.40), (90, 2.60)]
    assert pareto_front(pts) == [0, 1, 2]


def test_technique_keys_make_their_own_rows():
    """quant.group_size=64 on the command line is a variant of quant=int4: its own row and label;
    a ppl record and an identity record of the same variant meet on one row."""
    recs = [_rec("ppl", {"ppl": 2.30}), _rec("ppl", {"ppl": 2.40}, quant="int4"),
            _rec("ppl", {"ppl": 2.50}, quant="int4"), _rec("identity", {"identity_rate": 0.5}, quant="int4")]
    for r in recs[2:]:
        r["overrides"] = ["quant=int4", "quant.group_size=64", "logger=jsonl"]
    rows, _ = merge(recs)
    by = {r.label(BASE): r.metrics for r in rows}
    assert by == {"baseline": {"ppl": 2.30}, "quant=int4": {"ppl": 2.40},
                  "quant=int4 quant.group_size=64": {"ppl": 2.50, "identity_rate": 0.5}}


def test_fuse_choices_and_their_keys_are_rows_of_their_own():
    """fuse is a technique like the others: fuse=merged is not the baseline, and fuse=layers with fuse.pdl=true
    or false are two rows (not one row whose metrics the later record overwrote)."""
    recs = [_rec("bench", {"tps": 100.0, "itl": 10.0}), _rec("bench", {"tps": 110.0, "itl": 9.0}, fuse="merged"),
            _rec("bench", {"tps": 150.0, "itl": 6.0}, fuse="layers"), _rec("bench", {"tps": 170.0, "itl": 5.0}, fuse="layers")]
    recs[2]["overrides"], recs[3]["overrides"] = ["fuse=layers", "fuse.pdl=false"], ["fuse=layers", "fuse.pdl=true"]
    rows, _ = merge(recs)
    by = {r.label(BASE): r.metrics["tps"] for r in rows}
    assert by == {"baseline": 100.0, "fuse=merged": 110.0, "fuse=layers fuse.pdl=false": 150.0,
                  "fuse=layers fuse.pdl=true": 170.0}
    gains = {k: round(v, 6) for k, v in marginal_gains(rows, BASE)}  # a choice with its keys is one technique
    assert gains == {"fuse=merged": 0.1, "fuse=layers fuse.pdl=false": 0.5, "fuse=layers fuse.pdl=true": 0.7}


def test_spec_keys_of_plain_ar_do_not_split_its_row():
    """`-m spec=none,mtp spec.depth=7`: the spec=none job took spec.depth without using it; its row is the
    baseline's, while the mtp job's depth labels its own."""
    recs = [_rec("bench", {"tps": 100.0, "itl": 10.0}), _rec("bench", {"tps": 80.0, "itl": 12.0}, spec="mtp")]
    for r in recs:
        r["overrides"] = [f"spec={r['choices']['spec']}", "spec.depth=7"]
    rows, _ = merge(recs + [_rec("ppl", {"ppl": 2.3})])
    assert {r.label(BASE): r.metrics.get("tps") for r in rows} == {"baseline": 100.0, "spec=mtp spec.depth=7": 80.0}


def test_report_task_writes_table_and_pngs(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    for r in _records():
        append_jsonl(path, r)
    rec = run_job(["task=report", f"task.inputs=[{path}]", f"task.out={tmp_path / 'rep'}"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    out = capsys.readouterr().out
    assert "| config |" in out and "| quant=int4 | 250 (x2.50) | 2.4 (+4.35%) |" in out
    assert "## Failed runs" in out and "needs a CUDA GPU" in out
    for png in ("tps_vs_ppl", "marginal_gain", "latency_cdf"):
        data = (tmp_path / "rep" / f"{png}.png").read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 5000, png
    assert not (tmp_path / "results" / "results.jsonl").exists()  # report itself adds no record


def test_report_without_records_says_so(tmp_path, capsys):
    import pytest

    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit):
        run_job(["task=report", f"task.inputs=[{empty}]"], tmp_path)
    assert "no bench/ppl/identity records" in capsys.readouterr().err


def test_what_every_row_shares_joins_the_baseline(tmp_path, capsys):
    """A sweep run with graphs=static and quant.backend=torch on every job: its report compares the swept choices
    (a baseline row, ratios against it), not the settings every row shares; task.baseline still wins."""
    recs = [_rec("bench", {"tps": 100.0, "itl": 10.0}, graphs="static"),
            _rec("bench", {"tps": 120.0, "itl": 8.0}, graphs="static", window="w192")]
    for r in recs:
        r["overrides"] = ["graphs=static", "quant.backend=torch"]
    rows, _ = merge(recs)
    assert shared_choices(rows) == {"attention": "torch", "fuse": "none", "graphs": "static", "lm_head": "full",
                                    "quant": "bf16", "quant.backend": "torch", "sampler": "argmax", "spec": "none"}
    path = tmp_path / "results.jsonl"
    for r in recs:
        append_jsonl(path, r)
    run_job(["task=report", f"task.inputs=[{path}]", f"task.out={tmp_path / 'rep'}"], tmp_path)
    out = capsys.readouterr().out
    assert "Every row has graphs=static quant.backend=torch: the baseline has it too." in out
    assert "| baseline | 100 |" in out and "| window=w192 | 120 (x1.20) |" in out
    run_job(["task=report", f"task.inputs=[{path}]", f"task.out={tmp_path / 'rep2'}", "task.baseline={graphs: eager}"],
            tmp_path)
    out = capsys.readouterr().out
    assert "| graphs=static | 100 |" in out and "Every row has quant.backend=torch" in out


def test_rows_of_one_workload_with_other_output_counts_are_flagged(tmp_path, capsys):
    """With ends counted, a choice that rounds otherwise can end requests elsewhere: the report says the rows made
    different numbers of tokens (their tps compare different work); rows of other workloads are not compared."""
    recs = [_rec("bench", {"tps": 600.0, "itl": 1.6, "output_tokens": 4096}),
            _rec("bench", {"tps": 490.0, "itl": 2.0, "output_tokens": 3538}, fuse="layers"),
            _rec("bench", {"tps": 500.0, "itl": 2.0, "output_tokens": 64}, workload="smoke")]
    rows, _ = merge(recs)
    assert unequal_outputs(rows, BASE) == ["baseline: 4096, fuse=layers: 3538"]
    assert unequal_outputs(rows[:1] + rows[2:], BASE) == []
    path = tmp_path / "results.jsonl"
    for r in recs:
        append_jsonl(path, r)
    run_job(["task=report", f"task.inputs=[{path}]", f"task.out={tmp_path / 'rep'}"], tmp_path)
    out = capsys.readouterr().out
    assert "Output tokens differ between rows of one workload" in out and "(baseline: 4096, fuse=layers: 3538)" in out
