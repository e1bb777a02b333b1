"""Building blocks: RMSNorm, RoPE tables, GeGLU MLP. Plain torch; the reference for every fused kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 * (offset + w), in fp32, cast back.

    Trap: Gemma 4 has no +1 offset (offset=0); Gemma 3 stores w - 1 (offset=1).
    with_scale=False is Gemma 4's v_norm (no weight at all).
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0, with_scale: bool = True):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * (self.weight.float() + self.offset)
        return out.type_as(x)


def rope_inv_freq(head_dim: int, theta: float, partial: float = 1.0, factor: float = 1.0) -> torch.Tensor:
    """[head_dim // 2] fp32. Proportional RoPE (Gemma 4 full layers): the first partial*head_dim/2
    frequencies use the exponent over the whole head_dim, the rest are 0 (cos 1, sin 0: no rotation)."""
    n_rot = int(partial * head_dim // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.int64).float() / head_dim))
    inv = torch.cat([inv, torch.zeros(head_dim // 2 - n_rot)])
    return inv / factor


def register_rope_buffers(module: nn.Module, cfg) -> None:
    """inv_freq_sliding / inv_freq_full as non-persistent fp32 buffers (filled by fill_rope_buffers)."""
    module.register_buffer("inv_freq_sliding", torch.empty(cfg.head_dim // 2), persistent=False)
    module.register_buffer("inv_freq_full", torch.empty(cfg.global_head_dim // 2), persistent=False)


def fill_rope_buffers(module: nn.Module, cfg) -> None:
    """(Re)compute the RoPE buffers; a no-op on the meta device (to_empty() comes first)."""
    if module.inv_freq_sliding.is_meta:
        return
    module.inv_freq_sliding.copy_(rope_inv_freq(cfg.head_dim, cfg.rope_local_theta))
    module.inv_freq_full.copy_(rope_inv_freq(cfg.global_head_dim, cfg.rope_global_theta,
                                             cfg.rope_global_partial, cfg.rope_global_factor))


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """pos [B, T] int -> cos, sin [B, T, 1, D] in dtype (computed in fp32 like transformers)."""
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: dim j pairs with j + D/2. x [B, T, H, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))
