"""INT4 weights x 16-bit activations (W4A16): a Triton GEMV / skinny-GEMM kernel and its torch twin, on
the packing of kernels/int4_pack.py (its docstring has the format and the E4B byte counts).

Kernels (one program = BLOCK_N rows x one K slice x one row tile of x; grid from shapes only):
- `_gemv_kernel` (M = 1, or any M with block_m = 1): CUDA-core dot products; codes become 1 + q/16 by
  bit operations, scale and zero are applied once per group. Two inner loops (W4A16Config.words):
  the byte loop (a code byte per register, each code shifted and masked) and the word loop (int32
  words, two codes per LOP3: `_nibble_pair`), which wins on the large-N shapes.
- `_mma_kernel` (M = 2..16, block_m >= 16): dequantize to x's dtype and tl.dot with fp32 accumulators.
- `_group_mma_kernel` (block_m >= 16, per_group): one scale group per step, the [BLOCK_N, G/2] code
  bytes dequantized where tl.dot reads them (no reshape, so Triton converts the codes, not the bf16
  weights, into the mma operand layout). On bf16 a PTX block dequantizes 4 bytes (8 weights) with
  3 shifts, 4 LOP3 (128 + q as bf16 pairs), 4 PRMT and 8 fma.bf16x2 (q exact, then q * s + z
  rounded once); elsewhere (fp16 / fp32, the interpreter) the same arithmetic in Triton.
- `_dequant_kernel` (W4A16Config.dequant, prompt chunks): W to x's dtype in one launch, then cuBLAS
  (F.linear): the N x K scratch is written and read once per call, worth it where the GEMM is
  compute-bound (hundreds of rows) and the tl.dot kernels re-dequantize per row tile.
- split_k > 1: fp32 partials [split_k, M, N] summed in a fixed order by the last program of each
  output tile to finish (an atomic arrival counter per tile; `SPLIT_FIXUP = False`: by
  `_splitk_reduce_kernel`, a second launch). Deterministic either way (no atomic adds of values), so
  greedy identity holds run to run.
Tiles come from kernels/w4a16_table.py (`CONFIGS`, E4B shapes on the H200, or `default_config`;
`resolve_config` fits them to the shape); kernels/w4a16_bench.py times every E4B shape against cuBLAS
bf16 and can sweep candidates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .counters import arrival_counters
from .fused_gemv import _gelu_tanh, _rnd
from .gemv import _pdl_trigger, _pdl_wait, pdl_args
from .int4_pack import dequantize_int4
from .sparse_argmax import _block_pick
from .w4a16_table import W4A16Config, resolve_config

_INTERPRET = bool(triton.knobs.runtime.interpret)  # read where @triton.jit reads it: at import


def w4a16_torch(x, qweight, scales, zeros, group_size: int, config=None, epilogue: str = "none", aux=None,
                sz=None):
    """Torch twin: x [M, K] @ dequant(W)^T -> [M, N] in x's dtype (W rounded to x's dtype first,
    as the tl.dot path does; cuBLAS / CPU matmul accumulate in fp32), then `apply_epilogue`.
    `config` and `sz` (the packed copy of scales / zeros) are ignored."""
    y = F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, dtype=x.dtype))
    return apply_epilogue(y, epilogue, aux)


# ---------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _dequant(w, s, z):
    # w: int32 codes 0..15. OR-ing them into the mantissa of 2^23 and subtracting 2^23 converts
    # exactly without I2F, a quarter-rate pipe; int4 at 4.3 TB/s is ~33 weights / clk / SM on the H200
    f = (w | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return f * s + z


# The word loop's nibble pairs: LOP3 puts nibble m at bits 3-6 and nibble m + 4 at bits 19-22 of
# 0x3F803F80, two bf16 1.0s. The high half read as fp32 is 1 + q/16 + C + q' 2^-20 (C = 0x3F80 2^-23,
# removed per group through the sum of those x; the q' term is 2^-16 of the weight's step, far below
# a 16-bit x's rounding); the low half shifted up 16 is 1 + q/16 exactly. So 8 weights take 4 shifts,
# 4 LOP3, 4 shifts and 8 FMAs. EXACT (fp32 x) clears the high half's low bits first: one more LOP3
# per pair, and f is exactly 1 + q/16 as in the byte loop.
_PAIR_C = tl.constexpr(0.0019378662109375)  # 0x3F80 / 2^23
_LOP3_PAIR = tl.constexpr("lop3.b32 $0, $1, 0x00780078, 0x3F803F80, 0xEA;")


@triton.jit
def _nibble_pair(w, M: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr):
    """int32 words w (8 codes, code j = bits 4j..4j+3) -> (1 + q_m/16, 1 + q_(m+4)/16 [+ C + noise]) fp32."""
    if M == 0:
        t = w << 3
    else:
        t = w >> (4 * M - 3)
    if ASM:  # one LOP3 ((t & mask) | magic); Triton's own and / or compile to two
        v = tl.inline_asm_elementwise(_LOP3_PAIR, "=r,r", [t], dtype=tl.int32, is_pure=True, pack=1)
    else:
        v = (t & 0x00780078) | 0x3F803F80
    hi = v & -65536 if EXACT else v  # -65536: 0xFFFF0000
    return (v << 16).to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _word_dot(w, x_lo0, x_hi0, x_lo1, x_hi1, x_lo2, x_hi2, x_lo3, x_hi3, ASM: tl.constexpr, EXACT: tl.constexpr):
    """sum_j f_j x_j over each word's 8 codes ([R, W] words, x_* [W]: x of code m and m + 4)."""
    f_lo, f_hi = _nibble_pair(w, 0, ASM, EXACT)
    p = f_lo * x_lo0[None, :]
    p += f_hi * x_hi0[None, :]
    f_lo, f_hi = _nibble_pair(w, 1, ASM, EXACT)
    p += f_lo * x_lo1[None, :]
    p += f_hi * x_hi1[None, :]
    f_lo, f_hi = _nibble_pair(w, 2, ASM, EXACT)
    p += f_lo * x_lo2[None, :]
    p += f_hi * x_hi2[None, :]
    f_lo, f_hi = _nibble_pair(w, 3, ASM, EXACT)
    p += f_lo * x_lo3[None, :]
    p += f_hi * x_hi3[None, :]
    return p


@triton.jit
def _group_terms(p, x_lo, x_hi, s, z, BLOCK_N: tl.constexpr, NG: tl.constexpr, WG: tl.constexpr,
                 EXACT: tl.constexpr):
    """Per (row, group) sum w*x = 16 s (P - xs - C xs_hi) + z xs from the words' sums p [BLOCK_N, NG*WG]
    and the x sums of the low / high codes [NG*WG]; s, z [BLOCK_N, NG] fp32."""
    pg = tl.sum(tl.reshape(p, (BLOCK_N, NG, WG)), axis=2)
    xh = tl.sum(tl.reshape(x_hi, (NG, WG)), axis=1)
    xs = tl.sum(tl.reshape(x_lo, (NG, WG)), axis=1) + xh
    if EXACT:
        d = pg - xs[None, :]
    else:
        d = pg - xs[None, :] - _PAIR_C * xh[None, :]
    return (16.0 * s) * d + z * xs[None, :]


@triton.jit
def _byte_terms(w, x_even, x_odd, xs, s, z):
    """The byte loop's per (row, group) sum w*x = 16 s (p - xs) + z xs: code bytes w (int32)
    [BLOCK_N, NG, HG] -> f = 1 + q/16 by a shift and a mask each, x_even / x_odd [NG, HG] the x of
    the low / high codes, xs [NG] their sums; s, z [BLOCK_N, NG] fp32."""
    f_lo = (((w << 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
    f_hi = (((w << 15) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
    p = tl.sum(f_lo * x_even[None, :, :] + f_hi * x_odd[None, :, :], axis=2)  # [BLOCK_N, NG]
    return (16.0 * s) * (p - xs[None, :]) + z * xs[None, :]


@triton.jit
def _store_out(acc, offs_n, offs_m, n_ok, m_ok, out_ptr, aux_ptr, stride_om, stride_am, EPI: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] fp32 sums -> out[m, n] at m * stride_om + n: as is (EPI 0), or
    gelu_tanh(acc) * aux[m, n] (EPI 2: the PLE gate times the layer's input, aux[m, n] at
    m * stride_am + n), rounded to out's dtype where the unfused torch path rounds (the GEMM
    output, gelu, the product). EPI 1 (GeGLU) is `_geglu_from_ws`."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    mask = n_ok[:, None] & m_ok[None, :]
    if EPI == 0:
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(DT), mask=mask)
    else:
        p = tl.load(aux_ptr + offs_m[None, :] * stride_am + offs_n[:, None], mask=mask, other=0.0).to(tl.float32)
        act = _rnd(_rnd(_gelu_tanh(_rnd(acc, DT)), DT) * p, DT)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], act.to(DT), mask=mask)


@triton.jit
def _geglu_from_ws(ws_ptr, offs_m, m_ok, out_ptr, M, N, HALF, stride_om, SPLIT: tl.constexpr, ROWS: tl.constexpr):
    """EPI 1: the tile's ROWS gate rows i and up rows HALF + i summed from the partials in ws
    [SPLIT, M, N] (split order, from L2) as two [ROWS, BLOCK_M] blocks, then out[m, i] =
    gelu_tanh(gate) * up, rounded as the torch path rounds."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = (i < HALF)[:, None] & m_ok[None, :]
    g_ptrs = ws_ptr + offs_m[None, :] * N + i[:, None]
    g = tl.zeros((ROWS, offs_m.shape[0]), dtype=tl.float32)
    u = tl.zeros_like(g)
    for sk in tl.static_range(SPLIT):
        g += tl.load(g_ptrs + sk * M * N, mask=ok, other=0.0, cache_modifier=".cg")
        u += tl.load(g_ptrs + sk * M * N + HALF, mask=ok, other=0.0, cache_modifier=".cg")
    act = _rnd(_rnd(_gelu_tanh(_rnd(g, DT)), DT) * _rnd(u, DT), DT)
    tl.store(out_ptr + offs_m[None, :] * stride_om + i[:, None], act.to(DT), mask=ok)


@triton.jit
def _split_store(acc, offs_n, offs_m, n_ok, m_ok, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om,
                 SPLIT: tl.constexpr, FIXUP: tl.constexpr, aux_ptr=None, stride_am=0, HALF=0,
                 EPI: tl.constexpr = 0, acc_u=None):
    """acc [BLOCK_N, BLOCK_M] fp32 of this program (grid: N tiles, K splits, M tiles) -> out [M, N]
    (out[m, n] at m * stride_om + n; through the epilogue EPI: `_store_out`, `_geglu_from_ws`; EPI 1:
    acc holds gate rows offs_n, acc_u the up rows HALF + offs_n, and both go through ws [SPLIT, M, N]
    and back, so the accumulators' layout never has to be split in registers). SPLIT == 1: stored.
    Else the partial goes to ws [SPLIT, M, N] fp32 and the tile's last program to arrive (one
    counter per tile, acq_rel at GPU scope, after a barrier so every thread's partial is written)
    sums the SPLIT partials in split order, stores out and zeroes the counter for the next launch:
    the sums of `_splitk_reduce_kernel`, bit for bit, without a second launch (FIXUP=False: the
    partial only, `_splitk_reduce_kernel` sums them after; EPI 0 only). Counters are shared per
    device: split launches must not run concurrently (one stream; a PDL launch waits first)."""
    mask = n_ok[:, None] & m_ok[None, :]
    pid_k = tl.program_id(1)
    tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    ws_ptrs = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
    if SPLIT == 1 and EPI != 1:
        _store_out(acc, offs_n, offs_m, n_ok, m_ok, out_ptr, aux_ptr, stride_om, stride_am, EPI)
    else:
        tl.store(ws_ptrs + pid_k * M * N, acc, mask=mask)
        if EPI == 1:
            tl.store(ws_ptrs + pid_k * M * N + HALF, acc_u, mask=mask)
    if SPLIT == 1 and EPI == 1:
        tl.debug_barrier()  # the tile's partial, every thread's part, before it is read back
        _geglu_from_ws(ws_ptr, offs_m, m_ok, out_ptr, M, N, HALF, stride_om, 1, acc.shape[0])
    if SPLIT > 1 and FIXUP:
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            if EPI == 1:
                _geglu_from_ws(ws_ptr, offs_m, m_ok, out_ptr, M, N, HALF, stride_om, SPLIT, acc.shape[0])
            else:
                tot = tl.zeros_like(acc)
                for sk in tl.static_range(SPLIT):  # .cg: from L2, where the other programs' partials are
                    tot += tl.load(ws_ptrs + sk * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                _store_out(tot, offs_n, offs_m, n_ok, m_ok, out_ptr, aux_ptr, stride_om, stride_am, EPI)
            tl.store(cnt_ptr + tile, 0)


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_qn, stride_om,
    K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, FIXUP: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FACTORED: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr,
    # ARGMAX (SPLIT 1; kernels/sparse_argmax.head_argmax_int4): the block's outputs, rounded to x's dtype as
    # the store rounds them, go to sparse_argmax's `_block_pick` (max / row index partials [M, NUM_P],
    # softcapped logits at their ids) instead of out
    ARGMAX: tl.constexpr = False, pmax_ptr=None, pidx_ptr=None, keep_ptr=None, logit_ptr=None, stride_lm=0,
    softcap=1.0, NUM_P: tl.constexpr = 1, HAS_KEEP: tl.constexpr = False, STORE_LOGITS: tl.constexpr = False,
    WANT_IDS: tl.constexpr = True, SOFTCAP: tl.constexpr = False,
):
    # At one row the GEMV is bound by its per-weight instructions, not by its tiles. Factored: codes
    # become f = 1 + q/16 by bit operations and one FMA with x each; per group g and row n, with
    # p = sum f*x and xs = sum x over the group: sum w*x = s * sum q*x + z * xs = 16 s (p - xs) + z xs.
    # WORDS reads int32 words and makes the f two at a time (_nibble_pair): ~1.5 instructions per
    # weight before its FMA, against ~3 for the byte loop (a byte per int32, then a shift, an AND
    # and an OR per code). Each CONFIGS entry picks the loop (W4A16Config.words).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    NG: tl.constexpr = BLOCK_K // GROUP
    HG: tl.constexpr = GROUP // 2  # bytes per group and row
    WG: tl.constexpr = GROUP // 8  # int32 words per group and row
    WK: tl.constexpr = BLOCK_K // 8

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_g = tl.arange(0, NG)
    g0 = pid_k * (K_SPLIT // GROUP)
    s_ptrs = s_ptr + (g0 + offs_g)[None, :] * N + offs_n[:, None]  # [BLOCK_N, NG]
    z_ptrs = z_ptr + (g0 + offs_g)[None, :] * N + offs_n[:, None]
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    if WORDS:
        offs_w = tl.arange(0, WK)
        q32_ptrs = (qw_ptr.to(tl.pointer_type(tl.int32)) + pid_k * (K_SPLIT // 8) + offs_n[:, None] * (stride_qn // 4)
                    + offs_w[None, :])  # [BLOCK_N, WK] words: 8 consecutive k each
        xw_ptrs = x_ptr + pid_m * stride_xm + pid_k * K_SPLIT + offs_w * 8  # k of each word's code 0
        for _ in range(0, K_SPLIT, BLOCK_K):
            w = tl.load(q32_ptrs, mask=n_ok[:, None], other=0)
            s = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)
            z = tl.load(z_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)
            x0 = tl.load(xw_ptrs).to(tl.float32)
            x4 = tl.load(xw_ptrs + 4).to(tl.float32)
            x1 = tl.load(xw_ptrs + 1).to(tl.float32)
            x5 = tl.load(xw_ptrs + 5).to(tl.float32)
            x2 = tl.load(xw_ptrs + 2).to(tl.float32)
            x6 = tl.load(xw_ptrs + 6).to(tl.float32)
            x3 = tl.load(xw_ptrs + 3).to(tl.float32)
            x7 = tl.load(xw_ptrs + 7).to(tl.float32)
            p = _word_dot(w, x0, x4, x1, x5, x2, x6, x3, x7, ASM, EXACT)
            acc += _group_terms(p, x0 + x1 + x2 + x3, x4 + x5 + x6 + x7, s, z, BLOCK_N, NG, WG, EXACT)
            q32_ptrs += WK
            s_ptrs += NG * N
            z_ptrs += NG * N
            xw_ptrs += BLOCK_K
    else:
        offs_b = tl.arange(0, HG)
        # [BLOCK_N, NG, HG] bytes: BLOCK_N * BLOCK_K / 2 per iteration, 16-byte vectors along K
        w_ptrs = (qw_ptr + pid_k * (K_SPLIT // 2) + offs_n[:, None, None] * stride_qn
                  + offs_g[None, :, None] * HG + offs_b[None, None, :])
        x_ptrs = (x_ptr + pid_m * stride_xm + pid_k * K_SPLIT + offs_g[:, None] * GROUP
                  + tl.arange(0, GROUP)[None, :])
        for _ in range(0, K_SPLIT, BLOCK_K):
            w = tl.load(w_ptrs, mask=n_ok[:, None, None], other=0).to(tl.int32)
            s = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)
            z = tl.load(z_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)
            x = tl.load(x_ptrs).to(tl.float32)  # [NG, GROUP]
            # [NG, GROUP] -> even / odd k, matching the low / high nibbles
            x_even, x_odd = tl.split(tl.reshape(x, (NG, HG, 2)))
            if FACTORED:
                acc += _byte_terms(w, x_even, x_odd, tl.sum(x, axis=1), s, z)
            else:  # the first version, kept as the baseline of bench_shapes: dequantise, then FMA
                t = _dequant(w & 0xF, s[:, :, None], z[:, :, None]) * x_even[None, :, :]
                t += _dequant(w >> 4, s[:, :, None], z[:, :, None]) * x_odd[None, :, :]
                acc += tl.sum(t, axis=2)
            w_ptrs += BLOCK_K // 2
            s_ptrs += NG * N
            z_ptrs += NG * N
            x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]: one row of x per program
    offs_m = pid_m + tl.arange(0, 1)
    if ARGMAX:
        r = tl.reshape(y, (1, BLOCK_N)).to(x_ptr.dtype.element_ty).to(tl.float32)
        _block_pick(r, offs_m, offs_m < M, offs_n, n_ok, pid_n * BLOCK_N, pmax_ptr + pid_n, pidx_ptr + pid_n, keep_ptr,
                    logit_ptr, stride_lm, softcap, NUM_P, HAS_KEEP, STORE_LOGITS, WANT_IDS, SOFTCAP)
    else:
        _split_store(y, offs_n, offs_m, n_ok, offs_m < M, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, SPLIT, FIXUP)


@triton.jit
def _mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_qn, stride_om,
    K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, FIXUP: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    NG: tl.constexpr = BLOCK_K // GROUP
    HG: tl.constexpr = GROUP // 2
    HK: tl.constexpr = BLOCK_K // 2  # bytes per row and iteration = pairs of k

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_g = tl.arange(0, NG)
    offs_b = tl.arange(0, HG)
    w_ptrs = (qw_ptr + pid_k * (K_SPLIT // 2) + offs_n[:, None, None] * stride_qn
              + offs_g[None, :, None] * HG + offs_b[None, None, :])
    g0 = pid_k * (K_SPLIT // GROUP)
    s_ptrs = s_ptr + (g0 + offs_g)[None, :] * N + offs_n[:, None]
    z_ptrs = z_ptr + (g0 + offs_g)[None, :] * N + offs_n[:, None]
    x_ptrs = x_ptr + pid_k * K_SPLIT + offs_m[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        w = tl.load(w_ptrs, mask=n_ok[:, None, None], other=0).to(tl.int32)
        s = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
        z = tl.load(z_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HK, 2)))
        # [BLOCK_N, NG, HG] -> [BLOCK_N, HK]: column h is the pair (2h, 2h + 1) of this K block
        w_lo = tl.reshape(_dequant(w & 0xF, s, z), (BLOCK_N, HK)).to(x.dtype)
        w_hi = tl.reshape(_dequant(w >> 4, s, z), (BLOCK_N, HK)).to(x.dtype)
        acc = tl.dot(w_lo, tl.trans(x_even), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(w_hi, tl.trans(x_odd), acc, input_precision=DOT_PRECISION)
        w_ptrs += HK
        s_ptrs += NG * N
        z_ptrs += NG * N
        x_ptrs += BLOCK_K
    _split_store(acc, offs_n, offs_m, n_ok, m_ok, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, SPLIT, FIXUP)


# 4 code bytes (the pack of 4 elements Triton hands the block, in element order) -> 8 weights:
# $0 $1 the low nibbles, $2 $3 the high ones, as bf16 pairs; $5 $6 / $7 $8 the elements' scales /
# zeros as bf16 pairs. PRMT spreads bytes 0, 1 (2, 3) into the low bytes of a word's two halves, so
# each LOP3 ORs a nibble pair into the mantissas of 128.0 (0x4300: 128 + q exactly) already in
# element order; one fma subtracts 128 (exact), one fma gives q * s + z, rounded once. 16
# instructions per 8 weights (2 PRMT, 2 shifts, 4 LOP3, 8 fma; 19 when the pairs were reordered
# after the LOP3s by 4 PRMT).
_DEQUANT_BF16 = tl.constexpr("""{
.reg .b32 a, b, c, d, t0, t1, zero, one, m128;
mov.b32 zero, 0;
mov.b32 one, 0x3F803F80;
mov.b32 m128, 0xC300C300;
prmt.b32 t0, $4, zero, 0x4140;
prmt.b32 t1, $4, zero, 0x4342;
lop3.b32 a, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 b, t1, 0x000F000F, 0x43004300, 0xEA;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 c, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 d, t1, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 a, a, one, m128;
fma.rn.bf16x2 b, b, one, m128;
fma.rn.bf16x2 c, c, one, m128;
fma.rn.bf16x2 d, d, one, m128;
fma.rn.bf16x2 $0, a, $5, $7;
fma.rn.bf16x2 $1, b, $6, $8;
fma.rn.bf16x2 $2, c, $5, $7;
fma.rn.bf16x2 $3, d, $6, $8;
}""")


@triton.jit
def _dequant_bytes(w, s, z, ASM: tl.constexpr):
    """Code bytes w (uint8) and their rows' scale / zero (broadcast to w's shape) -> (low, high
    nibbles dequantized) in s's dtype: q * s + z rounded once."""
    if ASM:  # bf16 on the GPU
        return tl.inline_asm_elementwise(_DEQUANT_BF16, "=r,=r,=r,=r,r,r,r,r,r", [w, s, z],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    sf = s.to(tl.float32)
    zf = z.to(tl.float32)
    lo = (w & 0xF).to(tl.float32) * sf + zf
    hi = (w >> 4).to(tl.float32) * sf + zf
    return lo.to(s.dtype), hi.to(s.dtype)


@triton.jit
def _unpack_sz(v, DT: tl.constexpr):
    """int32 words (scale in the low 16 bits, zero in the high 16: `pack_scale_zero`) -> (s, z) in DT."""
    return (v & 0xFFFF).to(tl.int16).to(DT, bitcast=True), (v >> 16).to(tl.int16).to(DT, bitcast=True)


@triton.jit
def _group_load(w_ptrs, s_ptrs, z_ptrs, n_ok, EVEN_N: tl.constexpr):
    """One scale group of a [R, GROUP] weight tile: its code bytes [R, GROUP / 2], scales and zeros [R]."""
    if EVEN_N:
        return tl.load(w_ptrs), tl.load(s_ptrs), tl.load(z_ptrs)
    return (tl.load(w_ptrs, mask=n_ok[:, None], other=0), tl.load(s_ptrs, mask=n_ok, other=0.0),
            tl.load(z_ptrs, mask=n_ok, other=0.0))


@triton.jit
def _group_load_sz(w_ptrs, sz_ptrs, n_ok, EVEN_N: tl.constexpr, DT: tl.constexpr):
    """`_group_load` from packed (scale, zero) int32 words (`pack_scale_zero`): one 32-bit load per
    row, which Triton's pipeliner streams ahead with the codes (it leaves 2-byte loads in the loop)."""
    if EVEN_N:
        w = tl.load(w_ptrs)
        v = tl.load(sz_ptrs)
    else:
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        v = tl.load(sz_ptrs, mask=n_ok, other=0)
    s, z = _unpack_sz(v, DT)
    return w, s, z


@triton.jit
def _group_mma(w, s, z, x_even, x_odd, acc, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Dequantize one group to x's dtype, two dots (low / high nibbles against the even / odd
    columns of x [BLOCK_M, GROUP / 2]) into acc [R, BLOCK_M]."""
    w_lo, w_hi = _dequant_bytes(w, s[:, None], z[:, None], ASM)
    acc = tl.dot(w_lo.to(x_even.dtype), tl.trans(x_even), acc, input_precision=DOT_PRECISION)
    return tl.dot(w_hi.to(x_odd.dtype), tl.trans(x_odd), acc, input_precision=DOT_PRECISION)


@triton.jit
def _group_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_qn, stride_om,
    K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, FIXUP: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    aux_ptr=None, stride_am=0, HALF: tl.constexpr = 0, EPI: tl.constexpr = 0, SZ: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    HG: tl.constexpr = GROUP // 2  # bytes per group and row: k = 2j (low nibble), 2j + 1 (high)
    DT: tl.constexpr = x_ptr.dtype.element_ty

    # EPI 1 (GeGLU): BLOCK_N gate rows i0.. and the same up rows HALF + i0.. as two tiles, each with
    # affine row offsets (one tile over both runs cost a pointer register per row: 80 -> 102-114
    # registers at 32 x 16 tiles, 2 warps, and the occupancy with them)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < (HALF if EPI == 1 else N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    w_ptrs = qw_ptr + pid_k * (K_SPLIT // 2) + offs_n[:, None] * stride_qn + tl.arange(0, HG)[None, :]
    g0 = pid_k * (K_SPLIT // GROUP)
    s_ptrs = s_ptr + g0 * N + offs_n
    z_ptrs = z_ptr + g0 * N + offs_n
    x_ptrs = x_ptr + pid_k * K_SPLIT + offs_m[:, None] * stride_xm + tl.arange(0, GROUP)[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # EPI 1 only: the up rows
    up = HALF * stride_qn  # EPI 1: the up tile's byte offset
    _pdl_wait(PDL)
    for _ in range(0, K_SPLIT, GROUP):
        if SZ:
            w, s, z = _group_load_sz(w_ptrs, s_ptrs, n_ok, EVEN_N, DT)
        else:
            w, s, z = _group_load(w_ptrs, s_ptrs, z_ptrs, n_ok, EVEN_N)
        if EPI == 1:
            if SZ:
                w_u, s_u, z_u = _group_load_sz(w_ptrs + up, s_ptrs + HALF, n_ok, EVEN_N, DT)
            else:
                w_u, s_u, z_u = _group_load(w_ptrs + up, s_ptrs + HALF, z_ptrs + HALF, n_ok, EVEN_N)
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)  # [BLOCK_M, GROUP]
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HG, 2)))
        acc = _group_mma(w, s, z, x_even, x_odd, acc, ASM, DOT_PRECISION)
        if EPI == 1:
            acc_u = _group_mma(w_u, s_u, z_u, x_even, x_odd, acc_u, ASM, DOT_PRECISION)
        w_ptrs += HG
        s_ptrs += N
        z_ptrs += N
        x_ptrs += GROUP
    _pdl_trigger(PDL)
    _split_store(acc, offs_n, offs_m, n_ok, m_ok, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, SPLIT, FIXUP,
                 aux_ptr, stride_am, HALF, EPI, acc_u)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, NG, K: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """W [N, K] in w's dtype from the codes: BLOCK_N rows x BLOCK_G groups per program, q * s + z in
    fp32 (as dequantize_int4), rounded once."""
    HG: tl.constexpr = GROUP // 2
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = (rows < N)[:, None] & (g < NG)[None, :]  # [BLOCK_N, BLOCK_G]
    j = tl.arange(0, HG)
    codes = tl.load(qw_ptr + rows[:, None, None] * (K // 2) + g[None, :, None] * HG + j[None, None, :],
                    mask=ok[:, :, None], other=0).to(tl.int32)
    sc = tl.load(s_ptr + g[None, :] * N + rows[:, None], mask=ok, other=0.0).to(tl.float32)[:, :, None]
    zr = tl.load(z_ptr + g[None, :] * N + rows[:, None], mask=ok, other=0.0).to(tl.float32)[:, :, None]
    lo = (codes & 15).to(tl.float32) * sc + zr  # k = 2j
    hi = (codes >> 4).to(tl.float32) * sc + zr  # k = 2j + 1
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_G, GROUP))
    k = g[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    tl.store(w_ptr + rows[:, None, None] * K + k, w.to(w_ptr.dtype.element_ty), mask=ok[:, :, None])


def dequantize_int4_triton(qweight, scales, zeros, group_size: int, dtype: torch.dtype,
                           block_n: int = 64, block_g: int = 4) -> torch.Tensor:
    """W [N, K] in dtype, one launch (the Triton twin of dequantize_int4; CUDA or the interpreter)."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    w = torch.empty(N, K, device=qweight.device, dtype=dtype)
    NG = K // group_size
    _dequant_kernel[(triton.cdiv(N, block_n), triton.cdiv(NG, block_g))](
        qweight, scales, zeros, w, N, NG, K=K, GROUP=group_size, BLOCK_N=block_n, BLOCK_G=block_g, num_warps=4)
    return w


@triton.jit
def _splitk_reduce_kernel(ws_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    # ws [SPLIT_K, M, N] fp32 -> out [M, N], summed in split order (deterministic)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sk in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + sk * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# launcher


# split_k > 1: the K splits' partials are summed by the last program of each output tile to finish
# (True), or by a second launch, `_splitk_reduce_kernel` (False: the baseline; the same sums)
SPLIT_FIXUP = True
# the per-group kernel reads packed scale / zero words where the caller passes them (`sz`; True), or
# the separate scales and zeros (False: the baseline). Read at launch, as SPLIT_FIXUP
PACKED_SZ = True


EPILOGUES = {"none": 0, "geglu": 1, "gelu_mul": 2}


def apply_epilogue(y: torch.Tensor, epilogue: str, aux: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin of the kernels' epilogues on a GEMM output y [M, N] (in the activation dtype):
    none; geglu: gelu_tanh(y[:, :N/2]) * y[:, N/2:] (W = [gate; up]); gelu_mul: gelu_tanh(y) * aux."""
    if epilogue == "geglu":
        gate, up = y.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if epilogue == "gelu_mul":
        return F.gelu(y, approximate="tanh") * aux
    return y


def check_epilogue(epilogue: str, M: int, N: int, aux: torch.Tensor | None) -> None:
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {sorted(EPILOGUES)}, got {epilogue!r}")
    if epilogue == "geglu" and N % 2:
        raise ValueError(f"the geglu epilogue pairs gate and up rows: N must be even, got {N}")
    if (epilogue == "gelu_mul") != (aux is not None):
        raise ValueError("aux [M, N] goes with the gelu_mul epilogue, and only with it")
    if aux is not None and (tuple(aux.shape) != (M, N) or aux.stride(-1) != 1):
        raise ValueError(f"aux must be [M, N] = [{M}, {N}] with unit stride along N, got {tuple(aux.shape)} "
                         f"strides {aux.stride()}")


def check_int4_operands(x, qweight, scales, zeros, group_size: int) -> tuple[int, int, int]:
    """x [M, K] and W as `quantize_int4` + `pack_int4` give it (qweight uint8 [N, K/2], scales / zeros [K/G, N],
    contiguous, int32 offsets) -> (M, N, K); a ValueError names what does not fit. The GEMV kernel's launchers
    (`w4a16_matmul`, kernels/sparse_argmax.head_argmax_int4) check with it."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    N = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] * 2 != K:
        raise ValueError(f"qweight must be uint8 [N, K/2] = [{N}, {K // 2}], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    if K % group_size or scales.shape != (K // group_size, N) or zeros.shape != scales.shape:
        raise ValueError(f"scales / zeros must be [K/G, N] = [{K // group_size}, {N}] for group size {group_size}, "
                         f"got {tuple(scales.shape)} / {tuple(zeros.shape)}")
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("qweight, scales and zeros must be contiguous")
    if N * K // 2 >= 2**31:
        raise ValueError(f"int32 offsets: N * K / 2 must stay below 2^31, got {N} x {K}")
    return M, N, K


def w4a16_matmul(x, qweight, scales, zeros, group_size: int, config: W4A16Config | None = None,
                 epilogue: str = "none", aux: torch.Tensor | None = None, sz: torch.Tensor | None = None,
                 pdl: bool = False):
    """x [M, K] (fp16 / bf16 / fp32) @ W^T -> [M, N] in x's dtype; W given as (qweight, scales,
    zeros) from `quantize_int4` + `pack_int4`. No host sync; the grid depends on shapes only.
    `epilogue` (apply_epilogue): geglu -> [M, N/2], gelu_mul (aux [M, N]) -> [M, N]; in the
    per-group kernel's store (its split-K fixup included), else applied in torch after the GEMM.
    `sz` (optional, `pack_scale_zero(scales, zeros)`): the per-group kernel reads it instead of
    scales and zeros when they have x's dtype (same values; other kernels ignore it).
    `pdl` (sm90+, the per-group kernel; others ignore it): programmatic dependent launch. The kernel
    waits for the previous one before it reads or writes anything and lets the next one launch
    after its main loop (`_pdl_trigger`), so that kernel's launch overlaps this one's stores."""
    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError("w4a16_matmul runs on CUDA tensors (or with TRITON_INTERPRET=1); "
                           "use w4a16_torch on the CPU")
    M, N, K = check_int4_operands(x, qweight, scales, zeros, group_size)
    check_epilogue(epilogue, M, N, aux)
    if sz is not None and (sz.dtype != torch.int32 or sz.shape != scales.shape or not sz.is_contiguous()):
        raise ValueError(f"sz must be contiguous int32 {tuple(scales.shape)} (pack_scale_zero), "
                         f"got {sz.dtype} {tuple(sz.shape)}")
    if M == 0:
        return x.new_empty(0, N // 2 if epilogue == "geglu" else N)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = resolve_config(M, N, K, group_size, config)
    split = cfg.split_k
    fixup = SPLIT_FIXUP and split > 1
    if epilogue != "none" and not (cfg.per_group and (split == 1 or fixup)):  # the GEMM, then torch's epilogue
        return apply_epilogue(w4a16_matmul(x, qweight, scales, zeros, group_size, cfg, sz=sz), epilogue, aux)
    if cfg.dequant:  # prompt chunks: bf16 W once, then the GEMM through cuBLAS
        w = dequantize_int4_triton(qweight, scales, zeros, group_size, x.dtype, cfg.block_n,
                                   cfg.block_k // group_size)
        return F.linear(x, w)
    k_split = K // split
    epi = EPILOGUES[epilogue]
    n_out = N // 2 if epi == 1 else N
    out = torch.empty(M, n_out, device=x.device, dtype=x.dtype)
    ws = out if split == 1 and epi != 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    # EPI 1: a program takes block_n gate rows and the same up rows (2 x block_n rows of W)
    grid = (triton.cdiv(N // 2 if epi == 1 else N, cfg.block_n), split, triton.cdiv(M, cfg.block_m))
    cnt = arrival_counters(x.device, grid[0] * grid[2], "w4a16 split-K") if fixup else ws
    head = (x, qweight, scales, zeros, out, ws, cnt, M, N, x.stride(0), qweight.stride(0), n_out)
    if cfg.block_m == 1:  # grid over rows of x
        _gemv_kernel[grid](
            *head, K_SPLIT=k_split, SPLIT=split, FIXUP=fixup, GROUP=group_size, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, FACTORED=cfg.factored, WORDS=cfg.words and cfg.factored, ASM=not _INTERPRET,
            EXACT=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    else:  # the tl.dot kernels: programs over N tiles, K splits and M tiles
        common = dict(K_SPLIT=k_split, SPLIT=split, FIXUP=fixup, GROUP=group_size, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n,
                      DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 x: no TF32 rounding
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.per_group:
            asm = x.dtype == torch.bfloat16 and scales.dtype == torch.bfloat16 and not _INTERPRET
            even = (N // 2 if epi == 1 else N) % cfg.block_n == 0
            packed = PACKED_SZ and sz is not None and scales.dtype == x.dtype
            if packed:  # scales / zeros as one int32 word per row and group
                head = head[:2] + (sz, sz) + head[4:]
            _group_mma_kernel[grid](*head, EVEN_N=even, ASM=asm, SZ=packed, aux_ptr=aux,
                                    stride_am=0 if aux is None else aux.stride(0),
                                    HALF=N // 2 if epi == 1 else 0, EPI=epi, **common, **pdl_args(pdl, x.device))
        else:
            _mma_kernel[grid](*head, BLOCK_K=cfg.block_k, **common)
    if split > 1 and not fixup:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](ws, out, M * N, SPLIT_K=split, BLOCK=block)
    return out


# The launcher as an opaque op, so torch.compile traces around it (dispatch-table tiles only).
@torch.library.custom_op("fastgemma::w4a16_matmul", mutates_args=())
def w4a16_matmul_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, sz: torch.Tensor | None = None) -> torch.Tensor:
    return w4a16_matmul(x, qweight, scales, zeros, group_size, sz=sz)


@w4a16_matmul_op.register_fake
def _(x, qweight, scales, zeros, group_size, sz=None):
    return x.new_empty((x.shape[0], qweight.shape[0]))


# The launcher with an epilogue (the verify pass's GeGLU and PLE gate, fuse=layers), same dispatch.
@torch.library.custom_op("fastgemma::w4a16_epilogue", mutates_args=())
def w4a16_epilogue_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, epilogue: str, aux: torch.Tensor | None,
                      sz: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    return w4a16_matmul(x, qweight, scales, zeros, group_size, epilogue=epilogue, aux=aux, sz=sz, pdl=pdl)


@w4a16_epilogue_op.register_fake
def _(x, qweight, scales, zeros, group_size, epilogue, aux, sz=None, pdl=False):
    N = qweight.shape[0]
    return x.new_empty((x.shape[0], N // 2 if epilogue == "geglu" else N))
