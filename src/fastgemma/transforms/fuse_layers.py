"""`fuse=layers`: merged projections, and a one-row decode step whose GEMVs carry the layer's
elementwise work (kernels/fused_gemv.py).

Per layer at one row, five GEMVs with their neighbours folded in, then the PLE projection:

    q|k|v    <- prologue: residual += post_per_layer_norm(previous PLE projection) (x layer scalar),
                then input_layernorm (layer 0: input_layernorm of the embedding)
    o        <- the attention output as is
    gate|up  <- prologue: residual += post_attention_layernorm(o), then pre_feedforward_layernorm;
                epilogue: gelu_tanh(gate) * up
    down     <- the GeGLU output as is
    PLE gate <- prologue: residual += post_feedforward_layernorm(down); epilogue: gelu_tanh(.) * PLE input
    PLE proj <- the gated PLE input as is

q/k/v norms, RoPE, the cache writes and the attention are the static step's own (compiled, they
fuse among themselves). Models without PLE carry the MLP's residual into the next q|k|v instead.
The step's rows decide it when the step is traced: one row (batch 1 decode) takes this path,
wider steps (the verify pass, batches) the ordinary one.
Linears may be dense 16-bit (`fused_gemv`) or Int4Linear (quant=int4: `fused_w4a16`), each layer
as it is; other kinds (nf4) are refused in one line (use fuse=merged).
`pdl=True` launches every fused GEMV with programmatic dependent launch (sm90+).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .fuse import MergeProjections


def _linear(mod: nn.Module, name: str):
    """A linear the fused step can read: dense bias-free nn.Linear (incl. GemvLinear) or Int4Linear."""
    from .gemv import GemvLinear
    from .quant import Int4Linear

    if (type(mod) is nn.Linear or type(mod) is GemvLinear or type(mod) is Int4Linear) and mod.bias is None:
        return mod
    raise ValueError(f"fuse=layers runs bias-free dense or int4 linears through its fused GEMVs; {name} is "
                     f"{type(mod).__name__}: use fuse=merged")


def fused_decode(model, ids, pos, cache, gemv, gemv4, pdl: bool = False):
    """One-row static step -> final-norm hidden [1, 1, hidden]. gemv / gemv4: the dense / int4
    fused ops (fused_gemv_op, fused_w4a16_op) or their twins."""
    from .quant import Int4Linear

    c = model.config
    eps, off = c.rms_eps, c.norm_offset
    x, ple = model.embed(ids)
    store_attend = model.step_store_attend(ids, pos, cache)

    def call(a, mod, y=None, post=None, scale=None, pre=None, aux=None, epilogue="none"):
        if isinstance(mod, Int4Linear):
            return gemv4(a, mod.qweight, mod.scales, mod.zeros, mod.group_size, y, post, scale, pre, aux, eps, off,
                         epilogue, pdl)
        return gemv(a, mod.weight, y, post, scale, pre, aux, eps, off, epilogue, pdl)

    h = x.reshape(1, -1)
    pend = None  # a residual update not yet applied: (res, y, post, scale): h = (res + rmsnorm(y) * post) * scale
    for i, layer in enumerate(model.layers):
        at, s = layer.self_attn, layer.spec
        w_in = _linear(at.qkv_proj if s.stores_kv else at.q_proj, f"layers.{i}.self_attn")
        pre = layer.input_layernorm.weight
        if pend is None:
            qkv, _ = call(h, w_in, pre=pre)
        else:
            qkv, h = call(pend[0], w_in, pend[1], pend[2], pend[3], pre)
        nq, nkv, d = at.num_heads * at.head_dim, at.num_kv_heads * at.head_dim, at.head_dim
        cos, sin = store_attend.rope[s.sliding]
        q = qkv[:, :nq].reshape(1, 1, at.num_heads, d)
        if s.stores_kv:
            k = qkv[:, nq:nq + nkv].reshape(1, 1, at.num_kv_heads, d)
            v = qkv[:, nq + nkv:].reshape(1, 1, at.num_kv_heads, d)
            q, k, v = at.finish(q, k, v, cos, sin)
        else:
            q, k, v = at.finish(q, None, None, cos, sin)
        o, _ = call(store_attend(layer, q, k, v).reshape(1, -1), _linear(at.o_proj, f"layers.{i}.self_attn.o_proj"))
        act, h = call(h, _linear(layer.mlp.gate_up_proj, f"layers.{i}.mlp.gate_up_proj"), o,
                      layer.post_attention_layernorm.weight, None, layer.pre_feedforward_layernorm.weight,
                      epilogue="geglu")
        dn, _ = call(act, _linear(layer.mlp.down_proj, f"layers.{i}.mlp.down_proj"))
        if layer.ple:
            g, h = call(h, _linear(layer.per_layer_input_gate, f"layers.{i}.per_layer_input_gate"), dn,
                        layer.post_feedforward_layernorm.weight, aux=ple[0, 0, i], epilogue="gelu_mul")
            pp, _ = call(g, _linear(layer.per_layer_projection, f"layers.{i}.per_layer_projection"))
            pend = (h, pp, layer.post_per_layer_input_norm.weight, layer.layer_scalar)
        else:
            pend = (h, dn, layer.post_feedforward_layernorm.weight, layer.layer_scalar)
    last = model.layers[-1]
    norm = last.post_per_layer_input_norm if last.ple else last.post_feedforward_layernorm
    h = (pend[0] + norm(pend[1])) * pend[3]
    return model.norm(h).reshape(1, 1, -1)


class FuseLayers:
    """fuse=layers: MergeProjections (q|k|v, gate|up), then the fused one-row step. backend
    "triton": the Triton kernels (CUDA; TRITON_INTERPRET=1 on a CPU); "torch": their twins (the
    same step structure and rounding, any device: the CPU reference of the fused path)."""

    def __init__(self, backend: str = "triton", pdl: bool = False):
        if backend not in ("triton", "torch"):
            raise ValueError(f"fuse=layers backend must be triton or torch, got {backend!r}")
        self.backend, self.pdl = backend, pdl
        self.merge = MergeProjections()

    def apply(self, model):
        from ..kernels.fused_gemv import fused_gemv_op, fused_gemv_ref
        from ..kernels.fused_w4a16 import fused_w4a16_op, fused_w4a16_ref

        model = self.merge.apply(model) or model
        if self.backend == "triton":
            gemv, gemv4 = fused_gemv_op, fused_w4a16_op
        else:
            def gemv(a, w, y, post, scale, pre, aux, eps, offset, epilogue, pdl):
                return fused_gemv_ref(a, w, y, post, scale, pre, aux, eps=eps, offset=offset, epilogue=epilogue)

            def gemv4(a, qw, s, z, g, y, post, scale, pre, aux, eps, offset, epilogue, pdl):
                return fused_w4a16_ref(a, qw, s, z, g, y, post, scale, pre, aux, eps=eps, offset=offset,
                                       epilogue=epilogue)
        model.fused_decode = functools.partial(fused_decode, gemv=gemv, gemv4=gemv4, pdl=self.pdl)
        return model

    def validate(self, model) -> None:
        """Every linear the fused step reads is dense or int4 (after quant and the other groups ran)."""
        for i, layer in enumerate(model.layers):
            at, m = layer.self_attn, layer.mlp
            mods = {"self_attn.qkv_proj" if hasattr(at, "qkv_proj") else "self_attn.q_proj":
                    getattr(at, "qkv_proj", None) or at.q_proj, "self_attn.o_proj": at.o_proj,
                    "mlp.gate_up_proj": m.gate_up_proj, "mlp.down_proj": m.down_proj}
            if layer.ple:
                mods.update({"per_layer_input_gate": layer.per_layer_input_gate,
                             "per_layer_projection": layer.per_layer_projection})
            for name, mod in mods.items():
                _linear(mod, f"layers.{i}.{name}")

    def describe(self) -> dict:
        return {**self.merge.describe(), "fused_layers": True, "fused_backend": self.backend, "pdl": self.pdl}
