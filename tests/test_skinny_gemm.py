"""The verify pass's GEMM epilogues: the int4 per-group kernel's geglu / gelu_mul store and the dense
skinny GEMM (kernels/skinny_gemm.py), each against its torch twin under TRITON_INTERPRET=1, split-K
(through the arrival-counter fixup) and not, N tails, 1..16 rows."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

from fastgemma.kernels.int4_pack import pack_int4, quantize_int4
from fastgemma.kernels.skinny_gemm import (
    SkinnyConfig, default_config, resolve_config, skinny_matmul, skinny_matmul_op, skinny_matmul_ref,
)
from fastgemma.kernels.w4a16 import apply_epilogue, w4a16_epilogue_op, w4a16_matmul, w4a16_torch
from fastgemma.kernels.w4a16_table import W4A16Config

K = 384


def _x(M, dtype, seed=0):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _err(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("epilogue", ["none", "geglu", "gelu_mul"])
@pytest.mark.parametrize("M,N,config", [
    (8, 96, W4A16Config(32, 128, 1, 4, 3, 16, per_group=True)),   # no split, N a multiple of the tile
    (5, 100, W4A16Config(32, 128, 3, 4, 3, 16, per_group=True)),  # split 3 (the fixup), N tail
    (16, 64, W4A16Config(16, 128, 2, 1, 3, 16, per_group=True)),  # 16 rows, 16-row tiles (8 pairs)
])
def test_int4_epilogues_match_the_twin(M, N, config, epilogue, dtype, tol):
    g = torch.Generator().manual_seed(N)
    w = torch.randn(N, K, generator=g) * 0.05
    q, s, z = quantize_int4(w, 128, scale_dtype=dtype)
    qw = pack_int4(q)
    x = _x(M, dtype, M)
    aux = torch.randn(M, N, generator=g).to(dtype) if epilogue == "gelu_mul" else None
    got = w4a16_matmul(x, qw, s, z, 128, config, epilogue, aux)
    ref = w4a16_torch(x, qw, s, z, 128, epilogue=epilogue, aux=aux)
    assert got.shape == ref.shape == (M, N // 2 if epilogue == "geglu" else N)
    assert _err(got, ref) < tol
    # the GEMM's own output through torch's epilogue: the same values as the fused store
    plain = w4a16_matmul(x, qw, s, z, 128, config)
    assert _err(got, apply_epilogue(plain, epilogue, aux)) < tol


def test_int4_epilogue_on_other_kernels_falls_back_to_torch():
    """A config of another kernel (GEMV, first tl.dot) runs the GEMM, then torch's epilogue."""
    w = torch.randn(64, K, generator=torch.Generator().manual_seed(1)) * 0.05
    q, s, z = quantize_int4(w, 128)
    qw = pack_int4(q)
    x = _x(3, torch.float32)
    for cfg in (W4A16Config(16, 128, 2), W4A16Config(32, 128, 1, 4, 3, 16)):
        got = w4a16_matmul(x, qw, s, z, 128, cfg, "geglu")
        assert _err(got, w4a16_torch(x, qw, s, z, 128, epilogue="geglu")) < 1e-5


def test_epilogue_arguments_are_checked():
    w = torch.randn(64, K) * 0.05
    q, s, z = quantize_int4(w, 128)
    qw = pack_int4(q)
    x = _x(4, torch.float32)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        w4a16_matmul(x, qw, s, z, 128, epilogue="relu")
    with pytest.raises(ValueError, match="aux"):
        w4a16_matmul(x, qw, s, z, 128, epilogue="gelu_mul")
    with pytest.raises(ValueError, match="aux"):
        w4a16_matmul(x, qw, s, z, 128, epilogue="none", aux=torch.zeros(4, 64))
    with pytest.raises(ValueError, match=r"aux must be \[M, N\]"):
        skinny_matmul(x, w, epilogue="gelu_mul", aux=torch.zeros(4, 63))
    with pytest.raises(ValueError, match="N must be even"):
        skinny_matmul(x, torch.randn(63, K), epilogue="geglu")
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_matmul(_x(17, torch.float32), w)
    with pytest.raises(ValueError, match="share a float dtype"):
        skinny_matmul(x, w.half())
    with pytest.raises(ValueError, match="divide K"):
        resolve_config(64, K, SkinnyConfig(16, 128, 2))  # 3 K blocks, split 2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("epilogue", ["none", "geglu", "gelu_mul"])
@pytest.mark.parametrize("M,N,config", [(8, 96, SkinnyConfig(16, 128, 3, 1)), (1, 100, SkinnyConfig(32, 128, 1, 2)),
                                        (16, 48, SkinnyConfig(16, 64, 2, 1)), (3, 256, None)])
def test_skinny_gemm_matches_the_twin(M, N, config, epilogue, dtype, tol):
    g = torch.Generator().manual_seed(M + N)
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    x = _x(M, dtype, M)
    aux = torch.randn(M, N, generator=g).to(dtype) if epilogue == "gelu_mul" else None
    for _ in range(2):  # twice: the fixup's counters reset themselves
        got = skinny_matmul(x, w, config, epilogue, aux)
        ref = skinny_matmul_ref(x, w, epilogue=epilogue, aux=aux)
        assert got.shape == ref.shape and _err(got, ref) < tol


def test_skinny_default_config_fills_the_gpu_and_divides_k():
    c = default_config(256, 2560)  # the E4B PLE gate: 16 row tiles x 10 K splits
    assert (c.block_n, c.block_k, c.split_k) == (16, 128, 10)
    for N, K_ in ((256, 2560), (2560, 256), (20480, 2560), (100, 384)):
        c = resolve_config(N, K_)
        assert K_ % c.block_k == 0 and (K_ // c.block_k) % c.split_k == 0


def test_ops_trace_under_torch_compile():
    """The opaque ops' fake shapes: geglu halves N; compiled calls give the eager values."""
    w = torch.randn(64, K, generator=torch.Generator().manual_seed(2)) * 0.05
    q, s, z = quantize_int4(w, 128)
    qw = pack_int4(q)
    x = _x(4, torch.float32)
    aux = torch.randn(4, 64)

    def f(x_, aux_):
        return (w4a16_epilogue_op(x_, qw, s, z, 128, "geglu", None),
                skinny_matmul_op(x_, w, "gelu_mul", aux_))

    got = torch.compile(f, backend="eager", fullgraph=True)(x, aux)
    assert got[0].shape == (4, 32) and got[1].shape == (4, 64)
    assert _err(got[0], w4a16_torch(x, qw, s, z, 128, epilogue="geglu")) < 1e-5
    assert _err(got[1], skinny_matmul_ref(x, w, epilogue="gelu_mul", aux=aux)) < 1e-5
