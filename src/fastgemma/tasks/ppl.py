"""ppl: teacher-forced, token-weighted perplexity of the chosen config (window, quant, ... applied)
over a text corpus or a JSONL of {context_ids, target_ids}; see metrics/ppl.py."""
from __future__ import annotations

from tqdm.auto import tqdm

from ..metrics.ppl import PplEval, perplexity


def score(ctx) -> tuple[dict, dict]:
    f = ctx.factory
    ev = ctx.evaluation or PplEval()
    c = f.config
    tok = f.tokenizer() if ev.jsonl is None else None
    seqs = ev.sequences(tok, c.vocab_size, c.bos_id)
    total = sum(len(s.ids) - s.score_from for s in seqs)
    disable = (not ctx.progress) if ctx.progress is not None else None
    with tqdm(total=total, desc="ppl", unit="tok", disable=disable, dynamic_ncols=True) as bar:
        m = perplexity(f.model, seqs, chunk=ev.chunk, window=f.window, device=f.device, dtype=f.dtype,
                       progress=bar.update)
    return m, {**ev.describe(), "sequences": len(seqs)}


def run(ctx):
    metrics, details = score(ctx)
    return metrics, {"eval": details}
