"""Records -> comparable rows: merge the records of one configuration, label them, tabulate.

Records of one configuration (same choices apart from task/eval/logger/experiment, same command-line
values of technique keys such as quant.group_size=64, same device) merge into one row, later metrics
winning: a bench record and a ppl record of the same stack meet on one row. A row's label lists
the technique choices and keys that differ from the baseline.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .record import TECHNIQUES

CONTEXT = ("model", "weights", "workload")
NOT_CONFIG = {"task", "eval", "logger", "experiment"}
TABLE_METRICS = ("tps", "ppl", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p99", "tokens_per_step", "vram_peak_gb",
                 "mbu", "identity_rate", "top1_agree", "top1_agree_confident", "prune_miss_rate", "prune_target_miss")


@dataclass
class Row:
    choices: dict
    device: str
    metrics: dict = field(default_factory=dict)
    cdf: dict = field(default_factory=dict)
    runs: list = field(default_factory=list)
    ppl_time: str = ""  # time of the record its ppl came from: the latest measurement wins

    @property
    def context(self) -> tuple:
        return tuple(self.choices.get(k) for k in CONTEXT) + (self.device,)

    def label(self, baseline: dict) -> str:
        return " ".join(f"{g}={self.choices[g]}" for g in self.differs(baseline)) or "baseline"

    def differs(self, baseline: dict) -> list[str]:
        keys = [g for g in TECHNIQUES if g in self.choices]
        keys += sorted(k for k in self.choices if k.partition(".")[0] in TECHNIQUES and "." in k)
        return [k for k in keys if self.choices[k] != baseline.get(k)]


def shared_choices(rows: list[Row]) -> dict:
    """Technique choices and keys with one value on every row (a sweep's fixed settings, e.g. graphs=static for
    all): not what the rows compare, so the report takes them as its baseline's unless told otherwise."""
    if not rows:
        return {}
    keys = {k for r in rows for k in r.choices if k.partition(".")[0] in TECHNIQUES}
    return {k: rows[0].choices.get(k) for k in sorted(keys)
            if all(k in r.choices and r.choices[k] == rows[0].choices[k] for r in rows)}


def _technique_keys(rec: dict) -> dict:
    """Command-line values of technique keys (quant.group_size=64, lm_head.rows=8192): variants of one choice.
    spec=none's are left out: plain AR takes spec.depth only so that a sweep over spec choices composes."""
    out = {}
    plain_ar = (rec.get("choices") or {}).get("spec") == "none"
    for o in rec.get("overrides") or []:
        key, eq, value = str(o).lstrip("+~").partition("=")
        group = key.partition(".")[0]
        if eq and "." in key and group in TECHNIQUES and not (plain_ar and group == "spec"):
            out[key] = value
    return out


def _key(rec: dict, drop=()) -> tuple:
    ch = {k: v for k, v in rec.get("choices", {}).items()
          if k not in NOT_CONFIG and k not in drop and not k.startswith("hydra")}
    ch.update(_technique_keys(rec))
    dev = (rec.get("hardware") or {}).get("gpu_name") or (rec.get("hardware") or {}).get("device") or "?"
    return tuple(sorted(ch.items())), dev


def merge(records: list[dict]) -> tuple[list[Row], list[dict]]:
    """-> (rows of successful bench/ppl/identity records, failed records). Perplexity does not
    depend on the workload: a ppl record joins every row of its stack, whatever their workload."""
    rows: dict[tuple, Row] = {}
    failed, ppl_recs = [], []
    for rec in sorted(records, key=lambda r: r.get("time") or ""):
        if rec.get("task") not in ("bench", "ppl", "identity"):
            continue
        if rec.get("status") != "ok":
            failed.append(rec)
            continue
        if rec["task"] == "ppl":
            ppl_recs.append(rec)
            continue
        key = _key(rec)
        row = rows.setdefault(key, Row(dict(key[0]), key[1]))
        row.metrics.update({k: v for k, v in rec.get("metrics", {}).items() if v is not None})
        if rec.get("metrics", {}).get("ppl") is not None:
            row.ppl_time = rec.get("time") or ""
        cdf = (rec.get("details") or {}).get("cdf")
        if cdf:
            row.cdf = cdf
        row.runs.append(rec.get("run_id"))
    for rec in ppl_recs:
        key = _key(rec, drop=("workload",))
        m = {k: v for k, v in rec.get("metrics", {}).items() if v is not None}
        hits = [r for k, r in rows.items() if (tuple(x for x in k[0] if x[0] != "workload"), k[1]) == key]
        if not hits:
            hits = [rows.setdefault(key, Row(dict(key[0]), key[1]))]
        for r in hits:
            if (rec.get("time") or "") >= r.ppl_time:
                r.metrics.update(m)
                r.ppl_time = rec.get("time") or ""
            r.runs.append(rec.get("run_id"))
    return list(rows.values()), failed


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def markdown_table(rows: list[Row], baseline: dict) -> str:
    cols = [m for m in TABLE_METRICS if any(r.metrics.get(m) is not None for r in rows)]
    ctx_cols = [k for k in CONTEXT if len({r.choices.get(k) for r in rows}) > 1]
    head = ["config", *ctx_cols, *( ["device"] if len({r.device for r in rows}) > 1 else []), *cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    base_tps, base_ppl = {}, {}
    for r in rows:
        if not r.differs(baseline) and r.metrics.get("tps"):
            base_tps[r.context] = r.metrics["tps"]
        if not r.differs(baseline) and r.metrics.get("ppl"):
            base_ppl[r.context] = r.metrics["ppl"]
    for r in sorted(rows, key=lambda r: (r.context, -(r.metrics.get("tps") or 0))):
        cells = [r.label(baseline), *(str(r.choices.get(k, "")) for k in ctx_cols)]
        if "device" in head:
            cells.append(r.device)
        for m in cols:
            v = _fmt(r.metrics.get(m))
            if m == "tps" and v and r.context in base_tps and r.differs(baseline):
                v += f" (x{r.metrics['tps'] / base_tps[r.context]:.2f})"
            if m == "ppl" and v and r.context in base_ppl and r.differs(baseline):
                v += f" ({100 * (r.metrics['ppl'] / base_ppl[r.context] - 1):+.2f}%)"
            cells.append(v)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def unequal_outputs(rows: list[Row], baseline: dict) -> list[str]:
    """Rows of one context (model, weights, workload, device) whose bench made different numbers of output tokens:
    requests that ended on an end-of-sequence id (workload.ignore_eos=false), where a choice that rounds
    otherwise can move the ends. Their tps compare different work; one line a context: each row's label and count."""
    by: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.metrics.get("output_tokens") is not None:
            by.setdefault(r.context, []).append(r)
    out = []
    for rs in by.values():
        if len({r.metrics["output_tokens"] for r in rs}) > 1:
            out.append(", ".join(f"{r.label(baseline)}: {r.metrics['output_tokens']}" for r in rs))
    return out


def failed_table(failed: list[dict]) -> str:
    if not failed:
        return ""
    lines = ["| run | task | choices | error |", "|---|---|---|---|"]
    for rec in failed:
        ch = " ".join(f"{k}={v}" for k, v in rec.get("choices", {}).items() if k in TECHNIQUES + CONTEXT)
        err = (rec.get("error") or "").replace("|", "/").splitlines()[0][:160] if rec.get("error") else ""
        lines.append(f"| {rec.get('run_id')} | {rec.get('task')} | {ch} | {err} |")
    return "\n".join(lines)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points (tps, ppl) no other point beats on both (higher tps, lower ppl)."""
    front = []
    for i, (t, p) in enumerate(points):
        if not any((t2 >= t and p2 <= p) and (t2 > t or p2 < p) for j, (t2, p2) in enumerate(points) if j != i):
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def marginal_gains(rows: list[Row], baseline: dict) -> list[tuple[str, float]]:
    """(technique label, tps gain over the baseline row of the same context) for rows that change
    exactly one technique group (its choice and / or its keys)."""
    base = {r.context: r for r in rows if not r.differs(baseline) and r.metrics.get("tps")}
    out = []
    for r in rows:
        groups = {k.partition(".")[0] for k in r.differs(baseline)}
        if len(groups) == 1 and r.context in base and r.metrics.get("tps"):
            out.append((r.label(baseline), r.metrics["tps"] / base[r.context].metrics["tps"] - 1))
    return sorted(out, key=lambda x: -x[1])
