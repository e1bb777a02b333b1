"""Merge projections that read the same input: q|k|v (KV-store layers) and gate|up.

One GEMV of [q+k+v, hidden] instead of three: fewer launches, and the small k/v matrices stop
being latency-bound on their own (H200, measured: all step GEMVs 3.61 ms unmerged, 3.22 merged).
Apply before quantisation, so the merged matrices are what gets quantised.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from ..model.layers import gelu_tanh


def _merged_project(self, x, cos, sin):
    qkv = self.qkv_proj(x)
    nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
    shape = lambda t, h: t.unflatten(-1, (h, self.head_dim))  # noqa: E731
    return self.finish(shape(q, self.num_heads), shape(k, self.num_kv_heads), shape(v, self.num_kv_heads), cos, sin)


def _merged_mlp(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(gelu_tanh(gate) * up)


def _cat_linear(parts: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([p.weight for p in parts], 0)
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w, requires_grad=False)
    return out


class MergeProjections:
    def __init__(self, qkv: bool = True, gate_up: bool = True):
        self.qkv, self.gate_up = qkv, gate_up
        self.merged = 0

    @torch.no_grad()
    def apply(self, model):
        for layer in model.layers:
            a = layer.self_attn
            if self.qkv and hasattr(a, "k_proj") and isinstance(a.k_proj, nn.Linear):
                a.qkv_proj = _cat_linear([a.q_proj, a.k_proj, a.v_proj])
                del a.q_proj, a.k_proj, a.v_proj
                a.project = types.MethodType(_merged_project, a)
                self.merged += 1
            m = layer.mlp
            if self.gate_up and isinstance(getattr(m, "gate_proj", None), nn.Linear):
                m.gate_up_proj = _cat_linear([m.gate_proj, m.up_proj])
                del m.gate_proj, m.up_proj
                m.forward = types.MethodType(_merged_mlp, m)
                self.merged += 1
        return model

    def describe(self) -> dict:
        return {"merge_qkv": self.qkv, "merge_gate_up": self.gate_up, "merged_modules": self.merged}


class NoFuse:
    def apply(self, model):
        return model

    def describe(self) -> dict:
        return {"merge_qkv": False, "merge_gate_up": False}
