"""The fused one-row GEMV (kernels/fused_gemv.py) on W8A16 weights (quant=int8: int8 codes, one fp32 scale per
output row): the same prologues (norm, residual update, layer scale) and epilogues (GeGLU, PLE gate) around
y[n] = round(round(x . q[n]) * s[n]), each round to the activation dtype, as kernels/w8a16.py rounds.

A program holds all of K for its rows (no split-K: the prologue and epilogue need every column): its int8
blocks and its rows' scales are loaded before the PDL wait (neither is written by a kernel), as the dense
fused GEMV loads its weights. Where the rows are 4-byte aligned the codes are read as int32 words and turned
into floats with integer ops and one subtraction each (`sparse_argmax._int8_byte`, as the int8 head does: no
I2F, whose rate on sm_90, 16 a clock a multiprocessor, would take as long as the bytes); else byte by byte.
Tiles: autotuned per shape on the GPU over fused_gemv's candidates (no tile pinned: the E4B step ran 2.177 ms
on the autotuner's picks with the words, 2.298 on bytes, run KJ), `config` to pin one.
`fused_w8a16` launches, `fused_w8a16_op` is the opaque op, `fused_w8a16_ref` the twin (the dense twin's
prologue and epilogue around kernels/w8a16.py's twin: what the unfused torch path computes).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .fused_gemv import (TUNE_TILES, _aux_rows, _check, _finish, _fma_block, _h_store, _Launch, _pro_params,
                         _prologue_scalars, _prune, _rnd, _rows, fused_gemv_ref)
from .gemv import _INTERPRET, MAX_KB, GemvConfig, _pdl_trigger, _pdl_wait, resolve_config
from .sparse_argmax import _int8_byte
from .w8a16 import check_int8_operands, w8a16_torch


@triton.jit
def _word_codes(v):
    """int32 words [R, W] of four int8 codes each -> the codes as floats [R, 4 W], in memory order."""
    b0 = _int8_byte(v, 0)
    b1 = _int8_byte(v, 1)
    b2 = _int8_byte(v, 2)
    b3 = _int8_byte(v, 3)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (v.shape[0], v.shape[1] * 4))


@triton.jit
def _fused_w8a16_kernel(a_ptr, y_ptr, post_ptr, scale_ptr, pre_ptr, h_ptr, w_ptr, ws_ptr, aux_ptr, out_ptr,
                        N, HALF, stride_wn, eps, off,
                        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
                        HAS_SCALE: tl.constexpr, HAS_PRE: tl.constexpr, EPI: tl.constexpr, PDL: tl.constexpr,
                        WORDS: tl.constexpr = False):
    _pdl_trigger(PDL)
    pid = tl.program_id(0)
    rows, n_ok = _rows(pid, N, HALF, BLOCK_N, EPI)
    offs_k = tl.arange(0, BLOCK_K)
    NKB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    WK: tl.constexpr = BLOCK_K // 4
    offs_w = tl.arange(0, WK)
    ws = ()  # every K block's codes (as int32 words, or bytes), loads issued back to back before the wait
    for kb in tl.static_range(NKB):
        if WORDS:
            v_ptrs = (w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * (stride_wn // 4)
                      + kb * WK + offs_w[None, :])
            w_ok = (kb * WK + offs_w) < K // 4
            ws = ws + (tl.load(v_ptrs, mask=n_ok[:, None] & w_ok[None, :], other=0),)
        else:
            w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + kb * BLOCK_K + offs_k[None, :]
            k_ok = (kb * BLOCK_K + offs_k) < K
            ws = ws + (tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0),)
    row_scale = tl.load(ws_ptr + rows, mask=n_ok, other=0.0)
    params = _pro_params(post_ptr, pre_ptr, scale_ptr, offs_k, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE)
    _pdl_wait(PDL)  # the previous kernels' outputs are visible from here on
    DT: tl.constexpr = out_ptr.dtype.element_ty
    aux = _aux_rows(aux_ptr, rows, n_ok, EPI)
    inv_y, inv_x = _prologue_scalars(a_ptr, y_ptr, params, eps, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kb in tl.static_range(NKB):  # the codes are exact in fp32 (bytes: _fma_block converts them)
        w = _word_codes(ws[kb]) if WORDS else ws[kb]
        acc = _fma_block(acc, w, a_ptr, y_ptr, params, kb, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    y = _rnd(tl.sum(acc, axis=1), DT) * row_scale  # F.linear on the codes, then the scale (_finish rounds)
    _h_store(pid, a_ptr, y_ptr, params, h_ptr, inv_y, off, K, BLOCK_K, PRO, HAS_SCALE, DT)
    _finish(y, rows, n_ok, pid, aux, out_ptr, HALF, BLOCK_N, EPI, DT)


_fused_w8a16_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in TUNE_TILES],
    key=["N", "K", "PRO", "HAS_SCALE", "HAS_PRE", "EPI", "PDL", "WORDS"],
    prune_configs_by={"early_config_prune": _prune},
)(_fused_w8a16_kernel)


def fused_w8a16(a, qweight, wscale, y=None, post=None, scale=None, pre=None, aux=None, *, eps: float,
                offset: float = 0.0, epilogue: str = "none", config: GemvConfig | None = None, pdl: bool = False,
                words: bool = True):
    """-> (out [1, N] or [1, N/2] for geglu, h [1, K] or None), as fused_gemv. qweight int8 [N, K] contiguous
    along K, wscale fp32 [N]; a, y [K] any shape holding K values."""
    check_int8_operands(a.reshape(1, -1), qweight, wscale)
    N, K = qweight.shape
    if qweight.stride(1) != 1:
        raise ValueError("fused_w8a16 needs qweight contiguous along K")
    _check(a, N, K, y, post, scale, pre, aux, epilogue)
    if not (qweight.is_cuda or _INTERPRET):
        raise RuntimeError("fused_w8a16 runs on CUDA tensors (or with TRITON_INTERPRET=1); use fused_w8a16_ref")
    run = _Launch(a, y, post, scale, pre, aux, N, K, qweight.device, epilogue, pdl)
    args = (*run.head, qweight, wscale, *run.tail, N, run.half, qweight.stride(0), eps, offset)
    # every row 4-byte aligned: the codes as int32 words (`words=False`: byte by byte, the first form)
    words = words and K % 4 == 0 and qweight.stride(0) % 4 == 0 and qweight.data_ptr() % 4 == 0
    if config is None and not _INTERPRET:
        _fused_w8a16_tuned[lambda meta: run.grid(meta["BLOCK_N"])](*args, WORDS=words, **run.flags)
        return run.out, run.h
    cfg = resolve_config(N, K, config)
    if cfg.per_sm:
        raise ValueError(f"fused_w8a16 runs one program a tile; {cfg} is a streamed config (kernels/stream_gemv.py)")
    if run.epi == 1 and cfg.block_n < 2:
        cfg = GemvConfig(2, cfg.block_k, cfg.num_warps)
    if triton.cdiv(K, cfg.block_k) > MAX_KB:
        raise ValueError(f"fused_w8a16 holds at most {MAX_KB} K blocks; K={K} needs BLOCK_K >= "
                         f"{triton.cdiv(K, MAX_KB)}")
    _fused_w8a16_kernel[run.grid(cfg.block_n)](*args, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, WORDS=words,
                                               num_warps=cfg.num_warps, **run.flags)
    return run.out, run.h


def fused_w8a16_ref(a, qweight, wscale, y=None, post=None, scale=None, pre=None, aux=None, *, eps: float,
                    offset: float = 0.0, epilogue: str = "none", config=None, pdl: bool = False):
    """The twin: the dense twin's prologue and epilogue around kernels/w8a16.py's twin."""
    check_int8_operands(a.reshape(1, -1), qweight, wscale)
    return fused_gemv_ref(a, qweight, y, post, scale, pre, aux, eps=eps, offset=offset, epilogue=epilogue,
                          linear=functools.partial(w8a16_torch, qweight=qweight, scales=wscale))


@torch.library.custom_op("fastgemma::fused_w8a16", mutates_args=())
def fused_w8a16_op(a: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, y: torch.Tensor | None,
                   post: torch.Tensor | None, scale: torch.Tensor | None, pre: torch.Tensor | None,
                   aux: torch.Tensor | None, eps: float, offset: float, epilogue: str,
                   pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, h = fused_w8a16(a, qweight, wscale, y, post, scale, pre, aux, eps=eps, offset=offset, epilogue=epilogue,
                         pdl=pdl)
    return out, (h if h is not None else out.new_empty(0))


@fused_w8a16_op.register_fake
def _(a, qweight, wscale, y, post, scale, pre, aux, eps, offset, epilogue, pdl):
    N, K = qweight.shape
    out = a.new_empty((1, N // 2 if epilogue == "geglu" else N))
    return out, (a.new_empty((1, K)) if y is not None else a.new_empty(0))
