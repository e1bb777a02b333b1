"""Weight quantization of the body's nn.Linear layers (the `quant` group): bf16 | int4 | nf4.

Each transform swaps modules in place after the model is built and returns the model;
`describe()` reports what it did. Only nn.Linear layers are touched: the tied embedding / LM head
is an nn.Embedding (and any Linear sharing its weight is left alone), so a head transform owns it.
Merge projections (q|k|v, gate|up) before quantizing, so the merged matrices are what gets quantized.
Int4Linear modules already in the model (a compressed-tensors int4 checkpoint, weights/compressed.py)
are never re-quantized: bf16 keeps them and says so, int4 only moves them to its backend.
"""
from __future__ import annotations

import fnmatch
import logging
import warnings

import torch
import torch.nn as nn

from fastgemma.kernels.int4_pack import (
    GROUP_SIZES, check_group_size, pack_int4, pack_scale_zero, quantize_int4, unpack_int4,
)
from fastgemma.kernels.w4a16 import w4a16_matmul, w4a16_matmul_op, w4a16_torch
from fastgemma.kernels.w4a16_table import W4A16Config

log = logging.getLogger(__name__)


def _triton(x, qweight, scales, zeros, group_size, config=None, sz=None):
    # the registered op when the dispatch table decides (torch.compile-safe), the launcher for overrides
    if config is None:
        return w4a16_matmul_op(x, qweight, scales, zeros, group_size, sz)
    return w4a16_matmul(x, qweight, scales, zeros, group_size, config, sz=sz)


_BACKENDS = {"triton": _triton, "torch": w4a16_torch}


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"int4 backend must be one of {sorted(_BACKENDS)}, got {backend!r}")


class Int4Linear(nn.Module):
    """W4A16 linear: packed int4 weight [N, K/2] uint8 + per-group scales / zeros [K/G, N]
    (layout in fastgemma.kernels.w4a16). forward(x [..., K]) -> [..., N] in x's dtype.

    With 16-bit scales the module also holds `sz`, their `pack_scale_zero` words (int32 [K/G, N], not
    saved in state dicts): the per-group kernel of multi-row launches (the verify pass, prompt chunks)
    reads one word per row and group. It is rebuilt by `set_scales`, `load_state_dict` and moves /
    casts (`_apply`): change scales only through those. It adds N * K / G * 4 bytes of memory (~124 MB
    for the E4B body at g128), not bytes per token (a launch reads one copy or the other)."""

    derived_buffers = ("sz", "mma_words", "mma_sz")  # copies of other buffers: not bytes a step reads

    def __init__(self, in_features: int, out_features: int, group_size: int = 128, bias: bool = False,
                 backend: str = "triton", dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        check_group_size(group_size)
        _check_backend(backend)
        if in_features % group_size:
            raise ValueError(f"int4 group_size {group_size} does not divide K={in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.backend = group_size, backend
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(in_features // group_size, out_features, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.zeros(in_features // group_size, out_features, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.register_buffer("sz", None, persistent=False)  # packed once scales are set (set_scales, loads, moves)
        # the tensor-core kernel's copy (kernels/mma_w4a16.py), after enable_mma(); rebuilt as sz is
        self.register_buffer("mma_words", None, persistent=False)
        self.register_buffer("mma_sz", None, persistent=False)
        self.mma = False
        self.mma_pairs = False  # the copy in the paired GeGLU layout (mma_w4a16.pair_order; enable_mma(pairs=True))
        self.config: W4A16Config | None = None  # tile override; None -> the kernel's dispatch table
        self._matmul = _BACKENDS[backend]

    def _pack_sz(self) -> None:
        s, z = self.scales, self.zeros
        packable = s.dtype in (torch.bfloat16, torch.float16) and z.dtype == s.dtype and s.shape == z.shape
        self.sz = pack_scale_zero(s, z) if packable else None
        if self.mma:
            self._pack_mma()

    def mma_supported(self) -> bool:
        from fastgemma.kernels.mma_w4a16 import MMA_GROUPS

        return (self.group_size in MMA_GROUPS and self.out_features % 16 == 0 and self.bias is None
                and self.scales.dtype == torch.bfloat16 and self.sz is not None)

    def enable_mma(self, pairs: bool = False) -> bool:
        """Also hold the weights in kernels/mma_w4a16.py's fragment order (a second copy: N * K / 2 +
        N * K / G * 4 bytes of memory) for its 1..8-row launches; pairs: a GeGLU weight [gate; up] in the
        paired layout (`mma_w4a16.pair_order`, for configs with `pairs`). -> False (nothing held) where its
        format does not apply (group size, N % 16, bias, scales / zeros not both bf16)."""
        self.mma, self.mma_pairs = self.mma_supported(), pairs
        self._pack_mma()
        return self.mma

    def disable_mma(self) -> None:
        """Drop the fragment-order copy (its memory); the other kernels never read it."""
        self.mma = False
        self._pack_mma()

    def _pack_mma(self) -> None:
        from fastgemma.kernels.mma_w4a16 import pack_mma, pack_mma_sz

        if not (self.mma and self.mma_supported()):
            self.mma, self.mma_words, self.mma_sz = False, None, None
            return
        # bf16 scales: `sz` holds their packed words already (_pack_sz runs first)
        self.mma_words = pack_mma(unpack_int4(self.qweight), self.mma_pairs)
        self.mma_sz = pack_mma_sz(self.sz, self.mma_pairs)

    def set_scales(self, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Replace scales and zeros ([K/G, N] each) and rebuild `sz`."""
        shape = (self.in_features // self.group_size, self.out_features)
        if tuple(scales.shape) != shape or tuple(zeros.shape) != shape:
            raise ValueError(f"scales / zeros must be {list(shape)}, got {list(scales.shape)} / {list(zeros.shape)}")
        self.scales, self.zeros = scales, zeros
        self._pack_sz()

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() convert the scales; the packed copy follows them
        out = super()._apply(fn, recurse)
        self._pack_sz()
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        # load_state_dict copies scales / zeros in place: repack after it
        super()._load_from_state_dict(*args, **kwargs)
        self._pack_sz()

    def set_backend(self, backend: str) -> None:
        _check_backend(backend)
        self.backend, self._matmul = backend, _BACKENDS[backend]

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int, backend: str = "triton",
                    clip_search: bool = False) -> "Int4Linear":
        """Round to nearest (kernels/int4_pack.quantize_int4; clip_search: each group's range searched)."""
        return cls.from_codes(linear, *quantize_int4(linear.weight, group_size, clip_search=clip_search), group_size,
                              backend)

    @classmethod
    @torch.no_grad()
    def from_codes(cls, linear: nn.Linear, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, backend: str = "triton") -> "Int4Linear":
        """The layer for `linear` from codes [N, K] and scales / zeros [K/G, N] made elsewhere (GPTQ)."""
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, group_size, linear.bias is not None,
                  backend, dtype=w.dtype, device=w.device)
        mod.qweight.copy_(pack_int4(q))
        mod.set_scales(scales, zeros)
        if linear.bias is not None:
            mod.bias = linear.bias.detach().clone()
        return mod

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features), self.qweight, self.scales, self.zeros,
                         self.group_size, self.config, sz=self.sz)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, backend={self.backend}")


# ---------------------------------------------------------------------------------------------
# selection and swapping


def _matches(name: str, pattern: str) -> bool:
    return pattern in name or fnmatch.fnmatchcase(name, pattern)


def _select(model: nn.Module, skip, who: str):
    """-> (targets [(name, Linear)], skipped names). Skips names matching a pattern and Linears
    whose weight is another module's parameter (a tied head); warns for patterns matching nothing."""
    tied = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    targets, skipped, used = [], [], set()
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        hits = [p for p in skip if _matches(name, p)]
        if hits or id(mod.weight) in tied:
            used.update(hits)
            skipped.append(name)
        else:
            targets.append((name, mod))
    for p in skip:
        if p not in used:
            warnings.warn(f"{who}: skip pattern {p!r} matches no nn.Linear in the model", stacklevel=3)
    return targets, skipped


def _swap(model: nn.Module, new: dict[int, nn.Module]) -> nn.Module:
    # by identity, so a Linear shared by several parents is replaced everywhere
    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if id(child) in new:
                setattr(parent, cname, new[id(child)])
    return new.get(id(model), model)


def _dense_bytes(mod: nn.Linear) -> int:
    return mod.weight.numel() * mod.weight.element_size()


def _loaded_int4(model: nn.Module) -> list[Int4Linear]:
    return [m for m in model.modules() if isinstance(m, Int4Linear)]


def _loaded_info(int4: list[Int4Linear]) -> dict:
    """What the checkpoint brought in int4 (empty for a dense checkpoint)."""
    if not int4:
        return {}
    return {"checkpoint_int4_layers": len(int4), "checkpoint_int4_params": sum(m.in_features * m.out_features for m in int4),
            "checkpoint_int4_bytes": sum(m.weight_bytes() for m in int4),
            "checkpoint_group_size": sorted({m.group_size for m in int4})}


# ---------------------------------------------------------------------------------------------
# transforms


_DENSE_BACKENDS = ("torch", "triton")


def _check_dense_backend(backend: str) -> None:
    if backend not in _DENSE_BACKENDS:
        raise ValueError(f"quant=bf16 backend must be one of {list(_DENSE_BACKENDS)}, got {backend!r}")


class NoQuant:
    """quant=bf16: the model keeps its weights as loaded. A compressed-tensors int4 checkpoint's
    packed layers stay int4 (dequantizing them would only cost memory and speed), and describe()
    says so: quant "int4 (checkpoint)", with the layer count and bytes.
    backend: torch (F.linear: cuBLAS on a GPU) | triton (one-row inputs through our GEMV,
    fastgemma.kernels.gemv; wider inputs stay on F.linear; CUDA only)."""

    def __init__(self, backend: str = "torch"):
        _check_dense_backend(backend)
        self.backend = backend
        self._info: dict = {"quant": "bf16", "backend": backend}

    def apply(self, model: nn.Module) -> nn.Module:
        from .gemv import use_gemv

        lins = [m for m in model.modules() if isinstance(m, nn.Linear)]
        int4 = _loaded_int4(model)
        gemv_layers = use_gemv(model) if self.backend == "triton" else 0
        self._info = {"quant": "int4 (checkpoint)" if int4 else "bf16", "backend": self.backend,
                      "gemv_layers": gemv_layers,
                      "quantized_params": sum(m.in_features * m.out_features for m in int4),
                      "weight_bytes": sum(_dense_bytes(m) for m in lins) + sum(m.weight_bytes() for m in int4),
                      **_loaded_info(int4)}
        return model

    def describe(self) -> dict:
        return dict(self._info)


METHODS = ("rtn", "gptq")


class Int4Quant:
    """quant=int4: every nn.Linear whose qualified name matches no `skip` pattern (substring or
    fnmatch) becomes an Int4Linear (W4A16, asymmetric, group `group_size` along K). Int4Linear
    layers loaded from a checkpoint keep their codes and group size; only their backend is set.
    With backend=triton the layers left dense run one-row inputs through our GEMV (as quant=bf16
    backend=triton does).

    method: rtn (round to nearest, from the weights alone) | gptq (transforms/gptq.py: calibrated on
    `calib_tokens` tokens of `calib` in sequences of `calib_seq_len`, Hessian damping `damp`, the columns in
    descending order of their inputs' energy with `act_order` (each group's range fixed beforehand), the sliding
    layers keeping `calib_window` keys (the run's window; None: the model's own), a layer's linears on its inputs
    or with `true_sequential` each on the quantized ones before it in the layer; the text is tokenized with
    `tokenizer` / `weights` as the pruned head's keepset text is). The same format and kernels either way.
    clip_search: each group's range searched (kernels/int4_pack.group_range) instead of its min / max, for
    either method."""

    def __init__(self, group_size: int = 128, skip=("per_layer_input_gate",), backend: str = "triton",
                 method: str = "rtn", calib: str | None = None, calib_tokens: int = 8192, calib_seq_len: int = 512,
                 damp: float = 0.01, act_order: bool = True, tokenizer: str | None = "auto", weights=None,
                 cache: bool = True, calib_window: int | None = None, true_sequential: bool = False,
                 clip_search: bool = False):
        from .gptq import GptqSettings

        check_group_size(group_size)
        _check_backend(backend)
        if method not in METHODS:
            raise ValueError(f"quant.method must be one of {METHODS}, got {method!r}")
        self.group_size, self.backend, self.method = group_size, backend, method
        self.clip_search = bool(clip_search)
        self.skip = tuple(skip or ())
        self.gptq = GptqSettings(calib, calib_tokens, calib_seq_len, damp, act_order, tokenizer, weights,
                                 "quant", cache, calib_window, true_sequential) if method == "gptq" else None
        self._info: dict = {"quant": "int4", "group_size": group_size, "backend": backend, "method": method}

    def _gptq(self, model, targets) -> tuple[dict, dict]:
        """The targets' codes by GPTQ (transforms/gptq.py), or from the cache (transforms/gptq_cache.py).
        -> ({name: (codes, scales, zeros)}, facts for describe())."""
        from . import gptq_cache
        from .gptq import gptq_model

        g = self.gptq
        seqs, facts = g.sequences(model.config)
        names = [n for n, _ in targets]
        settings = {"group_size": self.group_size, "damp": g.damp, "act_order": g.act_order,
                    "window": facts["calib_window"], "true_sequential": g.true_sequential,
                    "clip_search": self.clip_search}
        key = gptq_cache.key(model, names, settings, seqs) if g.cache else None
        hit = gptq_cache.load(key, model.embed_tokens.weight.device) if key else None
        if hit is not None and set(hit[0]) == set(names):
            codes, stored, path = hit
            log.info("gptq: %d linears from the cache %s", len(names), path)
            return codes, {**stored, "cache": str(path), "cache_hit": True}
        codes, made = gptq_model(model, targets, seqs, self.group_size, g.damp, g.act_order, window=g.window,
                                 true_sequential=g.true_sequential, clip_search=self.clip_search)
        facts.update(made)
        if key:
            path = gptq_cache.save(key, codes, facts)
            facts.update(cache=str(path) if path else None, cache_hit=False)
        return codes, facts

    @torch.no_grad()
    def apply(self, model: nn.Module) -> nn.Module:
        targets, skipped = _select(model, self.skip, "Int4Quant")
        # validate every layer before touching any, so a bad group size leaves the model intact
        for name, mod in targets:
            if mod.in_features % self.group_size:
                raise ValueError(f"int4 group_size {self.group_size} does not divide K={mod.in_features} "
                                 f"of layer '{name}' ({mod.out_features}x{mod.in_features}); "
                                 f"pick a group size in {GROUP_SIZES} that divides it or add it to skip")
        loaded = _loaded_int4(model)
        for mod in loaded:
            mod.set_backend(self.backend)
        info = {"quant": "int4", "group_size": self.group_size, "backend": self.backend, "method": self.method,
                "clip_search": self.clip_search,
                "quantized_layers": len(targets), "quantized_params": sum(m.weight.numel() for _, m in targets),
                "dense_weight_bytes": sum(_dense_bytes(m) for _, m in targets), "skipped": skipped,
                **_loaded_info(loaded)}
        if self.method == "gptq" and targets:
            codes, info["gptq"] = self._gptq(model, targets)
            new = {id(mod): Int4Linear.from_codes(mod, *codes[name], self.group_size, self.backend)
                   for name, mod in targets}
        else:
            new = {id(mod): Int4Linear.from_linear(mod, self.group_size, self.backend, self.clip_search)
                   for _, mod in targets}
        model = _swap(model, new)
        info["weight_bytes"] = sum(m.weight_bytes() for m in new.values())
        self._info = info
        if self.backend == "triton":  # the layers left dense (skip list) take our GEMV at one row
            from .gemv import use_gemv

            self._info["gemv_layers"] = use_gemv(model)
        return model

    def describe(self) -> dict:
        return dict(self._info)


class Nf4Quant:
    """quant=nf4: bitsandbytes Linear4bit (NF4, blocks of 64, compute dtype = the model's dtype), on
    CUDA or the CPU (bitsandbytes >= 0.46 quantizes and runs 4-bit layers on CPU tensors).
    A memory / quality baseline: on the H200 an E4B step with the nf4 body (bitsandbytes 0.50.2) takes
    4.52 ms against 3.42 for int4 and 3.59 for the fused bf16 step (bench.stack, full head)."""

    needs_cuda = False

    def __init__(self, skip=("per_layer_input_gate",), compress_statistics: bool = False):
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ImportError("quant=nf4 needs the bitsandbytes package, which is not installed: "
                              "pip install 'fastgemma[nf4]'") from e
        self._bnb = bnb
        self.skip = tuple(skip or ())
        self.compress_statistics = compress_statistics
        self._info: dict = {"quant": "nf4"}

    @torch.no_grad()
    def apply(self, model: nn.Module) -> nn.Module:
        bnb = self._bnb
        targets, skipped = _select(model, self.skip, "Nf4Quant")
        old_bnb = tuple(int(p) for p in bnb.__version__.split(".")[:2]) < (0, 46)
        for name, mod in targets:
            dev = mod.weight.device.type
            if dev not in ("cuda", "cpu") or (dev == "cpu" and old_bnb):
                raise ValueError(f"quant=nf4 runs on CUDA, or on the CPU with bitsandbytes >= 0.46 "
                                 f"(installed: {bnb.__version__}); layer '{name}' is on {mod.weight.device}")
        new = {}
        for _, mod in targets:
            w = mod.weight
            q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                  compute_dtype=w.dtype, compress_statistics=self.compress_statistics,
                                  quant_type="nf4", device="meta")
            # Params4bit quantizes (bnb.functional.quantize_4bit) on its first move to a device
            q.weight = bnb.nn.Params4bit(w.data, requires_grad=False, quant_type="nf4", blocksize=64,
                                         compress_statistics=self.compress_statistics).to(w.device)
            if w.dtype == torch.float32:
                # trap: on an AVX512-BF16 CPU, bitsandbytes >= 0.49 repacks the weight for a kernel that
                # casts activations and absmax to bf16; an fp32 run stays dequantize_4bit + fp32 matmul
                q.support_avx512bf16_for_cpu = False
            if mod.bias is not None:
                q.bias = nn.Parameter(mod.bias.data, requires_grad=False)
            new[id(mod)] = q
        self._info = {
            "quant": "nf4", "compress_statistics": self.compress_statistics,
            "quantized_layers": len(targets),
            "quantized_params": sum(m.weight.numel() for _, m in targets),
            "weight_bytes": sum(_nf4_bytes(q) for q in new.values()),
            "dense_weight_bytes": sum(_dense_bytes(m) for _, m in targets),
            "skipped": skipped,
            **_loaded_info(_loaded_int4(model)),
        }
        return _swap(model, new)

    def describe(self) -> dict:
        return dict(self._info)


def _nf4_bytes(q: nn.Module) -> int:
    # packed nibbles + absmax
    return q.weight.numel() * q.weight.element_size() + nf4_stat_bytes(q.weight)


def nf4_stat_bytes(weight) -> int:
    """Bytes of a bitsandbytes 4-bit weight's absmax statistics (fp32 per 64, or uint8 + a second
    level when compress_statistics); 0 for any other tensor. They live in its quant state, not in
    parameters or buffers."""
    n = 0
    qs = getattr(weight, "quant_state", None)
    while qs is not None:
        absmax = getattr(qs, "absmax", None)
        n += 0 if absmax is None else absmax.numel() * absmax.element_size()
        qs = getattr(qs, "state2", None)
    return n
