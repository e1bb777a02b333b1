"""Teacher-forced, token-weighted perplexity: exp(total NLL / total scored tokens).

Inputs: (a) a text corpus, tokenized once and cut into windows of BOS + seq_len - 1 text tokens,
every text token scored; (b) the challenge's JSONL of {context_ids, target_ids}, targets scored
given their context. Each sequence runs through the model in chunks over a fresh cache sized to it
(`model(..., need="all")`), and the fp32 log-softmax is taken per chunk: at most chunk x vocab x 4
bytes live at once (E4B, chunk 256: 256 MiB), never the whole sequence's.

With a pruned head (lm_head=pruned) the same pass counts, over the scored positions:
`prune_target_miss`, the share of targets outside the keepset (a scattered head gives them -inf,
so ppl is inf as soon as one occurs), and, when compute_logits still returns the full head's logits
(lm_head.scatter=false), `prune_miss_rate`: the share whose full-head argmax is outside the keepset
(metrics/head.py), i.e. where the pruned greedy pick differs from the plain model's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.cache import KVCache


@dataclass
class Scored:
    ids: list[int]      # the whole sequence: context + targets
    score_from: int     # ids[score_from:] are scored (>= 1)


class PplEval:
    """The `eval=ppl` choice: where the scored tokens come from and how they are chunked."""

    def __init__(self, corpus: str | None = None, jsonl: str | None = None, seq_len: int = 1024,
                 chunk: int = 256, max_tokens: int | None = None):
        if seq_len < 2:
            raise ValueError(f"eval.seq_len must be >= 2, got {seq_len}")
        if chunk < 1:
            raise ValueError(f"eval.chunk must be >= 1, got {chunk}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"eval.max_tokens must be >= 1 or null, got {max_tokens}")
        self.jsonl = Path(jsonl).expanduser() if jsonl else None
        if self.jsonl is not None:
            if not self.jsonl.is_file():
                raise FileNotFoundError(f"eval.jsonl: JSONL file {self.jsonl} does not exist")
            self.corpus = None
        else:
            from ..workloads.corpus import default_corpus_path

            self.corpus = Path(corpus).expanduser() if corpus else default_corpus_path()
            if not self.corpus.is_file():
                raise FileNotFoundError(f"eval.corpus: corpus file {self.corpus} does not exist")
        self.seq_len, self.chunk, self.max_tokens = seq_len, chunk, max_tokens

    def sequences(self, tokenizer, vocab_size: int, bos_id: int) -> list[Scored]:
        if self.jsonl is not None:
            from ..workloads.ids_jsonl import read_ppl_jsonl

            seqs = [Scored(c + t, len(c)) for c, t in read_ppl_jsonl(self.jsonl, vocab_size)]
        else:
            if tokenizer is None:
                raise ValueError("eval=ppl over a text corpus needs a tokenizer; the weights have none "
                                 "(set tokenizer=<dir>, tokenizer=bytes, or eval.jsonl=<ids file>)")
            from ..workloads.corpus import read_corpus
            from ..workloads.tokenizer import encode_plain

            seqs = text_windows(encode_plain(tokenizer, read_corpus(self.corpus)), self.seq_len, bos_id)
        return cap_tokens(seqs, self.max_tokens)

    def describe(self) -> dict:
        return {"source": str(self.jsonl or self.corpus), "format": "jsonl" if self.jsonl else "text",
                "seq_len": self.seq_len, "chunk": self.chunk, "max_tokens": self.max_tokens}


def text_windows(ids: list[int], seq_len: int, bos_id: int) -> list[Scored]:
    """Non-overlapping windows: [BOS] + seq_len - 1 text tokens, every text token scored."""
    n = seq_len - 1
    return [Scored([bos_id] + ids[i:i + n], 1) for i in range(0, len(ids), n) if ids[i:i + n]]


def cap_tokens(seqs: list[Scored], max_tokens: int | None) -> list[Scored]:
    if max_tokens is None:
        return seqs
    out, left = [], max_tokens
    for s in seqs:
        if left <= 0:
            break
        n = len(s.ids) - s.score_from
        if n > left:
            s = Scored(s.ids[: s.score_from + left], s.score_from)
            n = left
        out.append(s)
        left -= n
    return out


def head_keepset(model) -> tuple[torch.Tensor | None, bool]:
    """(kept ids of a pruned head or None, whether compute_logits returns the full head's logits)."""
    pruned = getattr(model, "pruned_head", None)  # lm_head.scatter=false: only the sampler uses it
    if pruned is not None and getattr(pruned, "keep_ids", None) is not None:
        return pruned.keep_ids, True
    return getattr(getattr(model, "logits_head", None), "keep_ids", None), False


@torch.inference_mode()
def sequence_nll(model, seq: Scored, *, chunk: int, window: int | None, device, dtype,
                 misses: dict | None = None) -> tuple[float, int]:
    """(sum of -log p(ids[t] | ids[:t]) over t >= score_from, count), in float64. With a pruned head,
    `misses` (a dict) accumulates "target" and, for a full compute_logits, "argmax" misses."""
    ids = torch.as_tensor(seq.ids, dtype=torch.long, device=device)
    inputs, targets = ids[:-1], ids[1:]        # hidden row j predicts ids[j + 1]
    first = seq.score_from - 1                 # first scored row
    T = inputs.shape[0]
    cache = KVCache(model.config, 1, T, window=window, device=device, dtype=dtype)
    keep, full = head_keepset(model) if misses is not None else (None, False)
    total, count = 0.0, 0
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        pos = torch.arange(start, end, device=device)[None]
        need = "all" if end > first else "none"
        h = model(inputs[None, start:end], pos, cache, start=start, need=need)
        if need == "none":
            continue
        lo = max(start, first)
        logits = model.compute_logits(h[0, lo - start:])              # fp32 [n, V]
        lp = F.log_softmax(logits.float(), dim=-1)
        nll = -lp.gather(1, targets[lo:end, None]).squeeze(1)
        total += float(nll.double().sum())
        count += end - lo
        if keep is not None:
            misses["target"] = misses.get("target", 0) + int((~torch.isin(targets[lo:end], keep)).sum())
            if full:
                misses["argmax"] = misses.get("argmax", 0) + int((~torch.isin(logits.argmax(-1), keep)).sum())
    return total, count


def perplexity(model, seqs: list[Scored], *, chunk: int, window: int | None, device, dtype, progress=None) -> dict:
    """Token-weighted over all sequences. progress: an optional callable(tokens) per sequence."""
    nll, n, misses = 0.0, 0, {}
    for s in seqs:
        a, b = sequence_nll(model, s, chunk=chunk, window=window, device=device, dtype=dtype, misses=misses)
        nll += a
        n += b
        if progress:
            progress(b)
    if n == 0:
        raise ValueError("perplexity: no scored tokens")
    out = {"ppl": round(math.exp(nll / n), 6), "nll_mean": round(nll / n, 6), "ppl_tokens": n,
           "ppl_sequences": len(seqs)}
    if "argmax" in misses:
        out["prune_miss_rate"] = round(misses["argmax"] / n, 6)
    if "target" in misses:
        out["prune_target_miss"] = round(misses["target"] / n, 6)
    return out
