"""The rows GEMV (kernels/rows_gemv.py) against its torch twin under TRITON_INTERPRET=1: every epilogue, K not a
multiple of the block, N not a multiple of the tile, 1..16 rows, fp32 and 16-bit; each row the same bits at one
row and among many; its bad inputs refused in one line; the fused steps' choice between it and the skinny GEMM."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

from fastgemma.kernels.gemv import GemvConfig
from fastgemma.kernels.rows_gemv import MAX_BYTES, fits, rows_gemv, rows_gemv_op, rows_gemv_ref


def _inputs(M, N, K, dtype, epilogue, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * 0.1).to(dtype)
    aux = torch.randn(M, N, generator=g).to(dtype) if epilogue == "gelu_mul" else None
    return x, w, aux


def _err(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("epilogue", ["none", "geglu", "gelu_mul"])
@pytest.mark.parametrize("M,N,K,config", [
    (1, 40, 80, GemvConfig(2, 32, 1)),    # K: two whole blocks and a masked tail of 16
    (5, 36, 96, GemvConfig(4, 64, 2)),    # N tail (36 rows over tiles of 4 -> 9; geglu: 18 pairs over 2)
    (16, 24, 48, GemvConfig(8, 16, 1)),   # 16 rows, three blocks
    (3, 64, 40, GemvConfig(1, 64, 1)),    # one block longer than K (masked); one weight row a program
])
def test_rows_gemv_matches_the_twin(M, N, K, config, epilogue, dtype, tol):
    x, w, aux = _inputs(M, N, K, dtype, epilogue, seed=M + N)
    got = rows_gemv(x, w, epilogue, aux, config=config)
    ref = rows_gemv_ref(x.float(), w.float(), epilogue, aux.float() if aux is not None else None)
    assert got.shape == (M, N // 2 if epilogue == "geglu" else N) and got.dtype == dtype
    assert _err(got, ref) < tol


@pytest.mark.parametrize("M", [7, 11])
@pytest.mark.parametrize("epilogue", ["none", "gelu_mul", "geglu"])
def test_each_row_is_the_one_row_launch(epilogue, M):
    """The verify pass's rows bit-equal to one-row launches of the same rows (fuse.batch_invariant), strided x and
    aux, 7 and 11 rows."""
    x, w, aux = _inputs(M, 48, 160, torch.bfloat16, epilogue, seed=3)
    xs = torch.cat([x, torch.zeros(M, 32, dtype=x.dtype)], 1)[:, :160]  # rows 192 apart
    # aux as the step passes it: a layer's slice of all the PLE inputs, rows 3 x 48 apart, read in place
    auxs = torch.stack([torch.zeros_like(aux), aux, torch.ones_like(aux)], 1)[:, 1] if aux is not None else None
    many = rows_gemv(xs, w, epilogue, auxs)
    for m in range(M):
        one = rows_gemv(x[m:m + 1], w, epilogue, aux[m:m + 1] if aux is not None else None)
        assert torch.equal(one, many[m:m + 1]), m


def test_the_op_is_the_launch_and_its_fake_has_the_shape():
    x, w, aux = _inputs(4, 32, 64, torch.bfloat16, "gelu_mul", seed=5)
    assert torch.equal(rows_gemv_op(x, w, "gelu_mul", aux), rows_gemv(x, w, "gelu_mul", aux))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        assert rows_gemv_op(fx, fw, "geglu", None).shape == (4, 16)


def test_bad_inputs_are_refused_in_one_line():
    x, w, _ = _inputs(2, 16, 32, torch.bfloat16, "none")
    with pytest.raises(ValueError, match="at most 16 rows"):
        rows_gemv(torch.zeros(17, 32, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="share a float dtype"):
        rows_gemv(x.float(), w)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        rows_gemv(x, w[:, :16])
    with pytest.raises(ValueError, match="BLOCK_K >= 2"):
        rows_gemv(x, w, config=GemvConfig(2, 1, 1))
    with pytest.raises(ValueError, match="gelu_mul"):
        rows_gemv(x, w, "gelu_mul", None)


def test_fits_goes_by_the_weight_not_the_rows():
    """E4B's PLE gate (256 x 2560 bf16) takes it at 1..16 rows; W_plm (10,752 x 2560, 55 MB) stays on the skinny
    GEMM; the same answer at every row count up to 16."""
    ple, plm = 256 * 2560 * 2, 10752 * 2560 * 2
    assert ple <= MAX_BYTES < plm
    assert all(fits(m, 256, 2560, ple) for m in range(1, 17)) and not fits(17, 256, 2560, ple)
    assert not any(fits(m, 10752, 2560, plm) for m in (1, 8))


def test_fits_asks_the_tiles_to_hold_all_of_k(monkeypatch):
    """A K longer than the tiles' MAX_KB blocks stays off the kernel (it would refuse the launch), unless a CONFIGS
    entry for that shape and epilogue has wider blocks."""
    import fastgemma.kernels.rows_gemv as rows_mod

    K = 16 * rows_mod.DEFAULT_CONFIG.block_k
    assert fits(8, 4, K, 4 * K * 2, "gelu_mul") and not fits(8, 4, K + 16, 4 * (K + 16) * 2, "gelu_mul")
    wide = GemvConfig(2, 2 * rows_mod.DEFAULT_CONFIG.block_k, 2)
    monkeypatch.setitem(rows_mod.CONFIGS, (4, K + 16, "gelu_mul"), wide)
    assert fits(8, 4, K + 16, 4 * (K + 16) * 2, "gelu_mul") and not fits(8, 4, K + 16, 4 * (K + 16) * 2, "none")


def test_the_fused_steps_run_small_dense_weights_on_it(monkeypatch):
    """`_dense_rows` (the fused steps' dense linear at any row count): the PLE gate's shape on the rows GEMV, a
    large weight on the skinny GEMM, the twin without Triton; each through the epilogue."""
    import fastgemma.kernels.rows_gemv as rows_mod
    import fastgemma.kernels.skinny_gemm as skinny_mod
    from fastgemma.transforms.fused_layer_ops import _dense_rows

    calls = []
    monkeypatch.setattr(rows_mod, "rows_gemv_op", lambda *a: calls.append("rows") or rows_mod.rows_gemv_ref(*a))
    monkeypatch.setattr(skinny_mod, "skinny_matmul_op",
                        lambda x, w, e, a, p: calls.append("skinny") or skinny_mod.skinny_matmul_ref(x, w, epilogue=e,
                                                                                                     aux=a))
    x, w, aux = _inputs(3, 64, 128, torch.bfloat16, "gelu_mul")
    ref = rows_gemv_ref(x, w, "gelu_mul", aux)
    assert torch.equal(_dense_rows(x, w, "gelu_mul", aux, False), ref)
    monkeypatch.setattr(rows_mod, "MAX_BYTES", 1024)  # the same weight, now "large"
    assert torch.equal(_dense_rows(x, w, "gelu_mul", aux, False), ref)
    assert torch.equal(_dense_rows(x, w, "gelu_mul", aux, False, triton_ops=False), ref)
    assert calls == ["rows", "skinny"]
