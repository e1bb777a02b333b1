"""quant=int8: the body's nn.Linear layers as W8A16 (int8 codes, one fp32 scale per output row, symmetric
round-to-nearest; kernels/w8a16.py). Half the bytes of bf16 at a fraction of int4's error: on Gemma 3 270M,
every linear in this format left perplexity at 15.280 against 15.287 and top-1 agreement at 0.977, where int4
g128 took it to 25.353 and 0.742 (README, quality).

fuse=layers runs them at one row through kernels/fused_w8a16.py (the norms, residuals, GeGLU and PLE gate in
the GEMV, as for bf16 and int4; no fuse.batch_invariant form); fuse=merged (merged q|k|v and gate|up, quantized
after merging) and the captured / compiled steps take them too.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from fastgemma.kernels.w8a16 import quantize_int8_rows, w8a16_matmul_op, w8a16_torch

from .quant import _dense_bytes, _loaded_info, _loaded_int4, _select, _swap

_BACKENDS = {"triton": w8a16_matmul_op, "torch": w8a16_torch}


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"int8 backend must be one of {sorted(_BACKENDS)}, got {backend!r}")


class ExactScales(nn.Module):
    """A module whose fp32 `scales` buffer (int8 rows' per-row scales) takes a model's device moves but not its
    dtype casts: model.to(bf16) casts floating buffers, and the codes were quantized against the exact values.
    Int8Linear here, the int8 head rows (transforms/lm_head.Int8Rows)."""

    def _apply(self, fn, recurse=True):
        scales = self.scales
        out = super()._apply(fn, recurse)
        if self.scales.dtype != torch.float32:
            self.scales = scales.to(self.scales.device)
        return out


class Int8Linear(ExactScales):
    """W8A16 linear: qweight int8 [N, K] + scales fp32 [N] (w[n] ~= qweight[n] * scales[n]).
    forward(x [..., K]) -> [..., N] in x's dtype. The scales stay exactly fp32 through dtype casts (ExactScales)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, backend: str = "triton",
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        _check_backend(backend)
        self.in_features, self.out_features, self.backend = in_features, out_features, backend
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self._matmul = _BACKENDS[backend]

    def set_backend(self, backend: str) -> None:
        _check_backend(backend)
        self.backend, self._matmul = backend, _BACKENDS[backend]

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, backend: str = "triton") -> "Int8Linear":
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, backend, dtype=w.dtype,
                  device=w.device)
        mod.qweight, mod.scales = quantize_int8_rows(w)
        if linear.bias is not None:
            mod.bias = linear.bias.detach().clone()
        return mod

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features), self.qweight, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"


class Int8Quant:
    """quant=int8: every nn.Linear whose qualified name matches no `skip` pattern (substring or fnmatch)
    becomes an Int8Linear. Int4Linear layers a checkpoint brought stay as they are (describe() counts them)."""

    def __init__(self, skip=(), backend: str = "triton"):
        _check_backend(backend)
        self.backend, self.skip = backend, tuple(skip or ())
        self._info: dict = {"quant": "int8", "backend": backend}

    @torch.no_grad()
    def apply(self, model: nn.Module) -> nn.Module:
        targets, skipped = _select(model, self.skip, "Int8Quant")
        new = {id(mod): Int8Linear.from_linear(mod, self.backend) for _, mod in targets}
        self._info = {
            "quant": "int8", "backend": self.backend,
            "quantized_layers": len(targets),
            "quantized_params": sum(m.weight.numel() for _, m in targets),
            "weight_bytes": sum(m.weight_bytes() for m in new.values()),
            "dense_weight_bytes": sum(_dense_bytes(m) for _, m in targets),
            "skipped": skipped,
            **_loaded_info(_loaded_int4(model)),
        }
        return _swap(model, new)

    def describe(self) -> dict:
        return dict(self._info)
