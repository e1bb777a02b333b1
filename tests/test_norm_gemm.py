"""fuse.norm_gemm (kernels/norm_gemm.py): the wider steps' residual update + norm inside the CUDA GEMM after it. The
kernel itself needs nvcc and an sm_90 GPU (its SASS: tests/test_cuda_sass.py; its outputs against the twin and its
rows against one-row launches: `python -m fastgemma.kernels.norm_gemm` on the GPU). Here: what it refuses, and that
the fused steps hand it the update before gate|up where the table's entry is a CUDA one, at one row and in the
verify pass, with the arithmetic the two launches it replaces compute (the launch faked by them)."""
from __future__ import annotations

import dataclasses
import unittest.mock as mock

import pytest
import torch

from fastgemma.kernels import cuda_gemm
from fastgemma.kernels.int4_pack import pack_int4, quantize_int4
from fastgemma.kernels.mma_table import MmaConfig, parse_config
from fastgemma.kernels.mma_w4a16 import MmaWeight, mma_w4a16, mma_w4a16_ref
from fastgemma.kernels.norm_gemm import norm_gemm, norm_gemm_problem, norm_gemm_ref
from fastgemma.kernels.residual_norm import residual_norm, residual_norm_ref

INTERPRET_CFG = MmaConfig(1, 1, pairs=True)  # a Triton entry on the paired words: the fakes' GEMM


def _weight(N=256, K=256, pairs=True):
    q, s, z = quantize_int4(torch.randn(N, K) * 0.02, 128)
    s, z = s.to(torch.bfloat16), z.to(torch.bfloat16)
    return q, s, z, MmaWeight.from_codes(q, s, z, 128, pairs=pairs)


def test_refusals_say_what_it_takes():
    q, s, z, w = _weight()
    a, y = torch.randn(2, 256, dtype=torch.bfloat16), torch.randn(2, 256, dtype=torch.bfloat16)
    post, pre = torch.randn(256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16)
    cfg = parse_config("cuda2x4g")
    assert norm_gemm_problem(cfg, 256, 256, 128, "geglu") is None
    assert "CUDA kernel" in norm_gemm_problem(INTERPRET_CFG, 256, 256, 128, "geglu")
    assert "CUDA kernel" in norm_gemm_problem(None, 256, 256, 128, "geglu")
    assert "all of K" in norm_gemm_problem(parse_config("cuda2x4c2g"), 256, 256, 128, "geglu")
    assert "paired" in norm_gemm_problem(parse_config("cuda2x4"), 256, 256, 128, "geglu")
    kw = dict(eps=1e-6, offset=1.0, epilogue="geglu", config=cfg)
    with pytest.raises(ValueError, match="1 <= M <= 8"):
        norm_gemm(torch.randn(9, 256, dtype=torch.bfloat16), torch.randn(9, 256, dtype=torch.bfloat16), post, None,
                  pre, w, **kw)
    with pytest.raises(ValueError, match="a and y"):
        norm_gemm(a, y[:1], post, None, pre, w, **kw)
    with pytest.raises(ValueError, match="bf16"):
        norm_gemm(a, y.float(), post, None, pre, w, **kw)
    with pytest.raises(ValueError, match="post and pre"):
        norm_gemm(a, y, post[:128], None, pre, w, **kw)
    with pytest.raises(ValueError, match="scale"):
        norm_gemm(a, y, post, torch.ones(2), pre, w, **kw)
    with pytest.raises(ValueError, match="CUDA kernel"):
        norm_gemm(a, y, post, None, pre, w, **dict(kw, config=INTERPRET_CFG))
    with pytest.raises(ValueError, match="layout"):  # the natural words under a paired config
        norm_gemm(a, y, post, None, pre, _weight(pairs=False)[3], **kw)
    with pytest.raises(RuntimeError, match="CUDA device"):  # the launch off a CUDA device
        norm_gemm(a, y, post, None, pre, w, **kw)
    with mock.patch.object(cuda_gemm, "device_problem", lambda device: None):
        with pytest.raises(ValueError, match="16-byte"):  # a row stride that is no whole number of 16-byte pieces
            cuda_gemm.cuda_norm(torch.randn(2, 260, dtype=torch.bfloat16)[:, :256], y, post, None, pre, w.words,
                                w.sz, 256, 2, 4, "geglu", 1e-6, 1.0, True)
        with pytest.raises(ValueError, match="layer scalar"):
            cuda_gemm.cuda_norm(a, y, post, torch.ones(1, dtype=torch.half), pre, w.words, w.sz, 256, 2, 4, "geglu",
                                1e-6, 1.0, True)


def test_the_twin_is_the_norm_then_the_gemm():
    q, s, z, _ = _weight()
    a, y = torch.randn(3, 256, dtype=torch.bfloat16), torch.randn(3, 256, dtype=torch.bfloat16)
    post, pre, scale = (torch.randn(256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16),
                        torch.tensor([0.5], dtype=torch.bfloat16))
    out, h = norm_gemm_ref(a, y, post, scale, pre, pack_int4(q), s, z, 128, eps=1e-6, offset=1.0, epilogue="geglu")
    h2, x = residual_norm_ref(a, y, post, scale, pre, eps=1e-6, offset=1.0)
    assert torch.equal(h, h2) and torch.equal(out, mma_w4a16_ref(x, pack_int4(q), s, z, 128, "geglu"))
    assert out.shape == (3, 128)


def _fake_launches(calls):
    """cuda_gemm's launches as the two Triton launches the norm GEMM replaces (the interpreter), on the same words
    through a Triton entry of the paired layout: calls records (kind, M)."""
    def gemm(x, words, sz, N, warps, stages, splits, epilogue, pdl):
        calls.append(("gemm", x.shape[0]))
        return mma_w4a16(x, MmaWeight(words, sz, N, x.shape[1], 128, True), epilogue, INTERPRET_CFG)

    def norm(a, y, post, scale, pre, words, sz, N, warps, stages, epilogue, eps, offset, pdl):
        calls.append(("norm", a.shape[0]))
        h, x = residual_norm(a, y, post, scale, pre, eps=eps, offset=offset)
        return mma_w4a16(x, MmaWeight(words, sz, N, a.shape[1], 128, True), epilogue, INTERPRET_CFG), h
    return gemm, norm


def test_fused_steps_hand_gate_up_its_norm(monkeypatch, wide_tiles):
    """bf16, int4 g128 body, gate|up on a CUDA entry of the table at 1 and 5 rows (the launches faked by the Triton
    ones they replace): with fuse.norm_gemm the one-row step and the 5-row verify pass give the same hidden states,
    bit for bit, as without it, the update before gate|up going to the one launch in both; without int4_mma the
    switch is refused."""
    import fastgemma.kernels.w4a16 as w4a16_mod
    import fastgemma.kernels.w4a16_table as w4a16_table
    from fastgemma.engine.cache import KVCache
    from fastgemma.kernels import mma_table
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.model.config import GEMMA4_TINY, FULL, SLIDING
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.fused_layer_ops import _layer_linears
    from fastgemma.transforms.quant import Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    with pytest.raises(ValueError, match="int4_mma"):
        FuseLayers(backend="triton", norm_gemm=True)
    cfg = dataclasses.replace(GEMMA4_TINY, hidden_size=128, intermediate_size=256, num_layers=4,
                              num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * 2)
    # the int4 GEMMs other than gate|up: their torch twins (the interpreter's tl.dot rounds bf16 otherwise)
    monkeypatch.setattr(w4a16_table, "default_config", lambda M, N, K: w4a16_table._grp(64, 1, 4))
    monkeypatch.setattr(w4a16_mod, "w4a16_epilogue_op", lambda x, qw, s, z, g, epi, aux, sz, pdl: w4a16_mod.w4a16_torch(
        x, qw, s, z, g, epilogue=epi, aux=aux))
    calls = []
    gemm, norm = _fake_launches(calls)
    monkeypatch.setattr(cuda_gemm, "cuda_gemm", gemm)
    monkeypatch.setattr(cuda_gemm, "cuda_norm", norm)
    monkeypatch.setattr(cuda_gemm, "device_problem", lambda device: None)  # the table's CUDA entries kept
    monkeypatch.setattr(cuda_gemm, "prebuild", lambda variants: {})
    model = synthetic_model(cfg, "cpu", torch.bfloat16, seed=3)
    model.step_attention = decode_attention_ref
    FuseLayers(backend="triton").apply(model)
    Int4Quant(group_size=128, skip=("per_layer_projection", "per_layer_input_gate"), backend="triton").apply(model)
    gu = _layer_linears(0, model.layers[0])["gate_up"]
    for multi in (False, True):
        monkeypatch.setitem(mma_table.MMA_CONFIGS, (gu.out_features, gu.in_features, multi), parse_config("cuda2x4g"))
    steps = {}
    for on in (False, True):
        t = FuseLayers(backend="triton", int4_mma=True, norm_gemm=on)
        t.apply(model)
        t.validate(model)
        assert t.describe()["norm_gemm"] is on
        steps[on] = model.fused_decode, model.fused_verify
    for ids, pos in ((torch.tensor([[7]]), torch.tensor([[0]])),
                     (torch.tensor([[3, 4, 5, 6, 7]]), torch.arange(5)[None])):
        outs = {}
        for on in (False, True):
            model.fused_decode, model.fused_verify = steps[on]
            cache = KVCache(cfg, 1, 64, window=4, device="cpu", dtype=torch.bfloat16)
            del calls[:]
            outs[on] = model.step(ids, pos, cache)
            M = ids.shape[1]
            # one gate|up a layer: the norm GEMM with the switch, else the norm kernel and the plain GEMM
            assert calls == [("norm" if on else "gemm", M)] * cfg.num_layers
        assert torch.equal(outs[True], outs[False])
