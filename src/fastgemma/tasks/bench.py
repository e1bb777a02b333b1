"""bench: decode the workload's prompts one at a time and report speed.

Warm-up requests (their own prompts, never the benchmark's) run first and are excluded; then the
timed loop: wall time from the first prompt in to the last token out, prefill included.
tps = output tokens / that wall time. With eval=ppl the same loaded model is scored afterwards.
Each setup phase before the clock (the model: weights and transforms; the engine: cache, step
capture and compile; warm-up requests; the prompt's graphs; replay traces) is logged as it starts
and ends, and its seconds are recorded in details["setup_s"], the graphs torch.compile compiled in it in
details["setup_compiles"], and each prompt graph's capture seconds (by padded length) in
details["prompt_graph_s"].
"""
from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

from ..metrics.acceptance import acceptance_summary
from ..metrics.latency import latency_summary
from ..metrics.memory import copy_bandwidth_gbs, mbu, reset_peak, vram_peak_gb, weight_bytes_per_step
from ..metrics.timing import phase, sync

log = logging.getLogger("fastgemma")


def workload_prompts(ctx, limit=None):
    f, wl = ctx.factory, ctx.workload
    c = f.config
    tok = f.tokenizer() if wl.needs_tokenizer else None
    prompts = wl.prompts(c.vocab_size, c.bos_id, special=(c.pad_id, *c.eos_ids), tokenizer=tok)
    if limit:
        prompts = prompts[:limit]
    return prompts


def check_context(ctx, prompts, max_new: int) -> int:
    """The cache size this job needs, refused up front when the model cannot hold it."""
    c = ctx.factory.config
    longest = max(len(p.ids) for p in prompts)
    need = longest + max_new
    if need > c.max_position_embeddings:
        raise ValueError(f"workload {ctx.workload.name}: the longest prompt ({longest} tokens) + {max_new} new "
                         f"tokens = {need} exceeds model {c.name}'s max_position_embeddings "
                         f"{c.max_position_embeddings}; use shorter prompts (workload.lengths=[...])")
    return need


def _replay_details(gen, prompts, gens) -> dict | None:
    """spec=replay: emitted tokens that left the reference trace (summed over the timed requests; bf16 drift
    or a bug, 0 when the engine reproduces its own greedy trace) and each prompt's first 4 trace tokens (which
    greedy trace it followed; the acceptance draws are seeded by the prompt, Replay.draw_seed)."""
    replay = getattr(gen, "replay", None)
    if replay is None:
        return None
    heads = [replay.references.get(replay.key(p.ids), [])[:4] for p in prompts]
    mismatch = sum(g.replay_mismatch for g in gens)
    if mismatch:
        log.warning("spec=replay: %d emitted tokens left the reference traces, so the drafts after them no longer "
                    "follow the acceptance profile (numerics that drift from the traces, or a bug)", mismatch)
    return {"mismatch": mismatch, "reference_head": heads}


def _request_details(gens, eos_ids, ignore_eos: bool) -> list[dict]:
    """Each timed request: its prompt and output lengths, its TTFT, and whether it ended on an end-of-sequence id
    (only where ends count: workload.ignore_eos=false); how many ended is logged."""
    eos = set(eos_ids)
    rows = [{"prompt_tokens": g.prompt_len, "output_tokens": len(g.tokens), "ttft_ms": round(g.ttft_s * 1e3, 3),
             "ended": not ignore_eos and bool(g.tokens) and g.tokens[-1] in eos} for g in gens]
    ended = sum(r["ended"] for r in rows)
    if ended:
        log.info("%d of %d requests ended on an end-of-sequence id (%d output tokens in all)", ended, len(rows),
                 sum(r["output_tokens"] for r in rows))
    return rows


def run(ctx):
    f, wl = ctx.factory, ctx.workload
    dev = f.device
    setup, compiles = {}, {}  # seconds and torch.compile graphs per setup phase, before the clock
    with phase("model (weights, transforms)", setup, dev, compiles):
        model = f.model
    c = model.config
    prompts = workload_prompts(ctx)
    warm = wl.warmup_prompts(c.vocab_size, c.bos_id, special=(c.pad_id, *c.eos_ids))
    max_ctx = check_context(ctx, prompts + warm, wl.max_new_tokens)
    with phase("engine (cache, step capture / compile)", setup, dev, compiles):
        engine = f.engine(max_ctx)
    gen = engine.generator
    replays = getattr(gen, "replay", None) is not None  # spec=replay (spec=mtp's generator has prime() too)
    with phase(f"warm-up ({len(warm)} request{'s' * (len(warm) != 1)})", setup, dev, compiles):
        for p in tqdm(warm, desc="warm-up", unit="req", disable=ctx.progress is False or None, leave=False):
            if replays:  # spec=replay: the warm-up prompt's reference trace first, as below
                gen.prime(p.ids, wl.max_new_tokens)
            gen.generate(p.ids, wl.max_new_tokens, ignore_eos=wl.ignore_eos)
    # graph capture of every padded prompt length up to the longest (graphs=cuda_graph / compiled); an uncaptured
    # prompt path on a GPU runs each timed length once untimed instead (its kernels built per shape)
    longest = max(len(p.ids) for p in prompts)
    shapes = sorted({len(p.ids) for p in prompts}) if dev.type == "cuda" else []
    label = (f"prompt graphs (up to {longest} tokens)" if gen.capture_prefill or not shapes else
             f"prompt shapes ({len(shapes)} length{'s' * (len(shapes) != 1)})")
    with phase(label, setup, dev, compiles):
        gen.warm_prefill(longest, shapes)
    if replays:
        # spec=replay drafts follow each prompt's reference greedy trace: record it untimed (the
        # engine's own outputs are not cached; the timed run still decodes every token)
        with phase(f"replay traces ({len(prompts)} prompts)", setup, dev, compiles):
            for p in prompts:
                gen.prime(p.ids, wl.max_new_tokens)

    reset_peak(dev)
    sync(dev)
    log.info("timed: %d prompt%s x %d new tokens", len(prompts), "s" * (len(prompts) != 1), wl.max_new_tokens)
    gens, out_tokens = [], 0
    bar = tqdm(prompts, desc=f"bench {wl.name}", unit="prompt", disable=_disable(ctx, len(prompts)), dynamic_ncols=True)
    t0 = time.perf_counter()
    for p in bar:
        g = gen.generate(p.ids, wl.max_new_tokens, ignore_eos=wl.ignore_eos)
        gens.append(g)
        out_tokens += len(g.tokens)
        bar.set_postfix(tok_s=f"{out_tokens / (time.perf_counter() - t0):.1f}", refresh=False)
    sync(dev)
    wall = time.perf_counter() - t0
    bar.close()

    metrics, cdf = latency_summary(gens, wall)
    metrics.update(acceptance_summary(gens))
    metrics.update(vram_peak_gb(dev))
    per_step = weight_bytes_per_step(model)
    per_token = per_step / (metrics["tokens_per_step"] or 1)
    copy = copy_bandwidth_gbs(dev)
    metrics.update(weight_bytes_per_token=int(per_token), copy_bw_gbs=copy, mbu=mbu(per_token, metrics["tps"], copy))
    details = {"workload": wl.describe(), "max_context": max_ctx, "kv_cache_bytes": engine.cache.nbytes(),
               "replay": _replay_details(gen, prompts, gens),
               "requests": _request_details(gens, c.eos_ids, wl.ignore_eos),
               "weight_bytes_per_step": per_step, "cdf": cdf, "step": engine.step.__class__.__name__,
               "setup_s": setup, "setup_compiles": compiles,
               "prompt_graph_s": {str(n): s for n, s in gen.capture_s.items()},
               "mbu_note": None if copy else "vram_peak_gb, copy_bw_gbs, mbu: null, measured on a CUDA GPU only"}
    del engine
    if ctx.evaluation is not None:
        from .ppl import score

        m, d = score(ctx)
        metrics.update(m)
        details["eval"] = d
    return metrics, details


def _disable(ctx, n: int):
    """Progress bars: forced on/off by `progress`, else shown on a terminal for more than one item."""
    if ctx.progress is not None:
        return not ctx.progress
    return None if n > 1 else True
