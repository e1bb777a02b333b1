"""Dense GEMV kernel (CPU interpreter) against F.linear on odd shapes, tails and tiles."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

from fastgemma.kernels.gemv import (E4B_SHAPES, MAX_KB, GemvConfig, candidates, default_config, gemv, gemv_op,
                                    resolve_config)


def _xw(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)


@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 37, 200, GemvConfig(4, 64, 2)),     # N not a multiple of BLOCK_N, K tail (200 = 3 x 64 + 8)
    (1, 100, 384, GemvConfig(8, 128, 4)),   # K a multiple of BLOCK_K
    (3, 50, 96, GemvConfig(2, 128, 1)),     # BLOCK_K > K: one masked block; 3 rows of x
    (1, 16, 512, None),                     # the default tiles
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_gemv_matches_linear(M, N, K, cfg, dtype, tol):
    x, w = _xw(M, N, K, dtype)
    y = gemv(x, w, cfg)
    ref = F.linear(x.float(), w.float())
    assert y.dtype == dtype and y.shape == (M, N)
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("launch", ["prefetch", "pdl"])
@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 37, 200, GemvConfig(4, 64, 2)),     # tail block masked along K and N
    (2, 24, 1024, GemvConfig(8, 64, 1)),    # 16 K blocks: every register slot of the prefetch kernel
    (1, 9, 40, GemvConfig(2, 64, 1)),       # one block, shorter than BLOCK_K
])
def test_prefetch_launches_equal_plain(M, N, K, cfg, launch):
    """Same arithmetic in the same order: bit-identical to the plain kernel (on a CPU, "pdl" runs
    the prefetch kernel without the launch attribute)."""
    x, w = _xw(M, N, K, torch.float32, seed=2)
    y = gemv(x, w, cfg, launch=launch)
    assert torch.equal(y, gemv(x, w, cfg))
    assert torch.allclose(y, F.linear(x, w), atol=1e-4)


def test_prefetch_launch_limits():
    x, w = _xw(1, 8, 64 * (MAX_KB + 1), torch.float32)
    with pytest.raises(ValueError, match=f"at most {MAX_KB} K blocks"):
        gemv(x, w, GemvConfig(8, 64, 1), launch="prefetch")
    with pytest.raises(ValueError, match="launch must be one of"):
        gemv(x, w, GemvConfig(8, 128, 1), launch="eager")


def test_gemv_strided_x_and_op():
    x, w = _xw(2, 24, 128, torch.float32, seed=1)
    xs = torch.cat([x, x], 1)[:, :128]  # row stride 256, unit column stride
    assert torch.allclose(gemv(xs, w, GemvConfig(8, 64, 1)), F.linear(x, w), atol=1e-4)
    assert torch.allclose(gemv_op(x, w), F.linear(x, w), atol=1e-4)
    xt = x.t().contiguous().t()  # column stride != 1: copied
    assert torch.allclose(gemv(xt, w, GemvConfig(8, 64, 1)), F.linear(x, w), atol=1e-4)


def test_gemv_bad_inputs():
    x, w = _xw(1, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="x \\[M, K\\] and w \\[N, K\\]"):
        gemv(x[:, :32], w)
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="power of two"):
        resolve_config(8, 64, GemvConfig(3, 64, 1))
    with pytest.raises(ValueError, match="streamed tiles"):
        gemv(x, w, GemvConfig(8, 64, 1, per_sm=2, depth=4))
    with pytest.raises(ValueError, match="blocks in flight"):
        resolve_config(8, 64, GemvConfig(8, 64, 1, per_sm=2))


def test_default_and_candidate_tiles_cover_e4b():
    for N, K in E4B_SHAPES.values():
        cfg = default_config(N, K)
        assert cfg.block_k <= triton_next_pow2(K) and -(-N // cfg.block_n) >= 132  # >= one wave
        cands = candidates(N, K)
        assert cands and all(c.block_k <= triton_next_pow2(K) for c in cands)


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def test_use_gemv_on_tiny_model_decode(monkeypatch):
    from torch import nn

    import fastgemma.kernels.gemv as gemv_mod

    from fastgemma.engine.cache import KVCache
    from fastgemma.engine.generator import Generator
    from fastgemma.engine.steps import StaticStep
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.gemv import GemvLinear, use_gemv
    from fastgemma.weights.synthetic import synthetic_model

    torch.manual_seed(0)
    model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=0)
    model.step_attention = decode_attention_ref
    keys = list(model.state_dict())

    def run():
        cache = KVCache(GEMMA4_TINY, 1, 64, device="cpu", dtype=torch.float32)
        gen = Generator(model, cache, StaticStep(model, cache))
        out = gen.generate(list(range(5, 17)), 6)
        return out.tokens, gen.step.last_logits.clone()

    ref_tokens, ref_logits = run()
    # wide tiles: a handful of programs per launch keeps the interpreter fast (the GPU tiles are
    # checked against F.linear above on odd shapes)
    monkeypatch.setattr(gemv_mod, "default_config", lambda N, K: GemvConfig(64, 64, 4))
    n = use_gemv(model)
    assert n == sum(isinstance(m, nn.Linear) for m in model.modules()) and n > 0
    assert list(model.state_dict()) == keys
    lin = next(m for m in model.modules() if isinstance(m, GemvLinear))
    x = torch.randn(3, lin.in_features)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))  # 3 rows: cuBLAS / CPU matmul
    tokens, logits = run()  # prefill on F.linear, every decode step's linears through the kernel
    assert tokens == ref_tokens
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert use_gemv(model, False) == n and not any(isinstance(m, GemvLinear) for m in model.modules())


def test_quant_bf16_triton_backend():
    from fastgemma.build import needs_cuda
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.gemv import GemvLinear
    from fastgemma.transforms.quant import Int4Quant, NoQuant
    from fastgemma.weights.synthetic import synthetic_model

    model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=0)
    q = NoQuant(backend="triton")
    assert needs_cuda(q) and not needs_cuda(NoQuant())
    q.apply(model)
    n = sum(isinstance(m, GemvLinear) for m in model.modules())
    assert n > 0 and q.describe()["gemv_layers"] == n and q.describe()["backend"] == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        NoQuant(backend="cublas")
    # int4 with the triton backend: the skipped (dense) PLE gates take the GEMV too
    model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=0)
    iq = Int4Quant(group_size=32, skip=("per_layer_input_gate", "per_layer_projection"), backend="triton")
    iq.apply(model)
    gates = [m for name, m in model.named_modules() if name.endswith("per_layer_input_gate")]
    assert gates and all(isinstance(m, GemvLinear) for m in gates) and iq.describe()["gemv_layers"] == 2 * len(gates)

