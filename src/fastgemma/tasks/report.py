"""report: read result records, print a markdown comparison table, and write the plots:
tps vs perplexity with its Pareto front, one bar per technique's marginal gain, the latency CDF."""
from __future__ import annotations

from pathlib import Path

from ..tracking import plots
from ..tracking.compare import failed_table, markdown_table, merge, shared_choices, unequal_outputs
from ..tracking.jsonl import read_records


def run(ctx):
    p = ctx.params
    inputs = p.get("inputs") or ["results/results.jsonl"]
    if isinstance(inputs, str):
        inputs = [inputs]
    out = Path(p.get("out") or ctx.out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(inputs)
    rows, failed = merge(records)
    if not rows and not failed:
        raise ValueError(f"no bench/ppl/identity records in {', '.join(map(str, inputs))}")
    baseline = dict(p.get("baseline") or {})
    fixed = {k: v for k, v in shared_choices(rows).items() if k not in baseline}
    baseline.update(fixed)  # what every row shares is not what they compare
    for g, v in ctx.choices.items():  # then the report run's own technique choices
        baseline.setdefault(g, v)

    table = markdown_table(rows, baseline) if rows else "(no successful runs)"
    same = " ".join(f"{k}={v}" for k, v in fixed.items() if v != ctx.choices.get(k))
    md = ["# fastgemma report\n", f"{len(records)} records from {', '.join(map(str, inputs))}: "
          f"{len(rows)} configurations, {len(failed)} failed runs." + (f" Every row has {same}: the baseline "
                                                                      f"has it too." if same else "") + "\n",
          table]
    unequal = unequal_outputs(rows, baseline)
    if unequal:
        md += ["\nOutput tokens differ between rows of one workload (requests ended on an end-of-sequence id): "
               "their tps compare different work; compare step_ms and tokens_per_step. "
               + "; ".join(f"({u})" for u in unequal)]
    if failed:
        md += ["\n## Failed runs\n", failed_table(failed)]
    pngs = {"tps_vs_ppl": plots.tps_vs_ppl(rows, baseline, out / "tps_vs_ppl.png"),
            "marginal_gain": plots.marginal_gain(rows, baseline, out / "marginal_gain.png"),
            "latency_cdf": plots.latency_cdf(rows, baseline, out / "latency_cdf.png")}
    made = {k: str(v) for k, v in pngs.items() if v}
    if made:
        md += ["\n## Plots\n"] + [f"![{k}]({Path(v).name})" for k, v in made.items()]
    missing = [k for k, v in pngs.items() if not v]
    if missing:
        md.append("\nnot drawn (no records with the needed metrics): " + ", ".join(missing))
    text = "\n".join(md) + "\n"
    (out / "report.md").write_text(text)
    print(text)
    print(f"report: {out / 'report.md'}" + "".join(f"\n{k}: {v}" for k, v in made.items()))
    return {}, {"report": str(out / "report.md"), "plots": made, "rows": len(rows), "failed": len(failed)}
