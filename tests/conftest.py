"""Shared setup: Triton's CPU interpreter for every kernel test, and a tiny random Gemma 4 in
transformers, saved to disk, with the same weights in fastgemma."""
from __future__ import annotations

import os

# read when @triton.jit decorates, so before any fastgemma kernel module is imported
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

import triton.runtime.interpreter as _interp  # noqa: E402

_patch_lang_tensor = _interp._patch_lang_tensor


def _patch_lang_tensor_np24(tensor, scope):
    # triton 3.6 + numpy >= 2.4: the interpreter's int(array of shape (1,)) raises, which breaks
    # `range` with runtime bounds (triton-lang/triton#9171, fixed upstream by #9172)
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if _interp._patch_lang_tensor.__name__ == "_patch_lang_tensor":
    _interp._patch_lang_tensor = _patch_lang_tensor_np24

import pytest
import torch

from fastgemma.model.config import GEMMA4_TINY
from fastgemma.model.hf_config import to_hf_text_config

TINY = GEMMA4_TINY


def hf_text_config(cfg=TINY, **kw):
    """transformers' Gemma4TextConfig with the same architecture as a fastgemma ModelConfig."""
    return to_hf_text_config(cfg, attn_implementation="eager", **kw)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0):
    """Every parameter and the layer scalars random, so a missed norm offset or scale shows."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            d = p.shape[0]
            base = d ** -0.25 if (".q_norm." in name or ".k_norm." in name) else 1.0
            p.copy_(base * (1 + 0.2 * torch.randn(p.shape, generator=g)))
        elif "embed" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


def make_hf_causal(cfg=TINY, seed=0):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    m = Gemma4ForCausalLM(hf_text_config(cfg)).float().eval()
    return randomize_(m, seed)


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory):
    """A Gemma4ForCausalLM checkpoint written by transformers, sharded into several files."""
    d = tmp_path_factory.mktemp("hf_tiny")
    m = make_hf_causal()
    m.save_pretrained(d, max_shard_size="200KB")
    return d, m
