"""The wider step's residual update + RMSNorm kernel (kernels/residual_norm.py) under the interpreter
against its twin and against the eager layer's modules, on a K that is no power of two."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest
import torch

from fastgemma.kernels.residual_norm import residual_norm, residual_norm_op, residual_norm_ref
from fastgemma.model.layers import RMSNorm

K = 100


def _inputs(M, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return r(M, K), r(M, K) * 3, r(K), torch.tensor([0.7]).to(dtype), r(K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("has_y,has_scale,has_pre", [(True, True, True), (True, False, True), (True, False, False),
                                                     (True, True, False), (False, False, True)])
def test_kernel_matches_twin_and_the_eager_modules(M, dtype, has_y, has_scale, has_pre):
    a, y, post, scale, pre = _inputs(M, dtype)
    kw = dict(y=y if has_y else None, post=post if has_y else None, scale=scale if has_scale else None,
              pre=pre if has_pre else None, eps=1e-6, offset=1.0 if dtype == torch.float32 else 0.0)
    h, x = residual_norm(a, **kw)
    h_ref, x_ref = residual_norm_ref(a, **kw)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
    for got, ref, want in ((h, h_ref, has_y), (x, x_ref, has_pre)):
        if not want:
            assert got is None and ref is None
            continue
        assert got.dtype == dtype and got.shape == (M, K)
        torch.testing.assert_close(got.float(), ref.float(), **tol)
    # the eager layer: h = (a + norm_post(y)) * scale, x = norm_pre(h), RMSNorm modules in torch
    n_post, n_pre = RMSNorm(K, 1e-6, kw["offset"]), RMSNorm(K, 1e-6, kw["offset"])
    n_post.weight.data, n_pre.weight.data = post.float(), pre.float()
    n_post, n_pre = n_post.to(dtype), n_pre.to(dtype)
    e = a
    if has_y:
        e = a + n_post(y)
        if has_scale:
            e = e * scale
        torch.testing.assert_close(h.float(), e.float(), **tol)
    if has_pre:
        torch.testing.assert_close(x.float(), n_pre(e).float(), **tol)


def test_strided_rows_and_the_op():
    """Rows of a wider buffer (row stride > K) and the registered op (h / x empty when not asked)."""
    a, y, post, scale, pre = _inputs(3, torch.float32, seed=1)
    wide = torch.zeros(3, 2 * K)
    wide[:, :K] = a
    h, x = residual_norm(wide[:, :K], y, post, None, pre, eps=1e-6)
    h_ref, x_ref = residual_norm_ref(a, y, post, None, pre, eps=1e-6)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(x, x_ref)
    h2, x2 = residual_norm_op(a, None, None, None, pre, 1e-6, 0.0)
    assert h2.numel() == 0 and torch.allclose(x2, residual_norm_ref(a, pre=pre, eps=1e-6)[1], atol=1e-5)
    h3, x3 = residual_norm_op(a, y, post, scale, None, 1e-6, 0.0)
    assert x3.numel() == 0 and torch.allclose(h3, residual_norm_ref(a, y, post, scale, eps=1e-6)[0], atol=1e-5)


def test_bad_inputs_are_refused():
    a, y, post, scale, pre = _inputs(2, torch.float32)
    with pytest.raises(ValueError, match="rows"):
        residual_norm(a[0], pre=pre, eps=1e-6)
    with pytest.raises(ValueError, match="y must match"):
        residual_norm(a, y[:, :50], post, eps=1e-6)
    with pytest.raises(ValueError, match="y must match"):
        residual_norm(a, y, None, eps=1e-6)
    with pytest.raises(ValueError, match="pre must be"):
        residual_norm(a, pre=pre[:10], eps=1e-6)
    with pytest.raises(ValueError, match="scale is one value"):
        residual_norm(a, scale=scale, pre=pre, eps=1e-6)
    with pytest.raises(ValueError, match="nothing to do"):
        residual_norm_ref(a, eps=1e-6)
