"""identity: the chosen config against the reference (plain eager AR, native window, weights as
loaded, same dtype) on the workload's prompts. The reference runs first and is freed before the
candidate loads, so only one model is resident at a time. See metrics/identity.py for the rates.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from ..metrics.identity import IdentityTally, top2
from .bench import check_context, workload_prompts


def run(ctx):
    f, wl = ctx.factory, ctx.workload
    margin = float(ctx.params.get("margin", 0.1))
    limit = ctx.params.get("max_prompts")
    n_new = int(ctx.params.get("max_new_tokens") or wl.max_new_tokens)
    ref_f = f.reference()
    ctx_ref = type(ctx)(**{**ctx.__dict__, "factory": ref_f})
    prompts = workload_prompts(ctx_ref, limit)
    max_ctx = check_context(ctx_ref, prompts, n_new)
    disable = (not ctx.progress) if ctx.progress is not None else (None if len(prompts) > 1 else True)

    ref = ref_f.engine(max_ctx)
    refs = []
    for p in tqdm(prompts, desc="identity: reference", unit="prompt", disable=disable, dynamic_ncols=True):
        g = ref.generator.generate(p.ids, n_new, ignore_eos=True)
        top1, marg = top2(ref.generator.forced(p.ids, g.tokens))
        refs.append((g.tokens, top1.cpu(), marg.cpu()))
    del ref
    ref_f.release()

    cand = f.engine(max_ctx)
    tally = IdentityTally(margin)
    for p, (tokens, top1, marg) in zip(tqdm(prompts, desc="identity: candidate", unit="prompt", disable=disable,
                                            dynamic_ncols=True), refs):
        g = cand.generator.generate(p.ids, n_new, ignore_eos=True)
        c_top1, _ = top2(cand.generator.forced(p.ids, tokens))
        tally.add(tokens, g.tokens, top1, marg, c_top1)
    return tally.metrics(), {"workload": wl.describe(), "max_new_tokens": n_new, "reference": ref_f.describe()}
