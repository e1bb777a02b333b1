"""Prompt sets for bench and identity: synthetic ids with a length profile, fixed lengths, or a file.

The challenge profile (PROTOCOL.md): 128 prompts, median 230 and mean 272 tokens, about 80 to 1500.
Lengths are the quantiles of a log-normal with that median and mean (sigma = sqrt(2 ln(mean/median))
= 0.58), clipped to [min, max] and shuffled with the seed: the same 128 lengths on every machine.
Token ids are uniform over the vocabulary minus the special ids, after a BOS; or, with `corpus`,
consecutive slices of a text through the model's tokenizer (real text for real weights: identity
rates on random ids say little about a trained model). Warm-up prompts come from a separate random
stream: never the benchmark's own prompts.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

from .ids_jsonl import read_prompts_jsonl


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None


@dataclass
class Workload:
    name: str
    num_prompts: int
    max_new_tokens: int
    warmup: int = 0
    seed: int = 0
    ignore_eos: bool = True
    concurrency: int = 1
    lengths: list[int] | None = None          # explicit prompt lengths, cycled to num_prompts
    length_profile: dict | None = None        # {median, mean, min, max}: log-normal quantiles
    prompts_file: str | None = None           # JSONL of {prompt_ids | context_ids | text}
    corpus: str | None = None                 # with lengths / length_profile: slices of this text
                                              # ("default": workloads.corpus.default_corpus_path())
    _file_rows: list = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.num_prompts < 1:
            raise ValueError(f"workload {self.name}: num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_new_tokens < 1:
            raise ValueError(f"workload {self.name}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.warmup < 0:
            raise ValueError(f"workload {self.name}: warmup must be >= 0, got {self.warmup}")
        if self.concurrency != 1:
            raise ValueError(f"workload {self.name}: concurrency {self.concurrency} is not supported; "
                             "the engine decodes one request at a time (concurrency 1)")
        sources = [s for s in (self.lengths, self.length_profile, self.prompts_file) if s]
        if len(sources) != 1:
            raise ValueError(f"workload {self.name}: give exactly one of lengths, length_profile, prompts_file")
        if self.lengths is not None:
            self.lengths = [int(n) for n in self.lengths]
            if min(self.lengths) < 1:
                raise ValueError(f"workload {self.name}: prompt lengths must be >= 1, got {self.lengths}")
        if self.prompts_file is not None:
            path = Path(self.prompts_file).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"workload {self.name}: prompts_file {path} does not exist")
            self._file_rows = read_prompts_jsonl(path)
        if self.corpus is not None:
            if self.prompts_file is not None:
                raise ValueError(f"workload {self.name}: corpus slices take their lengths from lengths or "
                                 "length_profile, not from a prompts_file")
            from .corpus import default_corpus_path

            path = default_corpus_path() if self.corpus == "default" else Path(self.corpus).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"workload {self.name}: corpus file {path} does not exist")
            self.corpus = str(path)

    @property
    def needs_tokenizer(self) -> bool:
        return bool(self.prompts_file or self.corpus)

    # ---- lengths -------------------------------------------------------------------------------
    def prompt_lengths(self) -> list[int]:
        if self.lengths is not None:
            return [self.lengths[i % len(self.lengths)] for i in range(self.num_prompts)]
        if self.length_profile is not None:
            return profile_lengths(self.num_prompts, seed=self.seed, **self.length_profile)
        return [len(r["ids"]) if r.get("ids") is not None else -1 for r in self._rows()]

    def _rows(self):
        rows = self._file_rows
        return [rows[i % len(rows)] for i in range(self.num_prompts)]

    # ---- prompts -------------------------------------------------------------------------------
    def prompts(self, vocab_size: int, bos_id: int, special=(), tokenizer=None) -> list[Prompt]:
        if self._file_rows is not None:
            return [self._file_prompt(r, vocab_size, tokenizer) for r in self._rows()]
        if self.corpus is not None:
            if tokenizer is None:
                raise ValueError(f"workload {self.name}: prompts cut from corpus {self.corpus} need a tokenizer; "
                                 "the weights have none (set tokenizer=<dir> or tokenizer=bytes)")
            from .corpus import read_corpus
            from .tokenizer import encode_plain

            return corpus_prompts(encode_plain(tokenizer, read_corpus(self.corpus)), self.prompt_lengths(), bos_id)
        return synthetic_prompts(self.prompt_lengths(), vocab_size, bos_id, special, seed=self.seed)

    def warmup_prompts(self, vocab_size: int, bos_id: int, special=()) -> list[Prompt]:
        """Synthetic prompts of the median benchmark length, from their own random stream."""
        if not self.warmup:
            return []
        lens = sorted(n for n in self.prompt_lengths() if n > 0) or [64]
        median = lens[len(lens) // 2]
        return synthetic_prompts([median] * self.warmup, vocab_size, bos_id, special, seed=self.seed + 7919)

    def max_context(self, prompts: list[Prompt]) -> int:
        return max(len(p.ids) for p in prompts) + self.max_new_tokens

    def _file_prompt(self, row: dict, vocab_size: int, tokenizer) -> Prompt:
        if row.get("ids") is not None:
            bad = [t for t in row["ids"] if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{self.prompts_file}:{row['line']}: token id {bad[0]} is outside "
                                 f"the vocabulary [0, {vocab_size})")
            return Prompt(list(row["ids"]))
        if tokenizer is None:
            raise ValueError(f"{self.prompts_file}:{row['line']}: a text prompt needs a tokenizer; the "
                             "weights have none (set tokenizer=<dir> or tokenizer=bytes)")
        from .tokenizer import encode

        return Prompt(encode(tokenizer, row["text"]), text=row["text"])

    def describe(self) -> dict:
        lens = [n for n in self.prompt_lengths() if n > 0]
        d = {"name": self.name, "num_prompts": self.num_prompts, "max_new_tokens": self.max_new_tokens,
             "warmup": self.warmup, "seed": self.seed, "ignore_eos": self.ignore_eos,
             "concurrency": self.concurrency}
        if lens:
            d.update(prompt_len_min=min(lens), prompt_len_max=max(lens),
                     prompt_len_mean=round(sum(lens) / len(lens), 1),
                     prompt_len_median=sorted(lens)[len(lens) // 2])
        if self.prompts_file:
            d["prompts_file"] = str(self.prompts_file)
        if self.corpus:
            d["corpus"] = str(self.corpus)
        return d


def profile_lengths(n: int, *, median: float, mean: float, min: int, max: int, seed: int = 0) -> list[int]:
    """n log-normal quantiles with this median and mean, clipped to [min, max], shuffled by seed."""
    if not (0 < min <= median <= max) or mean < median:
        raise ValueError(f"length profile needs 0 < min <= median <= max and mean >= median; got "
                         f"median={median} mean={mean} min={min} max={max}")
    sigma = math.sqrt(2 * math.log(mean / median))
    z = NormalDist()
    lo, hi = int(min), int(max)
    lens = [round(median * math.exp(sigma * z.inv_cdf((i + 0.5) / n))) for i in range(n)]
    lens = [lo if x < lo else hi if x > hi else int(x) for x in lens]
    random.Random(seed).shuffle(lens)
    return lens


def synthetic_prompts(lengths: list[int], vocab_size: int, bos_id: int, special=(), seed: int = 0) -> list[Prompt]:
    """BOS + uniform ids over [0, vocab) minus the special ids; prompt i of length lengths[i]."""
    rng = random.Random(seed)
    banned = set(special) | {bos_id}
    out = []
    for n in lengths:
        ids = [bos_id]
        while len(ids) < n:
            t = rng.randrange(vocab_size)
            if t not in banned:
                ids.append(t)
        out.append(Prompt(ids[:n]))
    return out


def corpus_prompts(text_ids: list[int], lengths: list[int], bos_id: int) -> list[Prompt]:
    """BOS + the next lengths[i] - 1 ids of the text, prompt after prompt (wrapping around at its end)."""
    if not text_ids:
        raise ValueError("corpus prompts: the text has no tokens")
    out, at = [], 0
    for n in lengths:
        body = [text_ids[(at + j) % len(text_ids)] for j in range(n - 1)]
        at = (at + n - 1) % len(text_ids)
        out.append(Prompt([bos_id] + body))
    return out
