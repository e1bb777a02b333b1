"""Latency statistics from per-request Generations: TTFT, inter-token latency, step time.

Inter-token latency (ITL) is one sample per decode step: step seconds / tokens that step emitted
(1 in AR decode; the accepted count in speculative decode). Percentiles interpolate linearly.
A compact CDF (the 0..100th percentiles) is kept for plots instead of every sample.
"""
from __future__ import annotations


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def cdf_points(xs: list[float], n: int = 101) -> list[float]:
    """The 0, 1, ..., 100th percentiles (n points)."""
    if not xs:
        return []
    return [round(percentile(xs, 100 * i / (n - 1)), 6) for i in range(n)]


def latency_summary(generations, wall_s: float) -> tuple[dict, dict]:
    """-> (metrics, cdfs). tps = every output token / the workload's wall time (prefill included)."""
    ttft = [g.ttft_s * 1e3 for g in generations]
    steps = [s for g in generations for s in g.step_s]
    tps_step = [n for g in generations for n in g.tokens_per_step]
    itl = [s * 1e3 / max(n, 1) for g in generations for s, n in zip(g.step_s, g.tokens_per_step)]
    out_tokens = sum(len(g.tokens) for g in generations)

    def r(x, nd=3):
        return None if x is None else round(x, nd)

    metrics = {
        "tps": r(out_tokens / wall_s if wall_s > 0 else None, 2),
        "ttft_ms_p50": r(percentile(ttft, 50)),
        "ttft_ms_p99": r(percentile(ttft, 99)),
        "itl_ms_p50": r(percentile(itl, 50)),
        "itl_ms_p99": r(percentile(itl, 99)),
        "step_ms": r(sum(steps) * 1e3 / len(steps) if steps else None),
        "tokens_per_step": r(sum(tps_step) / len(tps_step) if tps_step else None),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(g.prompt_len for g in generations),
        "requests": len(generations),
        "wall_s": r(wall_s),
    }
    return metrics, {"ttft_ms": cdf_points(ttft), "itl_ms": cdf_points(itl)}
