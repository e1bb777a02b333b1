"""GPTQ for int4 weights (`quant=int4 quant.method=gptq`, `lm_head=int4 lm_head.method=gptq`, pruned int4
rows): the same W4A16 format as round-to-nearest (kernels/int4_pack: a float scale and zero per group of G
consecutive k), so kernels, bytes and speed are unchanged; only which codes are stored differs.

Each linear W [N, K] is quantized one input column at a time; the rounding error of a column is spread
over the columns not yet quantized through the inverse Hessian of the layer's inputs, H = X^T X / n over
calibration tokens (Frantar et al., "GPTQ", 2022, with its lazy blocks of 128 columns). Left to right, a
group's scale and zero are taken from its columns as they stand when the group starts (min / max of the
error-updated weights). With act_order the columns go in descending order of H's diagonal and each
group's scale and zero are fixed first from the raw weights (RTN's); the codes go back to the weight's
column order, so either way the groups stay contiguous along K, as the kernels read them.

Calibration is one prompt forward of the model over the calibration sequences as one batch
(`calibration_sequences`; a shorter last one padded in front, its pads in no Hessian). A decoder layer first
runs on its own float weights, its linears taking their Hessians from that run's inputs, then they are
quantized and the layer runs again on the int4 values for the layers after it: so layer i's linears see
layers 0..i-1 quantized and their own layer as it was. With true_sequential each linear is quantized when
the forward first reaches it, so the quantized q / k / v feed o's Hessian and gate / up down's (AutoGPTQ's
`true_sequential`). Linears outside the layers (the PLE model projection) go first, on the embeddings.
One forward, so its activations (and a linear's fp32 input rows) grow with the calibration tokens: 8,192
by default. A head's rows take the final hidden states of a prompt forward over the same text
(`head_gptq`), through the body as quantized.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..checks import is_int
from ..kernels.gptq_columns import columns, loop_for
from ..kernels.int4_pack import check_group_size, dequantize_codes, group_range, quantize_int4, scale_zero

log = logging.getLogger(__name__)

BLOCK = 128  # columns updated lazily at a time (GPTQ's B); a multiple of every group size


class HessianError(ValueError):
    """A Hessian that stays singular after damping, or a layer that saw no calibration input."""


def _inverse_upper(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of H^-1 after adding damp * mean(diag H) to the diagonal; the damping
    grows tenfold (up to four times) while H is not positive definite. -> (factor, damping used)."""
    mean = float(torch.diag(H).mean())
    if not math.isfinite(mean) or mean <= 0:
        raise HessianError(f"Hessian with mean diagonal {mean}: the layer saw no (finite) calibration input")
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for _ in range(5):
        L, info = torch.linalg.cholesky_ex(H + damp * mean * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U, damp
        damp *= 10
    raise HessianError(f"Hessian not positive definite even with damping {damp / 10:g} x its mean diagonal")


@torch.no_grad()
def gptq_int4(w: torch.Tensor, H: torch.Tensor, group_size: int, damp: float = 0.01,
              scale_dtype: torch.dtype | None = None, act_order: bool = False, clip_search: bool = False,
              loop=None):
    """w [N, K], H [K, K] (X^T X / n of its inputs) -> (codes [N, K] uint8, scales [K/G, N], zeros [K/G, N]),
    the format of `quantize_int4`. Input columns that never fired (H's diagonal 0) are rounded as RTN
    rounds them and pass no error on. fp32 arithmetic on w's device.

    act_order: the columns taken in descending order of H's diagonal (the strongest inputs first, while
    the most columns are left to absorb their error), each group's scale and zero fixed beforehand from
    the raw weights (RTN's: "static groups"), so the groups stay contiguous along K as the kernels read them.
    clip_search: each group's range by int4_pack's clip search instead of its min / max.
    The rounding within each block of BLOCK columns: loop, by default kernels/gptq_columns.columns (one launch on
    CUDA, its twin elsewhere; columns_torch / columns_triton its two paths, same arguments)."""
    loop = loop or columns
    check_group_size(group_size)
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide K={K}")
    if tuple(H.shape) != (K, K):
        raise ValueError(f"Hessian {tuple(H.shape)} does not match a weight of K={K}")
    if scale_dtype is None:
        scale_dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float32
    W = w.detach().float().clone()
    H = H.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    if act_order:
        _, scales, zeros = quantize_int4(w, group_size, scale_dtype, clip_search)
        scales, zeros = scales.clone(), zeros.clone()
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
        group_of = perm // group_size
    else:
        scales = torch.empty(K // group_size, N, dtype=scale_dtype, device=W.device)
        zeros = torch.empty_like(scales)
        perm = None
    U = _inverse_upper(H, damp)[0].contiguous()
    codes = torch.empty(N, K, dtype=torch.uint8, device=W.device)  # in the order the columns are taken
    sf, zf = scales.float(), zeros.float()
    for i1 in range(0, K, BLOCK):
        i2 = min(i1 + BLOCK, K)
        W1, U1, Q1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2], codes[:, i1:i2]
        E1 = torch.zeros_like(W1)
        if act_order:  # each column on its own group's range, fixed beforehand
            g = group_of[i1:i2]
            loop(W1, U1, sf[g], zf[g], 0, i2 - i1, Q1, E1)
        else:  # each group's range as its columns stand when it starts (i1 % G == 0, BLOCK % G == 0)
            for j in range(0, i2 - i1, group_size):
                g = (i1 + j) // group_size
                lo, hi = group_range(W1[:, j:j + group_size], scale_dtype, clip_search)
                scales[g], zeros[g] = scale_zero(lo, hi, scale_dtype)
                s, z = (t[g].float()[None, :].expand(group_size, N) for t in (scales, zeros))
                loop(W1, U1, s, z, j, j + group_size, Q1, E1)
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes, scales, zeros


def output_error(w: torch.Tensor, wq: torch.Tensor, H: torch.Tensor) -> float:
    """trace((W - Wq) H (W - Wq)^T): the summed squared output error over the calibration inputs, / n."""
    d = w.float() - wq.float()
    return float(((d @ H.float()) * d).sum())


def errors(w: torch.Tensor, wq: torch.Tensor, H: torch.Tensor, group_size: int,
           clip_search: bool = False) -> tuple[float, float]:
    """(output_error of wq, output_error of round-to-nearest's codes for w, on the same ranges) on the same inputs."""
    rtn = dequantize_codes(*quantize_int4(w, group_size, clip_search=clip_search), group_size)
    return output_error(w, wq, H), output_error(w, rtn, H)


# ---- calibration -----------------------------------------------------------------------------------


def calibration_sequences(ids: list[int], seq_len: int, tokens: int, bos_id: int) -> list[list[int]]:
    """Consecutive windows of <bos> + seq_len - 1 ids, at most `tokens` ids in all (<bos> counted)."""
    if seq_len < 2:
        raise ValueError(f"quant.calib_seq_len must be >= 2, got {seq_len}")
    if tokens < seq_len:
        raise ValueError(f"quant.calib_tokens={tokens} is below one sequence (calib_seq_len={seq_len})")
    n = seq_len - 1
    seqs = [[bos_id] + ids[i:i + n] for i in range(0, len(ids), n)]
    seqs = [s for s in seqs if len(s) > 1]
    out, left = [], tokens
    for s in seqs:
        if left < 2:
            break
        out.append(s[:left])
        left -= len(out[-1])
    if not out:
        raise ValueError("the calibration text gave no tokens")
    return out


def _unseen(name: str) -> HessianError:
    return HessianError(f"layer '{name}' saw no calibration input (is it called by the model's forward?)")


class _Quantizer:
    """Forward pre-hooks on the target linears. When the calibration forward first reaches a linear, its
    input rows (the real ones: `real` [B, T] leaves out the pads) give its Hessian, GPTQ gives its codes,
    and its weight takes their dequantized values before the forward goes on, so every linear reached
    later sees its inputs through the quantized ones. Linears fed the same tensor (q / k / v, gate / up)
    share one Hessian.

    true_sequential=False: a pre-hook on each decoder layer first runs the layer as it stands (the layers
    before it quantized, its own weights not), its linears' hooks only taking their Hessians, quantizes all
    of them, and lets the forward run the layer again on the int4 values (its cache writes are overwritten
    by the second run's; the ring's slots count as empty until the forward ends). Linears outside the layers
    go as with True."""

    def __init__(self, model, targets, real: torch.Tensor, group_size: int, damp: float, act_order: bool, bar,
                 true_sequential: bool = True, clip_search: bool = False):
        self.real, self.bar = real, bar
        self.group_size, self.damp, self.act_order, self.clip_search = group_size, damp, act_order, clip_search
        self.done: dict[str, tuple] = {}
        self.err = {"gptq": 0.0, "rtn": 0.0}
        self.by_kind: dict[str, list[float]] = {}
        self._last: tuple | None = None  # (input tensor, its Hessian)
        self._taken: dict[str, torch.Tensor] | None = None  # a layer's Hessians while it runs on its own weights
        self._handles = [lin.register_forward_pre_hook(self._hook(name, lin)) for name, lin in targets]
        if not true_sequential:
            for i, layer in enumerate(model.layers):
                mine = [(n, m) for n, m in targets if n.startswith(f"layers.{i}.")]
                if mine:
                    self._handles.append(layer.register_forward_pre_hook(self._layer_hook(mine), with_kwargs=True))

    def _hessian(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self._last is not None and self._last[0] is x:
            return self._last[1]
        if tuple(x.shape[:-1]) != tuple(self.real.shape):
            raise HessianError(f"layer '{name}' got input {tuple(x.shape)} in the calibration forward; GPTQ "
                               f"takes each linear's rows as [batch, tokens, features] = {tuple(self.real.shape)} "
                               "+ [features]")
        rows = x.detach()[self.real].float()
        H = rows.t() @ rows / rows.shape[0]
        self._last = (x, H)
        return H

    def _quantize(self, name: str, lin: nn.Module, H: torch.Tensor):
        w = lin.weight
        codes, scales, zeros = gptq_int4(w, H, self.group_size, self.damp, act_order=self.act_order,
                                         clip_search=self.clip_search)
        wq = dequantize_codes(codes, scales, zeros, self.group_size)
        e_gptq, e_rtn = errors(w, wq, H, self.group_size, self.clip_search)
        kind = self.by_kind.setdefault(name.rsplit(".", 1)[-1], [0.0, 0.0])
        for i, (k, e) in enumerate((("gptq", e_gptq), ("rtn", e_rtn))):
            self.err[k] += e
            kind[i] += e
        # what the forward reads from here on: this layer's int4 values, through its own dense matmul
        # (as fast as the float model's; the kernels' own rounding of them differs by ulps)
        w.copy_(wq.to(w.dtype))
        self.done[name] = (codes, scales, zeros)
        self.bar.update(1)

    def _hook(self, name: str, lin: nn.Module):
        def hook(_module, args):
            if name in self.done:  # a second call: its codes are already set
                return
            H = self._hessian(name, args[0])
            if self._taken is not None:
                self._taken[name] = H
            else:
                self._quantize(name, lin, H)
        return hook

    def _layer_hook(self, mine):
        def hook(layer, args, kwargs):
            self._taken = {}
            try:
                layer.forward(*args, **kwargs)
            finally:
                taken, self._taken = self._taken, None
            for name, lin in mine:
                if name not in taken:
                    raise _unseen(name)
                self._quantize(name, lin, taken.pop(name))
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()
        self._last = None


def _batch(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences as one prompt batch: (ids, pos, real) [B, T], a shorter sequence padded in front
    with pads at the position after it (as Generator._pad: no real row sees them); `real` marks its rows."""
    T = max(len(s) for s in seqs)
    ids, pos, real = [], [], []
    for s in seqs:
        n = len(s)
        ids.append([0] * (T - n) + list(s))
        pos.append([n] * (T - n) + list(range(n)))
        real.append([False] * (T - n) + [True] * n)
    as_t = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    return as_t(ids, torch.long), as_t(pos, torch.long), as_t(real, torch.bool)


def prompt_hidden(model, seqs: list[list[int]], window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's prompt forward over the sequences as one batch on a fresh cache sized to them, the
    sliding layers keeping `window` keys (None: the model's own) -> (final hidden [B, T, hidden], real [B, T])."""
    batch = _batch(seqs, model.embed_tokens.weight.device)
    return _forward(model, batch, window), batch[2]


def _forward(model, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], window: int | None) -> torch.Tensor:
    """The prompt forward over a `_batch` on a fresh cache sized to it -> final (normed) hidden [B, T, hidden]."""
    from ..engine.cache import KVCache

    ids, pos, _ = batch
    w = model.embed_tokens.weight
    cache = KVCache(model.config, ids.shape[0], ids.shape[1], window=window, device=w.device, dtype=w.dtype)
    return model(ids, pos, cache, start=0, need="all")


@torch.no_grad()
def gptq_model(model, targets, seqs, group_size: int, damp: float = 0.01, act_order: bool = False,
               progress=None, window: int | None = None, true_sequential: bool = False,
               clip_search: bool = False) -> tuple[dict, dict]:
    """Quantize `targets` [(name, nn.Linear)] of an engine model in one prompt forward over the calibration
    sequences (sliding layers keeping `window` keys, None: the model's own), each linear when the forward
    reaches it, or with true_sequential=False each decoder layer's linears together from the layer's
    inputs (`_Quantizer`); a quantized linear's weight holds its dequantized int4 values. clip_search: the
    groups' ranges by int4_pack's clip search.
    -> ({name: (codes, scales, zeros)}, facts for describe(): sequences, tokens, seconds, and the output
    error against RTN's (sum over linears of trace(dW H dW^T), GPTQ / RTN), overall and per kind of linear)."""
    from tqdm.auto import tqdm

    if not hasattr(model, "layers") or not hasattr(model, "embed_tokens"):
        raise ValueError(f"quant.method=gptq calibrates through the engine's Gemma model; got {type(model).__name__}")
    t0 = time.perf_counter()
    batch = _batch(seqs, model.embed_tokens.weight.device)
    bar = tqdm(total=len(targets), desc="gptq", unit="linear", disable=progress is False or None,
               dynamic_ncols=True)
    q = _Quantizer(model, targets, batch[2], group_size, damp, act_order, bar, true_sequential, clip_search)
    try:
        _forward(model, batch, window)
    finally:
        q.remove()
        bar.close()
    missing = [n for n, _ in targets if n not in q.done]
    if missing:
        raise _unseen(missing[0])
    seconds = time.perf_counter() - t0
    err = q.err
    ratio = err["gptq"] / err["rtn"] if err["rtn"] > 0 else None
    log.info("gptq: %d linears in one forward, %d sequences, %.1f s; output error vs RTN %.3f",
             len(targets), len(seqs), seconds, ratio or float("nan"))
    return q.done, {"calib_sequences": len(seqs), "calib_tokens": sum(len(s) for s in seqs),
                    "gptq_s": round(seconds, 2), "column_loop": loop_for(batch[0]).__name__,
                    "error_vs_rtn": None if ratio is None else round(ratio, 4),
                    "error_vs_rtn_by_kind": {k: round(g / r, 4) if r > 0 else None
                                             for k, (g, r) in sorted(q.by_kind.items())}}


def calibration_ids(corpus: str | None, tokenizer, where: str = "quant") -> tuple[list[int], list[str]]:
    """Token ids of the calibration text: `corpus` (a text file, or a .jsonl of id lists), else the
    Debian licence texts of workloads.corpus.calibration_corpus_paths(), concatenated. -> (ids, paths)."""
    from ..workloads.corpus import calibration_corpus_paths
    from .lm_head import corpus_ids

    paths = [Path(corpus).expanduser()] if corpus else calibration_corpus_paths()
    ids = []
    for p in paths:
        if p.suffix != ".jsonl" and tokenizer is None:
            raise ValueError(f"{where}.method=gptq calibrates on the text {p}: it needs the model's tokenizer "
                             f"(tokenizer=none), or {where}.calib=<a .jsonl of token id lists>")
        ids.extend(corpus_ids(p, tokenizer))
    return ids, [str(p) for p in paths]


@dataclass
class GptqSettings:
    """What GPTQ calibrates on and how, checked when made. `where`: the config group named in errors
    (quant, lm_head); tokenizer / weights: how a text corpus is tokenized (workloads.tokenizer_for);
    cache: the body's codes reused from disk when the weights, settings and text are the same."""
    calib: str | None = None
    calib_tokens: int = 8192
    calib_seq_len: int = 512
    damp: float = 0.01
    act_order: bool = True
    tokenizer: str | None = "auto"
    weights: object = None
    where: str = "quant"
    cache: bool = True  # the body's codes kept on disk (transforms/gptq_cache.py)
    window: int | None = None  # the sliding layers' window during calibration (None: the model's own)
    true_sequential: bool = False  # each linear on inputs through its layer's linears before it, quantized

    def __post_init__(self):
        w = self.where
        if not is_int(self.calib_seq_len, 2):
            raise ValueError(f"{w}.calib_seq_len must be an integer >= 2, got {self.calib_seq_len!r}")
        if not is_int(self.calib_tokens, self.calib_seq_len):
            raise ValueError(f"{w}.calib_tokens must be an integer >= calib_seq_len ({self.calib_seq_len}), "
                             f"got {self.calib_tokens!r}")
        if isinstance(self.damp, bool) or not isinstance(self.damp, (int, float)) or not 0 < self.damp < 1:
            raise ValueError(f"{w}.damp must be in (0, 1) (a share of the Hessian's mean diagonal), got {self.damp!r}")
        if self.window is not None and not is_int(self.window, 1):
            raise ValueError(f"{w}.calib_window must be a positive integer or null (the model's own window), "
                             f"got {self.window!r}")
        self.damp, self.act_order = float(self.damp), bool(self.act_order)
        self.true_sequential = bool(self.true_sequential)

    def sequences(self, cfg) -> tuple[list[list[int]], dict]:
        """(calibration sequences, facts for describe()) for a model config."""
        seqs, paths = text_sequences(cfg, self.calib, self.tokenizer, self.weights, self.calib_seq_len,
                                     self.calib_tokens, self.where)
        return seqs, {"calib": paths, "calib_seq_len": self.calib_seq_len, "damp": self.damp,
                      "act_order": self.act_order, "calib_window": self.window or cfg.sliding_window,
                      "true_sequential": self.true_sequential}


def text_sequences(cfg, calib: str | None, tokenizer, weights, seq_len: int, tokens: int,
                   where: str = "quant") -> tuple[list[list[int]], list[str]]:
    """The calibration text (`calib`, or the default licence texts) as sequences of <bos> + seq_len - 1 ids,
    `tokens` ids in all, tokenized by the run's tokenizer spec -> (sequences, the texts' paths)."""
    from ..workloads.tokenizer import tokenizer_for

    jsonl = calib is not None and str(calib).endswith(".jsonl")
    tok = None if jsonl else tokenizer_for(tokenizer, weights, cfg)
    ids, paths = calibration_ids(calib, tok, where)
    return calibration_sequences(ids, seq_len, tokens, cfg.bos_id), paths


@torch.no_grad()
def final_hessian(model, seqs, window: int | None = None) -> torch.Tensor:
    """X^T X / n of the model's final (normed) hidden states over the sequences: the head's inputs."""
    h, real = prompt_hidden(model, seqs, window)
    h = h[real].float()
    return h.t() @ h / h.shape[0]


def head_gptq(model, w: torch.Tensor, settings: GptqSettings, group_size: int, clip_search: bool = False):
    """GPTQ of head rows w [N, hidden] on the model's final hidden states over the calibration text.
    -> (codes, scales, zeros, facts for describe())."""
    t0 = time.perf_counter()
    seqs, facts = settings.sequences(model.config)
    H = final_hessian(model, seqs, settings.window)
    codes, scales, zeros = gptq_int4(w, H, group_size, settings.damp, act_order=settings.act_order,
                                     clip_search=clip_search)
    e_gptq, e_rtn = errors(w, dequantize_codes(codes, scales, zeros, group_size), H, group_size, clip_search)
    ratio = e_gptq / e_rtn if e_rtn > 0 else None
    facts.update(calib_sequences=len(seqs), calib_tokens=sum(len(s) for s in seqs),
                 gptq_s=round(time.perf_counter() - t0, 2), column_loop=loop_for(w).__name__,
                 error_vs_rtn=None if ratio is None else round(ratio, 4))
    log.info("gptq head: %d rows, %.1f s; output error vs RTN %.3f", w.shape[0], facts["gptq_s"],
             ratio or float("nan"))
    return codes, scales, zeros, facts
