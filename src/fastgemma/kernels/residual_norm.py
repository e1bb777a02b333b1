"""The residual update and RMSNorm between a wider step's GEMMs (the verify pass, batches), one
program per row with the whole row in registers: one read of the inputs, one write of the outputs.

    h = (a + rmsnorm(y) * (post + off)) * scale      (y given; scale optional)   else h = a
    x = rmsnorm(h) * (pre + off)                     (pre given)

the one-row fused GEMV's `pro=2` / `pro=1` prologue (kernels/fused_gemv.py) as a kernel of its own,
rounded to the activation dtype at the same points (norm output, residual add, layer scalar, norm),
so the result matches the eager layer up to the order of the fp32 sums. Compiled, the same work was
inductor's looped reductions (two passes over each row: ~4.5 us for 8 rows x 2,560 on the H200).
`residual_norm` launches, `residual_norm_op` is the opaque op for torch.compile, `residual_norm_ref`
the torch twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_gemv import _h_values, _layer_scale, _rnd
from .gemv import _pdl_trigger, _pdl_wait, pdl_args

_INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _residual_norm_kernel(a_ptr, y_ptr, post_ptr, scale_ptr, pre_ptr, h_ptr, x_ptr,
                          stride_a, stride_y, stride_h, stride_x, eps, off,
                          K: tl.constexpr, BLOCK: tl.constexpr, HAS_Y: tl.constexpr, HAS_SCALE: tl.constexpr,
                          HAS_PRE: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    DT: tl.constexpr = a_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    ok = k < K
    # the norm weights and the layer scalar before the wait (parameters, no kernel writes them): loaded
    # after a reduction they were dependent round trips to DRAM (the weights leave the L2 between steps)
    post = 0.0
    pre = 0.0
    scale = _layer_scale(scale_ptr, HAS_SCALE)  # (a scale comes with y: _check)
    if HAS_Y:
        post = tl.load(post_ptr + k, mask=ok, other=0.0).to(tl.float32)
    if HAS_PRE:
        pre = tl.load(pre_ptr + k, mask=ok, other=0.0).to(tl.float32)
    if EARLY:  # the next GEMM launches now, its weights' loads ahead of its own wait under the GEMM before this
        _pdl_trigger(PDL)
    _pdl_wait(PDL)  # a and y are the previous kernels' outputs
    if not EARLY:
        _pdl_trigger(PDL)
    h = tl.load(a_ptr + row * stride_a + k, mask=ok, other=0.0).to(tl.float32)
    if HAS_Y:  # the one-row prologue's residual update (fused_gemv._h_values), the row as one block
        y = tl.load(y_ptr + row * stride_y + k, mask=ok, other=0.0).to(tl.float32)
        inv_y = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / K + eps)
        h = _h_values(h, y, post, inv_y, scale, off, HAS_SCALE, DT)
        tl.store(h_ptr + row * stride_h + k, h.to(DT), mask=ok)
    if HAS_PRE:
        inv_x = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
        tl.store(x_ptr + row * stride_x + k, _rnd(h * inv_x * (pre + off), DT).to(DT), mask=ok)


def _check(a, y, post, scale, pre):
    if a.dim() != 2:
        raise ValueError(f"residual_norm takes rows [M, K], got a {tuple(a.shape)}")
    K = a.shape[1]
    if y is not None and (y.shape != a.shape or post is None or post.shape != (K,)):
        raise ValueError(f"residual_norm: y must match a {tuple(a.shape)} and post be [{K}]; got "
                         f"{tuple(y.shape)} / {None if post is None else tuple(post.shape)}")
    if pre is not None and pre.shape != (K,):
        raise ValueError(f"residual_norm: pre must be [{K}], got {tuple(pre.shape)}")
    if scale is not None and (y is None or scale.numel() != 1):
        raise ValueError("residual_norm: scale is one value and needs y")
    if y is None and pre is None:
        raise ValueError("residual_norm: nothing to do (neither y nor pre)")


def residual_norm(a, y=None, post=None, scale=None, pre=None, *, eps: float, offset: float = 0.0,
                  pdl: bool = False, early: bool = False):
    """a, y [M, K] (rows contiguous), post / pre [K], scale [1] -> (h [M, K] or None without y,
    x [M, K] or None without pre); see the module docstring. `pdl` (sm90+): programmatic dependent
    launch (this one waits for the previous kernel before it reads, then lets the next launch; `early`: lets
    it launch first, so the next kernel's loads before its own wait overlap the kernel before this one)."""
    _check(a, y, post, scale, pre)
    if not (a.is_cuda or _INTERPRET):
        raise RuntimeError("residual_norm runs on CUDA tensors (or with TRITON_INTERPRET=1); use residual_norm_ref")
    a = a if a.stride(1) == 1 else a.contiguous()
    y = y if y is None or y.stride(1) == 1 else y.contiguous()
    M, K = a.shape
    h = torch.empty_like(a) if y is not None else None
    x = torch.empty_like(a) if pre is not None else None
    block = triton.next_power_of_2(K)
    _residual_norm_kernel[(M,)](
        a, y if y is not None else a, post if post is not None else a, scale if scale is not None else a,
        pre if pre is not None else a, h if h is not None else a, x if x is not None else a,
        a.stride(0), y.stride(0) if y is not None else 0, h.stride(0) if h is not None else 0,
        x.stride(0) if x is not None else 0, float(eps), float(offset),
        K=K, BLOCK=block, HAS_Y=y is not None, HAS_SCALE=scale is not None, HAS_PRE=pre is not None,
        EARLY=early, num_warps=max(1, min(8, block // 512)), **pdl_args(pdl, a.device),
    )
    return h, x


def residual_norm_ref(a, y=None, post=None, scale=None, pre=None, *, eps: float, offset: float = 0.0):
    """The torch twin: fp32 arithmetic rounded to a's dtype at the kernel's points."""
    _check(a, y, post, scale, pre)
    dt = a.dtype

    def rnd(t):
        return t.to(dt).float()

    def inv_rms(t):
        return torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    h = a.float()
    if y is not None:
        yf = y.float()
        h = rnd(h + rnd(yf * inv_rms(yf) * (post.float() + offset)))
        if scale is not None:
            h = rnd(h * scale.float().reshape(()))
    x = rnd(h * inv_rms(h) * (pre.float() + offset)).to(dt) if pre is not None else None
    return (h.to(dt) if y is not None else None), x


@torch.library.custom_op("fastgemma::residual_norm", mutates_args=())
def residual_norm_op(a: torch.Tensor, y: torch.Tensor | None, post: torch.Tensor | None, scale: torch.Tensor | None,
                     pre: torch.Tensor | None, eps: float, offset: float,
                     pdl: bool = False, early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    h, x = residual_norm(a, y, post, scale, pre, eps=eps, offset=offset, pdl=pdl, early=early)
    return (h if h is not None else a.new_empty(0)), (x if x is not None else a.new_empty(0))


@residual_norm_op.register_fake
def _(a, y, post, scale, pre, eps, offset, pdl=False, early=False):
    return (torch.empty_like(a) if y is not None else a.new_empty(0),
            torch.empty_like(a) if pre is not None else a.new_empty(0))
