"""fuse.start_kernel: the one-row step's inputs in one launch (kernels/step_start.py) against its twin (the model's
own ops); the fused step with it gives the step's tokens, with the PLE inputs computed or from ple=table; bad inputs
refused."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from fastgemma.kernels.step_start import PLE_CHUNK, step_start, step_start_ref

NAMES = ("x", "xn", "ple", "cos_s", "sin_s", "cos_f", "sin_f", "slot")


def _inputs(dtype, H=96, NP=PLE_CHUNK + 900, V=40, ring=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, H, generator=g).to(dtype)
    pre = torch.randn(H, generator=g).to(dtype)
    table = torch.randn(V, NP, generator=g).to(dtype)
    fs = 1.0 / (10000.0 ** (torch.arange(0, 16).float() / 16))
    ff = torch.cat([1.0 / (1e6 ** (torch.arange(0, 8).float() / 32)), torch.zeros(8)])  # a partial rotary's zeros
    return emb, pre, table, fs, ff, torch.full((1, ring), -1, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_pre,with_table", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("p", [0, 23, 24, 4097])
def test_kernel_matches_twin(dtype, with_pre, with_table, p):
    """Bit for bit but cos / sin (numpy's in the interpreter, torch's in the twin: within one fp32 ulp before the
    cast); fp16 checks the rounding points (the interpreter truncates bf16 casts)."""
    emb, pre, table, fs, ff, ring = _inputs(dtype)
    ids, pos = torch.tensor([[17]]), torch.tensor([[p]])
    args = (emb, 50.5, pre if with_pre else None, 1e-6, 0.0, table if with_table else None, fs, ff)
    ring_k, ring_r = ring.clone(), ring.clone()
    got = step_start(ids, pos, *args, ring_k)
    want = step_start_ref(ids, pos, *args, ring_r)
    assert torch.equal(ring_k, ring_r) and ring_k[0, p % 24].item() == p
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name.startswith(("cos", "sin")):
            assert (a.float() - b.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 2 ** -10), name
        else:
            assert torch.equal(a, b), name
    assert got[1].numel() == (96 if with_pre else 0) and got[2].numel() == (table.shape[1] if with_table else 0)


def test_head_dims_of_any_size():
    """RoPE halves that are no power of two (head_dim 80 and 192: 40 and 96 frequencies) and a hidden size that is
    none either: the kernel masks its lanes."""
    emb, pre, table, _, _, ring = _inputs(torch.float32, H=72)
    fs = 1.0 / (10000.0 ** (torch.arange(0, 40).float() / 40))
    ff = 1.0 / (1e6 ** (torch.arange(0, 96).float() / 96))
    ids, pos = torch.tensor([[5]]), torch.tensor([[301]])
    args = (emb, 8.0, pre, 1e-6, 0.0, table, fs, ff)
    got, want = step_start(ids, pos, *args, ring.clone()), step_start_ref(ids, pos, *args, ring.clone())
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=0, atol=1e-6), name


def test_bad_inputs_are_refused():
    emb, pre, table, fs, ff, ring = _inputs(torch.float32)
    one = torch.tensor([[3]])
    with pytest.raises(ValueError, match="one row"):
        step_start(torch.tensor([[3, 4]]), torch.tensor([[5, 6]]), emb, 1.0, pre, 1e-6, 0.0, table, fs, ff, ring)
    with pytest.raises(ValueError, match="pre must be \\[96\\]"):
        step_start(one, one, emb, 1.0, pre[:5], 1e-6, 0.0, table, fs, ff, ring)
    with pytest.raises(ValueError, match="PLE table must be a contiguous 2-D"):
        step_start(one, one, emb, 1.0, pre, 1e-6, 0.0, table.half(), fs, ff, ring)
    with pytest.raises(ValueError, match="inv_freq_full must be contiguous 1-D fp32"):
        step_start(one, one, emb, 1.0, pre, 1e-6, 0.0, table, fs, ff.double(), ring)
    with pytest.raises(ValueError, match="ring_pos must be int32"):
        step_start(one, one, emb, 1.0, pre, 1e-6, 0.0, table, fs, ff, ring.long())


@pytest.mark.parametrize("table", [False, True])
def test_fused_step_with_the_start_kernel(table, monkeypatch):
    """The fused step (Triton kernels under the interpreter, fp32) with start_kernel gives the step's tokens and
    logits without it: PLE inputs computed from the kernel's embedding, or gathered from ple=table's rows by it."""
    import functools

    import fastgemma.kernels.gemv as gemv_mod
    from fastgemma.engine.cache import KVCache
    from fastgemma.engine.generator import Generator
    from fastgemma.engine.steps import StaticStep
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.kernels.gemv import GemvConfig
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.ple import PleTable
    from fastgemma.weights.synthetic import synthetic_model

    monkeypatch.setattr(gemv_mod, "default_config", lambda N, K: GemvConfig(64, 64, 4))  # few programs a launch
    model = synthetic_model(TINY, "cpu", torch.float32, seed=1)
    model.step_attention = decode_attention_ref
    if table:
        PleTable().apply(model)
    FuseLayers(backend="triton").apply(model)

    def decode():
        cache = KVCache(TINY, 1, 64, device="cpu", dtype=torch.float32)
        gen = Generator(model, cache, StaticStep(model, cache))
        out = gen.generate(list(range(5, 25)), 3)
        return out.tokens, gen.step.last_logits.clone(), cache.ring_pos.clone()

    ref = decode()
    seen = []
    import fastgemma.kernels.step_start as ss

    real = ss.step_start

    def spy(*a):
        seen.append(a[7] is not None)  # a PLE table passed
        return real(*a)

    monkeypatch.setattr(ss, "step_start", spy)
    model.fused_decode = functools.partial(model.fused_decode, start_kernel=True)
    got = decode()
    assert seen and set(seen) == {table}
    assert got[0] == ref[0] and torch.allclose(got[1], ref[1], atol=1e-4, rtol=1e-4) and torch.equal(got[2], ref[2])
