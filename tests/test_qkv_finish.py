"""The q/k/v kernel (kernels/qkv_finish.py) under the interpreter: against its twin and against the
model's own path (split_qkv's norms and RoPE, the static step's cache writes), both head dims,
ring slots and full-layer positions, store and KV-shared layers; the ops; bad input refused."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest
import torch

from fastgemma.kernels.qkv_finish import qkv_finish, qkv_finish_op, qkv_finish_ref, qkv_finish_store_op
from fastgemma.model.layers import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

H, HKV, B, S = 4, 2, 2, 13


def _case(D, T, dtype, store, seed=0):
    g = torch.Generator().manual_seed(seed)
    hk = HKV if store else 0
    qkv = (torch.randn(B, T, (H + 2 * hk) * D, generator=g) * 3).to(dtype)
    qw, kw = (torch.rand(D, generator=g) + 0.5).to(dtype), (torch.rand(D, generator=g) + 0.5).to(dtype)
    pos = torch.stack([torch.arange(T) + 9, torch.arange(T) + 2])  # rows of two sequences
    # proportional RoPE on the wide heads (Gemma 4's full layers): part of the head not rotated
    cos, sin = rope_cos_sin(pos, rope_inv_freq(D, 10000.0, 0.25 if D == 64 else 1.0), dtype)
    caches = tuple(torch.randn(B, S, HKV, D, generator=g).to(dtype) for _ in range(2)) if store else (None, None)
    return qkv, qw, kw if store else None, cos, sin, caches, (pos % S) if store else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,T", [(32, 1), (64, 8), (32, 5)])
@pytest.mark.parametrize("store,v_norm", [(True, True), (True, False), (False, True)])
def test_kernel_matches_twin(D, T, dtype, store, v_norm):
    qkv, qw, kw, cos, sin, (kc, vc), idx = _case(D, T, dtype, store)
    kc2, vc2 = (kc.clone(), vc.clone()) if store else (None, None)
    kw_ = dict(heads=H, eps=1e-6, offset=0.0, v_norm=v_norm)
    q = qkv_finish(qkv, qw, kw, cos, sin, kc, vc, idx, **kw_)
    q_ref = qkv_finish_ref(qkv, qw, kw, cos, sin, kc2, vc2, idx, **kw_)
    assert q.shape == (B, T, H, D) and q.dtype == dtype
    # bf16: the kernel's and the twin's fp32 sums round a value ~1 in 100 to the next bf16 (1 ulp)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=1 / 64)
    torch.testing.assert_close(q.float(), q_ref.float(), **tol)
    if store:
        torch.testing.assert_close(kc.float(), kc2.float(), **tol)
        torch.testing.assert_close(vc.float(), vc2.float(), **tol)
        untouched = torch.ones(B, S, dtype=torch.bool)
        untouched[torch.arange(B)[:, None], idx] = False
        orig = _case(D, T, dtype, store)[5]
        assert torch.equal(kc[untouched], orig[0][untouched]) and torch.equal(vc[untouched], orig[1][untouched])


@pytest.mark.parametrize("store", [True, False])
def test_twin_is_the_models_own_path(store):
    """fp32: the twin equals RMSNorm modules + apply_rope + index_put, the model's step path."""
    D, T = 64, 3
    qkv, qw, kw, cos, sin, (kc, vc), idx = _case(D, T, torch.float32, store, seed=1)
    kc0, vc0 = (kc.clone(), vc.clone()) if store else (None, None)
    q = qkv_finish_ref(qkv, qw, kw, cos, sin, kc, vc, idx, heads=H, eps=1e-6, offset=1.0)
    qn, kn = RMSNorm(D, 1e-6, 1.0), RMSNorm(D, 1e-6, 1.0)
    qn.weight.data, kn.weight.data = qw.clone(), (kw.clone() if store else qw.clone())
    x = qkv.unflatten(-1, (-1, D))
    torch.testing.assert_close(q, apply_rope(qn(x[:, :, :H]), cos, sin), atol=1e-5, rtol=1e-5)
    if store:
        bidx = torch.arange(B)[:, None]
        kc0[bidx, idx] = apply_rope(kn(x[:, :, H:H + HKV]), cos, sin)
        vc0[bidx, idx] = RMSNorm(D, 1e-6, with_scale=False)(x[:, :, H + HKV:])
        torch.testing.assert_close(kc, kc0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vc, vc0, atol=1e-5, rtol=1e-5)


def test_ops_and_refusals():
    qkv, qw, kw, cos, sin, (kc, vc), idx = _case(32, 2, torch.float32, True)
    kc2, vc2 = kc.clone(), vc.clone()
    q = qkv_finish_store_op(qkv, qw, kw, cos, sin, kc, vc, idx, H, 1e-6, 0.0, True, False)
    q_ref = qkv_finish_ref(qkv, qw, kw, cos, sin, kc2, vc2, idx, heads=H, eps=1e-6)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(kc, kc2)  # the op wrote the caches in place
    shared = qkv[..., : H * 32]
    torch.testing.assert_close(qkv_finish_op(shared, qw, cos, sin, H, 1e-6, 0.0, False),
                               qkv_finish_ref(shared, qw, None, cos, sin, heads=H, eps=1e-6))
    with pytest.raises(ValueError, match="last dim"):
        qkv_finish(qkv, qw, kw, cos, sin, kc, vc, idx, heads=H + 1, eps=1e-6)
    with pytest.raises(ValueError, match="together"):
        qkv_finish(qkv, qw, kw, cos, sin, kc, None, idx, heads=H, eps=1e-6)
    with pytest.raises(ValueError, match="idx"):
        qkv_finish(qkv, qw, kw, cos, sin, kc, vc, idx[:, :1], heads=H, eps=1e-6)
    with pytest.raises(ValueError, match="cos / sin"):
        qkv_finish(qkv, qw, kw, cos[:, :1], sin[:, :1], kc, vc, idx, heads=H, eps=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        qkv_finish(qkv[..., :-H * 4], qw[:24], kw[:24], cos, sin, kc, vc, idx, heads=H, eps=1e-6)
