"""Report plots (PNG, matplotlib's Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

from .compare import marginal_gains, pareto_front


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tps_vs_ppl(rows, baseline: dict, path: Path) -> Path | None:
    pts = [(r, r.metrics["tps"], r.metrics["ppl"]) for r in rows if r.metrics.get("tps") and r.metrics.get("ppl")]
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[1] for p in pts], [p[2] for p in pts], color="tab:blue", zorder=3)
    for r, t, p in pts:
        ax.annotate(r.label(baseline), (t, p), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = pareto_front([(t, p) for _, t, p in pts])
    ax.plot([pts[i][1] for i in front], [pts[i][2] for i in front], color="tab:red", lw=1.5, zorder=2,
            label="Pareto front")
    ax.margins(x=0.15, y=0.1)
    ax.set_xlabel("tps (output tokens / s)")
    ax.set_ylabel("perplexity")
    ax.set_title("Speed vs quality")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def marginal_gain(rows, baseline: dict, path: Path) -> Path | None:
    gains = marginal_gains(rows, baseline)
    if not gains:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(gains) + 1.5))
    labels, vals = [g[0] for g in gains], [100 * g[1] for g in gains]
    ax.barh(labels, vals, color=["tab:green" if v >= 0 else "tab:red" for v in vals])
    ax.axvline(0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("tps gain over the baseline (%)")
    ax.set_title("Marginal gain of each technique (one at a time)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def latency_cdf(rows, baseline: dict, path: Path) -> Path | None:
    curves = [(r, r.cdf["itl_ms"]) for r in rows if r.cdf.get("itl_ms")]
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, pts in curves:
        ys = [i / (len(pts) - 1) for i in range(len(pts))]
        ax.plot(pts, ys, label=r.label(baseline), lw=1.2)
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of decode steps")
    ax.set_title("Inter-token latency CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
