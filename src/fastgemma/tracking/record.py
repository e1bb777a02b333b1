"""The result record: one JSON object per run, the same metric names in console, JSONL and W&B.

{
  "schema": 1, "run_id", "time" (UTC ISO), "task", "status": "ok" | "error", "error": str | null,
  "choices": {group: choice} (HydraConfig runtime.choices, hydra/* left out),
  "overrides": [command-line overrides], "run_dir", "sweep": {"dir", "job_num"} | null,
  "metrics": {tps, ttft_ms_p50, ..., ppl, identity_rate, ...}: flat numbers or null,
  "details": {"model", "parts", "workload", "eval", "cdf", ...}: what the metrics were measured on,
  "hardware": {...}, "software": {...}, "config": the resolved config
}
"""
from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from pathlib import Path

SCHEMA = 1
# the config groups that are techniques (each sweepable on its own): what a result line, a report row's label
# and the build's parts name; their sub-keys on the command line (quant.group_size=64) are variants of a choice
TECHNIQUES = ("window", "ple", "fuse", "quant", "lm_head", "spec", "graphs", "attention", "sampler")

# the metric names, in the order the console and report print them
METRICS = (
    "tps", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "step_ms", "tokens_per_step",
    "vram_peak_gb", "vram_reserved_peak_gb", "weight_bytes_per_token", "copy_bw_gbs", "mbu",
    "ppl", "nll_mean", "ppl_tokens", "prune_miss_rate", "prune_target_miss",
    "identity_rate", "identity_prefix_mean", "top1_agree", "top1_agree_confident",
    "accept_mean", "accept_by_pos",
)


def new_record(task: str, choices: dict, overrides: list, run_dir, config: dict, sweep: dict | None) -> dict:
    return {
        "schema": SCHEMA,
        "run_id": dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6],
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "task": task, "status": "running", "error": None,
        "choices": dict(choices), "overrides": list(overrides),
        "run_dir": str(run_dir) if run_dir else None, "sweep": sweep,
        "metrics": {}, "details": {}, "hardware": {}, "software": {}, "config": config,
    }


def _clean(x):
    """JSON-safe: NaN/inf -> null, tuples -> lists, unknown objects -> str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def to_json(record: dict) -> str:
    return json.dumps(_clean(record), sort_keys=False, separators=(",", ":"), allow_nan=False)


def write_record(record: dict, run_dir) -> Path | None:
    """record.json in the run directory (written whole, then renamed: never half a file)."""
    if not run_dir:
        return None
    path = Path(run_dir) / "record.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(record), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def result_line(record: dict) -> str:
    """The one console line: task, non-baseline-looking choices, then the metrics that are set."""
    ch = record["choices"]
    keys = ("model", "weights", *TECHNIQUES, "workload")
    if record["task"] in ("ppl", "generate"):  # the prompt set plays no part in these
        keys = keys[:-1]
    head = " ".join(f"{k}={ch[k]}" for k in keys if k in ch)
    m = record["metrics"]
    body = " ".join(f"{k}={_fmt(m[k])}" for k in METRICS if m.get(k) is not None)
    status = "" if record["status"] == "ok" else f" status={record['status']}"
    note = (record.get("details") or {}).get("mbu_note")
    return f"[{record['task']}] {head} | {body}{status}" + (f" ({note})" if note else "")


def result_table(record: dict) -> str:
    """The record as a two-column markdown table: what ran (model, device, workload, eval), then
    every metric that is set, in METRICS order (`task.table=true` prints it after the result line)."""
    d, m, hw = record.get("details") or {}, record.get("metrics") or {}, record.get("hardware") or {}
    model, wl, ev = d.get("model") or {}, d.get("workload") or {}, d.get("eval") or {}
    rows = []
    if model:
        rows.append(("model", f"{model.get('name')} ({model.get('family')}, {model.get('params', 0):,} params, "
                              f"{model.get('layers')} layers, vocab {model.get('vocab', 0):,})"))
    where = hw.get("gpu_name") or f"{hw.get('cpu') or 'cpu'} ({hw.get('cpu_count')} cores)"
    rows.append(("device", f"{d.get('device', hw.get('device'))}: {where}, {d.get('dtype', '?')}"))
    choices = record.get("choices") or {}
    rows.append(("choices", " ".join(f"{k}={v}" for k, v in choices.items() if k not in ("task", "logger"))))
    if wl and record.get("task") in ("bench", "identity"):
        rows.append(("workload", f"{wl.get('name')}: {wl.get('num_prompts')} prompts of "
                                 f"{wl.get('prompt_len_min')}-{wl.get('prompt_len_max')} tokens, "
                                 f"{wl.get('max_new_tokens')} new tokens each"))
    if ev:
        rows.append(("ppl text", f"{ev.get('source')}, windows of {ev.get('seq_len')} tokens"))
    for k in (*METRICS, "ppl_sequences", "output_tokens", "wall_s"):
        if m.get(k) is not None:
            rows.append((k, _fmt(m[k])))
    lines = ["| | |", "|---|---|"] + [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
    return "\n".join(lines)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)
