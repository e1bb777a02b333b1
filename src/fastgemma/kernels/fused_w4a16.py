"""The fused one-row GEMV (kernels/fused_gemv.py) on W4A16 weights: the same prologues (norm,
residual update, layer scale) and epilogues (GeGLU, PLE gate), around the factored int4 GEMV of
kernels/w4a16.py (per group and row: sum w*x = 16 s (sum f*x - sum x) + z sum x, f = 1 + q/16).

Tiles come from the one-row W4A16 table (`w4a16.resolve_config(1, N, K, G)`), whole K per program
(no split-K: the prologue and epilogue need every column), the K loop unrolled. `pdl` waits for the
previous kernel before the first load (the loop is not a prefetch here) and lets the next one launch.
`fused_w4a16` launches, `fused_w4a16_op` is the opaque op, `fused_w4a16_ref` the twin (dequantize to
the activation dtype, then the dense twin: what the unfused torch path computes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_gemv import _check, _finish, _Launch, _prologue_scalars, _rows, _x_block, fused_gemv_ref
from .gemv import _INTERPRET, MAX_KB
from .w4a16 import dequantize_int4, resolve_config


@triton.jit
def _fused_w4a16_kernel(a_ptr, y_ptr, post_ptr, scale_ptr, pre_ptr, h_ptr, qw_ptr, s_ptr, z_ptr, aux_ptr, out_ptr,
                        N, HALF, stride_qn, eps, off,
                        K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRO: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_PRE: tl.constexpr, EPI: tl.constexpr,
                        PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    rows, n_ok = _rows(pid, N, HALF, BLOCK_N, EPI)
    NG: tl.constexpr = BLOCK_K // GROUP
    HG: tl.constexpr = GROUP // 2  # bytes per group and row
    offs_g = tl.arange(0, NG)
    w_ptrs = qw_ptr + rows[:, None, None] * stride_qn + offs_g[None, :, None] * HG + tl.arange(0, HG)[None, None, :]
    s_ptrs = s_ptr + offs_g[None, :] * N + rows[:, None]  # [BLOCK_N, NG]
    z_ptrs = z_ptr + offs_g[None, :] * N + rows[:, None]
    offs_x = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP] columns of a K block
    DT: tl.constexpr = out_ptr.dtype.element_ty
    inv_y, inv_x, scale = _prologue_scalars(a_ptr, y_ptr, post_ptr, scale_ptr, eps, off, K, BLOCK_K,
                                            PRO, HAS_SCALE, HAS_PRE, DT)
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    for kb in tl.static_range(K // BLOCK_K):
        w = tl.load(w_ptrs + kb * (BLOCK_K // 2), mask=n_ok[:, None, None], other=0).to(tl.int32)
        s = tl.load(s_ptrs + kb * NG * N, mask=n_ok[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptrs + kb * NG * N, mask=n_ok[:, None], other=0.0).to(tl.float32)
        x = _x_block(a_ptr, y_ptr, post_ptr, pre_ptr, kb, offs_x, inv_y, inv_x, scale, off,
                     K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)  # [NG, GROUP] fp32
        x_even, x_odd = tl.split(tl.reshape(x, (NG, HG, 2)))
        xs = tl.sum(x, axis=1)
        f_lo = (((w << 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        f_hi = (((w << 15) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        p = tl.sum(f_lo * x_even[None, :, :] + f_hi * x_odd[None, :, :], axis=2)
        acc += (16.0 * s) * (p - xs[None, :]) + z * xs[None, :]
    y = tl.sum(acc, axis=1)
    _finish(y, rows, n_ok, pid, a_ptr, y_ptr, post_ptr, h_ptr, aux_ptr, out_ptr, HALF, inv_y, scale, off,
            K, BLOCK_N, BLOCK_K, PRO, HAS_SCALE, EPI, DT)


def _check_int4(a, qweight, scales, zeros, group_size):
    N, K = qweight.shape[0], qweight.shape[1] * 2
    if qweight.dtype != torch.uint8 or scales.shape != (K // group_size, N) or zeros.shape != scales.shape:
        raise ValueError(f"fused_w4a16 needs qweight uint8 [N, K/2] and scales / zeros [K/G, N]; got "
                         f"{qweight.dtype} {tuple(qweight.shape)}, {tuple(scales.shape)}, {tuple(zeros.shape)}")
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("fused_w4a16: qweight, scales and zeros must be contiguous")
    return N, K


def fused_w4a16(a, qweight, scales, zeros, group_size: int, y=None, post=None, scale=None, pre=None, aux=None, *,
                eps: float, offset: float = 0.0, epilogue: str = "none", config=None, pdl: bool = False):
    """-> (out [1, N] or [1, N/2] for geglu, h [1, K] or None); see fused_gemv."""
    N, K = _check_int4(a, qweight, scales, zeros, group_size)
    _check(a, N, K, y, post, scale, pre, aux, epilogue)
    if not (qweight.is_cuda or _INTERPRET):
        raise RuntimeError("fused_w4a16 runs on CUDA tensors (or with TRITON_INTERPRET=1); use fused_w4a16_ref")
    cfg = resolve_config(1, N, K, group_size, config)  # block_k: a group multiple dividing K
    if K // cfg.block_k > MAX_KB:
        raise ValueError(f"fused_w4a16 unrolls at most {MAX_KB} K blocks; K={K} needs block_k >= {K // MAX_KB}")
    run = _Launch(a, y, post, scale, pre, aux, N, K, qweight.device, epilogue, pdl)
    bn = max(cfg.block_n, 2) if run.epi == 1 else cfg.block_n
    _fused_w4a16_kernel[run.grid(bn)](*run.head, qweight, scales, zeros, *run.tail, N, run.half, qweight.stride(0),
                                      eps, offset, GROUP=group_size, BLOCK_N=bn, BLOCK_K=cfg.block_k,
                                      num_warps=cfg.num_warps, **run.flags)
    return run.out, run.h


def fused_w4a16_ref(a, qweight, scales, zeros, group_size: int, y=None, post=None, scale=None, pre=None, aux=None,
                    *, eps: float, offset: float = 0.0, epilogue: str = "none", config=None, pdl: bool = False):
    """The twin: W dequantized to the activation dtype (as w4a16_torch does), then the dense twin."""
    _check_int4(a, qweight, scales, zeros, group_size)
    w = dequantize_int4(qweight, scales, zeros, group_size, dtype=a.dtype)
    return fused_gemv_ref(a, w, y, post, scale, pre, aux, eps=eps, offset=offset, epilogue=epilogue)


@torch.library.custom_op("fastgemma::fused_w4a16", mutates_args=())
def fused_w4a16_op(a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, y: torch.Tensor | None, post: torch.Tensor | None, scale: torch.Tensor | None,
                   pre: torch.Tensor | None, aux: torch.Tensor | None, eps: float, offset: float, epilogue: str,
                   pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, h = fused_w4a16(a, qweight, scales, zeros, group_size, y, post, scale, pre, aux, eps=eps, offset=offset,
                         epilogue=epilogue, pdl=pdl)
    return out, (h if h is not None else out.new_empty(0))


@fused_w4a16_op.register_fake
def _(a, qweight, scales, zeros, group_size, y, post, scale, pre, aux, eps, offset, epilogue, pdl):
    N, K = qweight.shape[0], qweight.shape[1] * 2
    out = a.new_empty((1, N // 2 if epilogue == "geglu" else N))
    return out, (a.new_empty((1, K)) if y is not None else a.new_empty(0))
