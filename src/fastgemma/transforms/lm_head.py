"""Output head choices (the `lm_head` group): full | int8 | int4 | pruned.

The tied head is the embedding E [V, hidden]; logits = cap * tanh(E h / cap) in fp32 (cap 30 on
Gemma 4). E keeps serving the input embedding, so every head here works on its own copy:
- full: E as built (V x K x 2 bytes per token in bf16: 1.34 GB on E4B).
- int8: an untied int8 copy with one fp32 scale per row (V x (K + 4) bytes: 672 MB).
- int4: an untied W4A16 copy (fastgemma.kernels.w4a16, group G: V x K / 2 + 4 V K / G bytes: 356 MB at G 128).
- pruned: N kept rows (a keepset), dense / int8 / int4, logits only for those (12,288 x 2560 bf16 = 62.9 MB).

A head is installed as `model.logits_head` (an nn.Module, so its buffers count in
`metrics.memory.weight_bytes_per_step`): `head(hidden [..., K])` -> fp32 [..., V], kept logits at
their ids and -inf elsewhere; `head.pick(x [M, K], logits_out)` -> ids [M] (the fused sampler).
Pruned with scatter=false: compute_logits stays the full tied head (ppl and teacher-forced logits
unchanged) and the head is `model.pruned_head`, used only by sampler=fused_argmax (sparse argmax ->
original ids). With scatter=true every consumer sees the pruned head, so ppl is inf as soon as one
scored target falls outside the keepset: read the miss rate (metrics.head) instead.

Keepset: the N most frequent ids of a corpus tokenized with the model's tokenizer (pad / bos / eos
always in), or a file (one id per line, or a JSON list). Stored ascending, so ties in the argmax go
to the lowest id exactly as argmax over the full vocabulary does.
"""
from __future__ import annotations

import hashlib
import json
import warnings
import weakref
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

from ..checks import is_int, is_int_list
from ..kernels.sparse_argmax import (
    _INTERPRET, ROW_INVARIANT_CONFIG, head_argmax, head_argmax_op, head_argmax_torch, softcap_torch,
)
from ..kernels.w8a16 import quantize_int8_rows
from .head_predictions import NEAR
from .quant_int8 import ExactScales

_BACKENDS = ("auto", "triton", "torch")
_ROW_DTYPES = ("auto", "int8", "int4")
_SOURCES = ("corpus", "file", "predicted")


def _check_backend(backend: str) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"lm_head backend must be one of {_BACKENDS}, got {backend!r}")
    return backend


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and not (device.type == "cuda" or _INTERPRET):
        raise ValueError(f"lm_head backend=triton needs the model on a CUDA device, it is on {device}; "
                         "use backend=torch")
    return backend


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


# ---------------------------------------------------------------------------------------------
# head modules: rows of the output head, logits mapped back to vocabulary ids


class HeadRows(nn.Module):
    """Base: `rows` head rows for vocabulary ids `keep_ids` [N] int64 ascending (None: all V ids in order)."""

    kind = "dense"

    def __init__(self, vocab_size: int, softcap: float | None, keep_ids: torch.Tensor | None, backend: str):
        super().__init__()
        self.vocab_size, self.softcap, self.backend = vocab_size, softcap, backend
        self.register_buffer("keep_ids", keep_ids)

    @property
    def rows(self) -> int:
        return self.vocab_size if self.keep_ids is None else self.keep_ids.numel()

    def nbytes(self) -> int:
        """Bytes one decode step reads: the rows, their scales, the keep ids (8 N)."""
        return _nbytes(*self.buffers())

    def new_logits(self, M: int, device) -> torch.Tensor:
        """fp32 [M, V]: -inf where no row writes (pruned), uninitialised where every id is written."""
        if self.keep_ids is None:
            return torch.empty(M, self.vocab_size, device=device, dtype=torch.float32)
        return torch.full((M, self.vocab_size), float("-inf"), device=device, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., K] -> fp32 softcapped logits [..., V] (-inf outside the keepset)."""
        x = hidden.reshape(-1, hidden.shape[-1])
        out = self.new_logits(x.shape[0], x.device)
        self.pick(x, out, want_ids=False)
        return out.reshape(*hidden.shape[:-1], self.vocab_size)

    def pick(self, x: torch.Tensor, logits_out: torch.Tensor | None = None, backend: str | None = None,
             want_ids: bool = True, row_invariant: bool = False):
        """x [M, K] -> vocabulary ids [M] int64 of the argmax (taken before the softcap); fills
        logits_out [M, V] fp32 at the kept ids when given. backend: None = the head's own.
        row_invariant (fuse.batch_invariant): one kernel config at every M, so a row's logits do not
        depend on the rows beside it."""
        raise NotImplementedError


class DenseRows(HeadRows):
    """weight [N, K] in the model's dtype (a gathered copy for a pruned head; the embedding itself
    for the full head that sampler=fused_argmax reads)."""

    def __init__(self, weight, vocab_size, softcap, keep_ids=None, backend="torch"):
        super().__init__(vocab_size, softcap, keep_ids, backend)
        self.register_buffer("weight", weight)

    def pick(self, x, logits_out=None, backend=None, want_ids=True, row_invariant=False):
        return _dense_pick(x, self.weight, None, self.keep_ids, logits_out, self.softcap,
                           backend or self.backend, want_ids, row_invariant)


class Int8Rows(ExactScales, HeadRows):
    """qweight int8 [N, K] + scales fp32 [N]: w[n] ~= qweight[n] * scales[n] (symmetric, per row); the scales
    stay exactly fp32 through dtype casts (ExactScales)."""

    kind = "int8"

    def __init__(self, qweight, scales, vocab_size, softcap, keep_ids=None, backend="torch"):
        super().__init__(vocab_size, softcap, keep_ids, backend)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_weight(cls, w, vocab_size, softcap, keep_ids=None, backend="torch"):
        q, s = quantize_int8_rows(w)
        return cls(q, s, vocab_size, softcap, keep_ids, backend)

    def pick(self, x, logits_out=None, backend=None, want_ids=True, row_invariant=False):
        return _dense_pick(x, self.qweight, self.scales, self.keep_ids, logits_out, self.softcap,
                           backend or self.backend, want_ids, row_invariant)


class Int4Rows(HeadRows):
    """W4A16 rows (qweight uint8 [N, K/2], scales / zeros [K/G, N]; layout in kernels/int4_pack.py).
    A one-row pick on the Triton backend: the w4a16 GEMV with the argmax in its store, then the blocks'
    reduce (kernels/sparse_argmax.head_argmax_int4: the same ids and logits as the two-step path, no
    logits round trip); wider picks: the w4a16 GEMM, then argmax over [M, N] and a gather of keep_ids."""

    kind = "int4"

    def __init__(self, w, vocab_size, softcap, keep_ids=None, group_size: int = 128, backend="torch", codes=None,
                 clip_search: bool = False):
        """w [N, K] rounded to nearest (each group's range searched with clip_search), or `codes` = (codes
        [N, K], scales, zeros [K/G, N]) made elsewhere (GPTQ; w then gives only its dtype)."""
        from ..kernels.int4_pack import pack_int4, quantize_int4

        super().__init__(vocab_size, softcap, keep_ids, backend)
        q, s, z = codes if codes is not None else quantize_int4(w, group_size, clip_search=clip_search)
        self.group_size = group_size
        self.register_buffer("qweight", pack_int4(q))
        self.register_buffer("scales", s)
        self.register_buffer("zeros", z)

    def raw(self, x, backend=None):
        from ..kernels.w4a16 import w4a16_matmul_op, w4a16_torch

        # the registered op: torch.compile traces around the launcher
        fn = w4a16_matmul_op if (backend or self.backend) == "triton" else w4a16_torch
        y = fn(x.contiguous(), self.qweight, self.scales.to(x.dtype), self.zeros.to(x.dtype), self.group_size)
        return y.float()

    def pick(self, x, logits_out=None, backend=None, want_ids=True, row_invariant=False):
        if row_invariant:
            raise ValueError("an int4 head picks through the w4a16 GEMV, whose tiles follow the row count: not "
                             "batch-invariant (use lm_head=full, int8 or pruned)")
        if (backend or self.backend) == "triton" and x.shape[0] == 1:  # the GEMV's store picks
            from ..kernels.sparse_argmax import head_argmax_int4, head_argmax_int4_op

            s, z = self.scales.to(x.dtype), self.zeros.to(x.dtype)
            if logits_out is not None and want_ids:  # the decode path: an opaque op for torch.compile
                return head_argmax_int4_op(x.contiguous(), self.qweight, s, z, self.group_size, self.keep_ids,
                                           logits_out, float(self.softcap or 0.0))
            return head_argmax_int4(x, self.qweight, s, z, self.group_size, self.keep_ids, logits_out=logits_out,
                                    softcap=self.softcap, want_ids=want_ids)
        raw = self.raw(x, backend)  # [M, N], rounded to x's dtype like F.linear
        if logits_out is not None:
            y = softcap_torch(raw, self.softcap)
            if self.keep_ids is None:
                logits_out.copy_(y)
            else:
                logits_out.index_copy_(1, self.keep_ids, y)
        if not want_ids:
            return None
        idx = raw.argmax(-1)
        return self.keep_ids[idx] if self.keep_ids is not None else idx


def _dense_pick(x, w, scales, keep_ids, logits_out, softcap, backend, want_ids, row_invariant=False):
    if backend == "triton":
        if logits_out is not None and want_ids:  # the decode path: an opaque op for torch.compile
            return head_argmax_op(x, w, scales, keep_ids, logits_out, float(softcap or 0.0), True, row_invariant)
        return head_argmax(x, w, keep_ids, scales=scales, logits_out=logits_out, softcap=softcap, want_ids=want_ids,
                           config=ROW_INVARIANT_CONFIG if row_invariant else None)
    return head_argmax_torch(x, w, keep_ids, scales=scales, logits_out=logits_out, softcap=softcap, want_ids=want_ids)


class _LogitsThenArgmax:
    """A `logits_head` this module did not build: full logits, then argmax (no fused path)."""

    def __init__(self, model):
        self.model = model

    def pick(self, x, logits_out=None, backend=None, want_ids=True, row_invariant=False):
        if row_invariant:
            raise ValueError("a logits_head of another module: full logits through its own GEMM, not batch-invariant")
        y = self.model.compute_logits(x)
        if logits_out is not None:
            logits_out.copy_(y)
        return y.argmax(-1) if want_ids else None

    def new_logits(self, M, device):
        return torch.empty(M, self.model.config.vocab_size, device=device, dtype=torch.float32)


_TIED: "weakref.WeakKeyDictionary[nn.Module, DenseRows]" = weakref.WeakKeyDictionary()


def decode_head(model):
    """The head a greedy pick reads: the pruned head of scatter=false, else `model.logits_head`,
    else a view of the tied embedding (no copy)."""
    for name in ("pruned_head", "logits_head"):
        h = getattr(model, name, None)
        if isinstance(h, HeadRows):
            return h
    if getattr(model, "logits_head", None) is not None:
        return _LogitsThenArgmax(model)
    head = _TIED.get(model)
    w = model.embed_tokens.weight
    if head is None or head.weight.data_ptr() != w.data_ptr():
        c = model.config
        head = DenseRows(w.detach(), c.vocab_size, c.final_logit_softcap, None,
                         "triton" if w.is_cuda else "torch")
        _TIED[model] = head
    return head


# ---------------------------------------------------------------------------------------------
# keepsets


def keepset_hash(ids) -> str:
    """sha256 of the ascending ids as decimal text joined by ',' (first 16 hex digits)."""
    return hashlib.sha256(",".join(str(int(i)) for i in sorted(ids)).encode()).hexdigest()[:16]


def validate_keepset(ids, vocab_size: int, where: str = "keepset") -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError(f"{where} is empty: it needs at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{where}: {len(bad)} id(s) outside the vocabulary [0, {vocab_size}), e.g. {bad[0]}")
    dup = [i for i, n in Counter(ids).items() if n > 1]
    if dup:
        raise ValueError(f"{where}: {len(dup)} duplicate id(s), e.g. {dup[0]}")
    return ids


def read_keepset(path, vocab_size: int) -> list[int]:
    """A keepset file: one id per line (blank lines and '#' comments skipped) or a JSON list of ids.
    Order is kept (a file written by frequency is truncated from the end). Clear errors for ids
    outside [0, V), duplicates, non-integers and an empty file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"keepset file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    where = f"keepset file {path}"
    if text.lstrip().startswith("["):
        try:
            ids = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg} at line {err.lineno})") from None
        if not is_int_list(ids):
            raise ValueError(f"{where}: the JSON must be a list of integers")
    else:
        ids = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                ids.append(int(line))
            except ValueError:
                raise ValueError(f"{where}:{n}: {line!r} is not an integer token id") from None
    return validate_keepset(ids, vocab_size, where)


def write_keepset(path, ids) -> Path:
    """One id per line, in the given (priority) order."""
    path = Path(path)
    path.write_text("".join(f"{int(i)}\n" for i in ids))
    return path


def keepset_from_counts(counts: Counter, rows: int, vocab_size: int, always=(), then=()) -> tuple[list[int], int]:
    """(ids in priority order, how many were filled in): `always` first, then ids by count (ties:
    lower id first), then the ids of each Counter of `then` by its count, then, if the counts hold fewer
    than `rows` distinct ids, unseen ids ascending (BPE vocabularies number pieces roughly by merge rank, so
    low ids are the common ones)."""
    _check_rows(rows, vocab_size)
    always = list(dict.fromkeys(int(i) for i in always))
    validate_keepset(always or [0], vocab_size, "always-kept ids")
    if len(always) > rows:
        raise ValueError(f"rows={rows} cannot hold the {len(always)} always-kept ids {always}")
    tiers = [counts, *then]
    bad = [i for c in tiers for i in c if not 0 <= int(i) < vocab_size]
    if bad:
        raise ValueError(f"corpus ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]}: "
                         "wrong tokenizer for this model?")
    out, seen = list(always), set(always)
    for tier in tiers:
        for i, _ in sorted(tier.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(out) == rows:
                break
            if i not in seen:
                out.append(int(i))
                seen.add(int(i))
    n_corpus = len(out)
    i = 0
    while len(out) < rows:
        if i not in seen:
            out.append(i)
        i += 1
    return out, len(out) - n_corpus


def corpus_ids(path, tokenizer) -> list[int]:
    """Token ids of a corpus: a text file (tokenized without special tokens), or a .jsonl whose
    objects hold lists of ids (e.g. generated outputs: {"prompt_ids": [...], "output_ids": [...]})."""
    from ..workloads.corpus import read_corpus

    path = Path(path).expanduser()
    if path.suffix == ".jsonl":
        from ..workloads.ids_jsonl import _lines

        ids = []
        for _, obj in _lines(path):
            for v in obj.values():
                if is_int_list(v):
                    ids.extend(v)
        if not ids:
            raise ValueError(f"corpus {path}: no lists of token ids in its objects")
        return ids
    if tokenizer is None:
        raise ValueError(f"corpus {path} is text: building a keepset from it needs the model's tokenizer "
                         "(tokenizer=none)")
    return list(tokenizer.encode(read_corpus(path), add_special_tokens=False))


def _check_rows(rows, vocab_size: int):
    if not is_int(rows, 1):
        raise ValueError(f"rows must be a positive integer, got {rows!r}")
    if rows > vocab_size:
        raise ValueError(f"rows={rows} exceeds the vocabulary size {vocab_size}")


# ---------------------------------------------------------------------------------------------
# transforms


class FullHead:
    """The full-vocabulary tied head: apply() changes nothing."""

    needs_cuda = False

    def __init__(self):
        self._info: dict = {"lm_head": "full"}

    def apply(self, model):
        w = model.embed_tokens.weight
        self._info = {"lm_head": "full", "rows": w.shape[0], "dtype": str(w.dtype).replace("torch.", ""),
                      "head_bytes_per_token": _nbytes(w)}
        return model

    def describe(self) -> dict:
        return dict(self._info)


class _QuantHead:
    kind = ""

    def __init__(self, backend: str = "auto"):
        self.backend = _check_backend(backend)
        self._info: dict = {"lm_head": self.kind, "backend": backend}

    @property
    def needs_cuda(self) -> bool:
        return self.backend == "triton"

    def _rows(self, model, w, backend) -> HeadRows:
        raise NotImplementedError

    @torch.no_grad()
    def apply(self, model):
        w = model.embed_tokens.weight
        backend = _resolve_backend(self.backend, w.device)
        head = self._rows(model, w, backend)
        model.logits_head = head
        self._info = {"lm_head": self.kind, "backend": backend, "rows": head.rows, **self._extra(),
                      "head_bytes_per_token": head.nbytes(), "dense_head_bytes": _nbytes(w)}
        return model

    def _extra(self) -> dict:
        return {}

    def describe(self) -> dict:
        return dict(self._info)


class Int8Head(_QuantHead):
    """An untied int8 copy of the head, one fp32 scale per row (symmetric RTN)."""

    kind = "int8"

    def _rows(self, model, w, backend):
        return Int8Rows.from_weight(w, model.config.vocab_size, model.config.final_logit_softcap, None, backend)


def _head_gptq(method: str, calib, calib_tokens, calib_seq_len, damp, act_order, tokenizer, weights,
               calib_window=None):
    """GptqSettings for an int4 head (method gptq), None for rtn."""
    from .gptq import GptqSettings
    from .quant import METHODS

    if method not in METHODS:
        raise ValueError(f"lm_head.method must be one of {METHODS}, got {method!r}")
    return GptqSettings(calib, calib_tokens, calib_seq_len, damp, act_order, tokenizer, weights,
                        "lm_head", window=calib_window) if method == "gptq" else None


def _int4_rows(model, w, keep, group_size, backend, gptq, clip_search=False) -> tuple[Int4Rows, dict]:
    """Int4Rows of rows w, rounded to nearest or by GPTQ on the model's final hidden states."""
    c = model.config
    if w.shape[1] % group_size:
        raise ValueError(f"int4 head: group_size {group_size} does not divide hidden {w.shape[1]}")
    how = {"clip_search": bool(clip_search)}
    if gptq is None:
        rows = Int4Rows(w, c.vocab_size, c.final_logit_softcap, keep, group_size, backend, clip_search=clip_search)
        return rows, {"method": "rtn", **how}
    from .gptq import head_gptq

    *codes, facts = head_gptq(model, w, gptq, group_size, clip_search)
    rows = Int4Rows(w, c.vocab_size, c.final_logit_softcap, keep, group_size, backend, codes=codes)
    return rows, {"method": "gptq", **how, "gptq": facts}


class Int4Head(_QuantHead):
    """An untied W4A16 copy of the head (asymmetric, group `group_size` along hidden): rounded to nearest,
    or with method=gptq calibrated on the final hidden states over a text (transforms/gptq.py; the
    calib* / damp / act_order settings as quant=int4's, in the run's window)."""

    kind = "int4"

    def __init__(self, group_size: int = 128, backend: str = "auto", method: str = "rtn", calib=None,
                 calib_tokens: int = 8192, calib_seq_len: int = 512, damp: float = 0.01, act_order: bool = True,
                 tokenizer: str | None = "auto", weights=None, calib_window: int | None = None,
                 clip_search: bool = False):
        from ..kernels.int4_pack import check_group_size

        check_group_size(group_size)
        self.group_size, self.clip_search = group_size, bool(clip_search)
        self.gptq = _head_gptq(method, calib, calib_tokens, calib_seq_len, damp, act_order, tokenizer, weights,
                               calib_window)
        self._how: dict = {}
        super().__init__(backend)

    def _rows(self, model, w, backend):
        rows, self._how = _int4_rows(model, w, None, self.group_size, backend, self.gptq, self.clip_search)
        return rows

    def _extra(self):
        return {"group_size": self.group_size, **self._how}


class PrunedHead:
    """Keep `rows` head rows (a keepset), compute only their logits, map back to vocabulary ids.

    source=corpus: the `rows` most frequent ids of `corpus` (a text file, tokenized with the model's
    tokenizer, or a .jsonl of id lists; None: workloads.corpus.keepset_corpus_path()), with pad /
    bos / eos and `extra_ids` always in. source=predicted: the ids the model's full head picks most
    often over the calibration text (calib, calib_tokens, calib_seq_len, in calib_window), teacher-forced
    (transforms/head_predictions.py), then the ids most often among its `runners_up` runners-up there, then
    that text's most frequent ids. source=file: the ids in `keepset` (rows=null: all of them; otherwise the
    first `rows`). dtype: auto (the model's) | int8 | int4 rows. scatter: see the module docstring.
    tokenizer / weights: how the corpus is tokenized (the CLI's `tokenizer` spec
    and the weights node; `bind_tokenizer` overrides both)."""

    def __init__(self, rows: int | None = 12288, keepset: str | None = None, source: str = "corpus",
                 corpus: str | None = None, scatter: bool = True, dtype: str = "auto", group_size: int = 128,
                 backend: str = "auto", extra_ids=(), tokenizer: str | None = "auto", weights=None,
                 method: str = "rtn", calib=None, calib_tokens: int = 8192, calib_seq_len: int = 512,
                 damp: float = 0.01, act_order: bool = True, calib_window: int | None = None,
                 clip_search: bool = False, runners_up: int = NEAR):
        if source not in _SOURCES:
            raise ValueError(f"lm_head.source must be one of {_SOURCES}, got {source!r}")
        if source == "file" and not keepset:
            raise ValueError("lm_head.source=file needs lm_head.keepset=<file of token ids>")
        if source != "file" and keepset:
            raise ValueError(f"lm_head.keepset={keepset} is read with source=file; this head has source={source}")
        if not is_int(runners_up, 0):
            raise ValueError(f"lm_head.runners_up must be an integer >= 0, got {runners_up!r}")
        self.runners_up = runners_up
        if source == "predicted" and corpus:
            raise ValueError(f"lm_head.corpus={corpus} is read with source=corpus; source=predicted runs the model "
                             "over lm_head.calib (null: the default texts)")
        if dtype not in _ROW_DTYPES:
            raise ValueError(f"lm_head.dtype must be one of {_ROW_DTYPES}, got {dtype!r}")
        if rows is not None:
            _check_rows(rows, 2**62)
        elif source != "file":
            raise ValueError("lm_head.rows=null is only for source=file (keep every id of the file)")
        if dtype == "int4":
            from ..kernels.int4_pack import check_group_size

            check_group_size(group_size)
        self.rows, self.keepset, self.source, self.corpus = rows, keepset, source, corpus
        self.scatter, self.dtype, self.group_size = bool(scatter), dtype, group_size
        self.clip_search = bool(clip_search)
        self.backend = _check_backend(backend)
        self.extra_ids = tuple(int(i) for i in (extra_ids or ()))
        self.tokenizer_spec, self.weights = tokenizer, weights
        if method != "rtn" and dtype != "int4":
            raise ValueError(f"lm_head.method={method} applies to int4 rows (lm_head.dtype=int4), got dtype={dtype}")
        self.gptq = _head_gptq(method, calib, calib_tokens, calib_seq_len, damp, act_order, tokenizer, weights,
                               calib_window)
        # the text source=predicted runs the model over: the calibration settings, checked as GPTQ's are
        from .gptq import GptqSettings

        self.text = GptqSettings(calib, calib_tokens, calib_seq_len, damp, act_order, tokenizer, weights, "lm_head",
                                 window=calib_window) if source == "predicted" else None
        self._tokenizer = None
        self.priority: list[int] = []  # kept ids, most important first (write_keepset order)
        self._info: dict = {"lm_head": "pruned", "rows": rows, "keepset_source": source}

    @property
    def needs_cuda(self) -> bool:
        return self.backend == "triton"

    def bind_tokenizer(self, tokenizer):
        """The tokenizer of the loaded weights (the builder's), used for a text corpus."""
        self._tokenizer = tokenizer
        return self

    def _get_tokenizer(self, cfg):
        if self._tokenizer is not None:
            return self._tokenizer, "bound"
        from ..workloads.tokenizer import tokenizer_for

        tok = tokenizer_for(self.tokenizer_spec, self.weights, cfg)
        return tok, type(tok).__name__ if tok is not None else None

    def keep_ids(self, cfg, model=None) -> tuple[list[int], dict]:
        """(kept ids in priority order, facts for describe()) for a model config (source=predicted: and the
        model, its full head still in place)."""
        V = cfg.vocab_size
        if self.source == "predicted":
            return self._predicted(cfg, model)
        if self.source == "file":
            ids = read_keepset(self.keepset, V)
            if self.rows is not None:
                if self.rows > len(ids):
                    raise ValueError(f"lm_head.rows={self.rows} but keepset file {self.keepset} holds "
                                     f"{len(ids)} ids; set lm_head.rows=null or <= {len(ids)}")
                ids = ids[: self.rows]
            missing = [i for i in cfg.eos_ids if i not in set(ids)]
            if missing:
                warnings.warn(f"keepset {self.keepset} leaves out eos id(s) {missing}: greedy decode can never stop",
                              stacklevel=2)
            return ids, {"keepset": str(self.keepset)}
        _check_rows(self.rows, V)
        from ..workloads.corpus import keepset_corpus_path

        path = Path(self.corpus).expanduser() if self.corpus else keepset_corpus_path()
        tok, tok_name = (None, None) if path.suffix == ".jsonl" else self._get_tokenizer(cfg)
        toks = corpus_ids(path, tok)
        counts = Counter(toks)
        ids, filled, coverage = self._from_counts(cfg, counts)
        return ids, {"corpus": str(path), "tokenizer": tok_name, "corpus_tokens": len(toks),
                     "corpus_distinct": len(counts), "corpus_coverage": coverage, "filled": filled}

    def _from_counts(self, cfg, counts: Counter, then=()) -> tuple[list[int], int, float]:
        """keepset_from_counts with pad / bos / eos and extra_ids always in -> (ids, how many were filled in,
        the share of the counted occurrences whose id is kept)."""
        always = (cfg.pad_id, cfg.bos_id, *cfg.eos_ids, *self.extra_ids)
        ids, filled = keepset_from_counts(counts, self.rows, cfg.vocab_size, always, then=then)
        kept = set(ids)
        covered = sum(n for i, n in counts.items() if i in kept)
        return ids, filled, round(covered / max(1, sum(counts.values())), 6)

    def _predicted(self, cfg, model):
        from .gptq import text_sequences
        from .head_predictions import predicted_counts

        if model is None:
            raise ValueError("lm_head.source=predicted runs the model over a text: keep_ids needs the model")
        if self.runners_up >= cfg.vocab_size:
            raise ValueError(f"lm_head.runners_up={self.runners_up} leaves no pick in a vocabulary of {cfg.vocab_size}")
        t = self.text
        seqs, paths = text_sequences(cfg, t.calib, t.tokenizer, t.weights, t.calib_seq_len, t.calib_tokens, t.where)
        picks, near = predicted_counts(model, seqs, t.window, near=self.runners_up)
        text = Counter(i for s in seqs for i in s[1:])
        ids, filled, coverage = self._from_counts(cfg, picks, then=(near, text))
        return ids, {"calib": paths, "calib_seq_len": t.calib_seq_len, "calib_window": t.window or cfg.sliding_window,
                     "predicted_positions": sum(picks.values()), "predicted_distinct": len(picks),
                     "runners_up": self.runners_up, "runners_up_distinct": len(set(near) - set(picks)),
                     "predicted_coverage": coverage, "filled": filled}

    @torch.no_grad()
    def apply(self, model):
        c = model.config
        w = model.embed_tokens.weight
        ids, facts = self.keep_ids(c, model)
        self.priority = ids
        backend = _resolve_backend(self.backend, w.device)
        keep = torch.tensor(sorted(ids), dtype=torch.long, device=w.device)
        rows = w.index_select(0, keep)  # [N, K] gathered copy: the embedding is left as it is
        V, cap = c.vocab_size, c.final_logit_softcap
        if self.dtype == "int8":
            head = Int8Rows.from_weight(rows, V, cap, keep, backend)
        elif self.dtype == "int4":
            head, how = _int4_rows(model, rows, keep, self.group_size, backend, self.gptq, self.clip_search)
            facts = {**facts, **how}
        else:
            head = DenseRows(rows, V, cap, keep, backend)
        del rows
        if self.scatter:
            model.logits_head = head
        else:
            model.pruned_head = head  # only sampler=fused_argmax reads it
        self._info = {"lm_head": "pruned", "rows": head.rows, "vocab": V, "dtype": head.kind if self.dtype != "auto"
                      else str(w.dtype).replace("torch.", ""), "backend": backend, "scatter": self.scatter,
                      "head_bytes_per_token": head.nbytes(), "dense_head_bytes": _nbytes(w),
                      "keepset_source": self.source, "keepset_hash": keepset_hash(ids), **facts}
        return model

    def describe(self) -> dict:
        return dict(self._info)
