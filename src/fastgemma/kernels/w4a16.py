"""INT4 weights x 16-bit activations (W4A16): packing, a Triton GEMV / skinny-GEMM kernel, torch twin.

Format: asymmetric round-to-nearest int4 per group of G consecutive k (G in 32 / 64 / 128):
    w[n, k] ~= q[n, k] * scales[k // G, n] + zeros[k // G, n],   q in 0..15
`zeros` is the group minimum stored as a float (a tinygemm / HQQ style float zero point, no integer
code), so dequantization is one FMA and the RTN error is <= scale / 2 per element.

Layout of one W [N, K] (nn.Linear layout), K % G == 0:
    qweight  uint8 [N, K/2]  byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4     N*K/2 bytes
    scales   [K/G, N]        weight dtype (bf16 on the GPU; fp32 for fp32 models)  N*K/G*2 bytes (bf16)
    zeros    [K/G, N]        same dtype as scales                                  N*K/G*2 bytes (bf16)
Rows of qweight are contiguous along K: 16 bytes = 32 consecutive k of one row, and K/2 % 16 == 0
(G >= 32), so every row and every K block starts 16-byte aligned: weight loads can be 128-bit.
scales / zeros are group-major: BLOCK_N rows of one group are 2*BLOCK_N contiguous bytes.
E4B: 4.644B matrix params (tied head included) -> 2.32 GB int4 + 145 MB scale/zero at g128
(290 MB g64, 580 MB g32); the body alone (3.973B) -> 1.99 GB + 124 MB; bf16 reads 9.29 GB.

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
Tiles come from `CONFIGS` (E4B shapes on the H200) or `default_config`; `resolve_config` fits them
to the shape. `bench_shapes` times every E4B shape against cuBLAS bf16 and can sweep candidates.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .counters import arrival_counters
from .fused_gemv import _gelu_tanh, _rnd
from .gemv import _pdl_trigger, _pdl_wait, pdl_args

GROUP_SIZES = (32, 64, 128)
MAX_DECODE_M = 16
_SMS = 132  # H200; the default heuristic's target for program counts
_INTERPRET = bool(triton.knobs.runtime.interpret)  # read where @triton.jit reads it: at import


# ---------------------------------------------------------------------------------------------
# packing (torch)


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes q [N, K] (uint8, 0..15) -> qweight [N, K/2] uint8, low nibble = even k."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even K, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return (q[..., 0::2] & 0xF) | (q[..., 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K/2] uint8 -> codes [N, K] uint8."""
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype | None = None):
    """RTN asymmetric int4. w [N, K] -> (codes [N, K] uint8, scales [K/G, N], zeros [K/G, N]).

    Codes are computed from the *stored* (rounded) scale and zero, so |w - dequant| <= scale / 2
    except at a clamped group end, where bf16 rounding of scale / zero adds ~2^-8 of the range.
    """
    check_group_size(group_size)
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide K={K}")
    if scale_dtype is None:
        scale_dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float32
    wg = w.detach().float().reshape(N, K // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/G]
    scales = ((hi - lo) / 15).to(scale_dtype)
    zeros = lo.to(scale_dtype)
    s = scales.float().unsqueeze(-1)
    z = zeros.float().unsqueeze(-1)
    # a constant group (or a range that underflows the scale dtype) gets scale 0 and codes 0
    q = torch.where(s > 0, torch.round((wg - z) / torch.where(s > 0, s, 1.0)), 0.0)
    q = q.clamp_(0, 15).to(torch.uint8).reshape(N, K)
    return q, scales.t().contiguous(), zeros.t().contiguous()


def pack_scale_zero(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """16-bit scales / zeros [K/G, N] -> int32 [K/G, N]: the scale's bits low, the zero's high. The
    per-group kernel reads one word per row and group (`w4a16_matmul(..., sz=...)`)."""
    if scales.dtype not in (torch.bfloat16, torch.float16) or zeros.dtype != scales.dtype:
        raise ValueError(f"pack_scale_zero needs 16-bit scales and zeros of one dtype, got {scales.dtype} / "
                         f"{zeros.dtype}")
    if scales.shape != zeros.shape:
        raise ValueError(f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} differ in shape")
    lo = scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return lo | (zeros.contiguous().view(torch.int16).to(torch.int32) << 16)


def dequantize_int4(qweight, scales, zeros, group_size: int, dtype: torch.dtype = torch.float32):
    """qweight [N, K/2], scales / zeros [K/G, N] -> W [N, K], computed in fp32, returned in dtype."""
    N, K = qweight.shape[0], qweight.shape[1] * 2
    q = unpack_int4(qweight).float().reshape(N, K // group_size, group_size)
    w = q * scales.t().float().unsqueeze(-1) + zeros.t().float().unsqueeze(-1)
    return w.reshape(N, K).to(dtype)


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
# dispatch


@dataclass(frozen=True)
class W4A16Config:
    """Tile sizes of one launch. block_m == 1 -> `_gemv_kernel` (grid over rows of x);
    block_m >= 16 -> `_mma_kernel`. block_k is a power-of-two multiple of the group size."""
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 1
    factored: bool = True  # GEMV only: scale / zero once per group (False: per weight, the baseline)
    words: bool = False  # GEMV only, factored: the int32 word loop (False: the byte loop)
    per_group: bool = False  # tl.dot only: `_group_mma_kernel` (block_k = the group size)
    dequant: bool = False  # prompt chunks: W dequantized to x's dtype in one launch (block_n rows x
    #                        block_k columns per program), then cuBLAS (F.linear); scratch N x K


def _gemv(bn, bk, split=1, warps=None, stages=3, words=False):
    # default warps: one 16-byte weight vector per thread and iteration
    warps = warps or max(1, min(8, bn * bk // 2 // 16 // 32))
    return W4A16Config(bn, bk, split, warps, stages, 1, words=words)


def _mma(bn, bk, split=1, warps=4, stages=3, bm=16):
    return W4A16Config(bn, bk, split, warps, stages, bm)


def _grp(bn, split=1, warps=4, stages=3, bm=16):
    return W4A16Config(bn, 128, split, warps, stages, bm, per_group=True)


def _deq(bn, bk):
    return W4A16Config(bn, bk, 1, 4, 1, 64, dequant=True)


# (m_bucket, N, K) -> config; m_bucket = 1 (GEMV), 16 (M <= 16), 64 (prompt chunks); chunks of
# DEQUANT_MIN_M (256) rows or more look up (256, N, K) first (table_config).
# M = 1: the GEMV is bound by its per-weight instructions (~8 per weight in the byte loop's sm_90a
# code), not by its tiling. The word loop (~3.6 at 16-32 rows per program) wins where N is large
# (gate|up 19.58 -> 12.55 us, W_plm 12.44 -> 9.62); below ~10k rows its larger tiles leave too few
# programs and the byte loop's small tiles stay ahead. The per-group tl.dot kernel loses at one row.
# M = 8: the first tl.dot kernel (MMA_M16) dequantized a [BLOCK_N, BLOCK_K] tile and reshaped it, so
# Triton moved the bf16 weights through shared memory into the mma layout; the per-group kernel
# converts the code bytes instead and is 1.1-1.8x faster, below cuBLAS reading bf16 on gate|up and
# down. `bench_shapes(sweep=True)` prints lines to paste here.
CONFIGS: dict[tuple[int, int, int], W4A16Config] = {
    # M = 1: bench_shapes(sweep=True) on the H200 (2026-11-30, graph-timed, weights out of L2), us,
    # factored kernel (scale / zero once per group); cuBLAS bf16 on the same shape after the slash.
    # Byte loop rows: this config / the word loop on its tiles (run P), else an earlier run.
    (1, 2048, 2560): _gemv(4, 512, 1, 2),     # q (KV-shared layers): 5.42 / 6.78 / 6.73
    (1, 4096, 2560): _gemv(4, 512, 1, 2),     # q (full, head_dim 512): 6.40 / 8.07 / 8.01
    (1, 512, 2560): _gemv(4, 512, 1, 2),      # k / v (sliding): 4.68 / 6.36
    (1, 1024, 2560): _gemv(4, 512, 1, 2),     # k / v (full): 4.93 / 15.22
    (1, 3072, 2560): _gemv(4, 512, 1, 2),     # q|k|v merged (sliding): 5.93 / 7.29 / 7.24
    (1, 6144, 2560): _gemv(4, 512, 1, 2),     # q|k|v merged (full): 7.93 / 10.14 / 11.45
    (1, 2560, 2048): _gemv(4, 1024, 1, 4),    # o (sliding): 4.26 / 4.74 / 6.22
    (1, 2560, 4096): _gemv(4, 1024, 1, 4),    # o (full): 6.08 / 7.76 / 10.59
    (1, 10240, 2560): _gemv(4, 512, 1, 2),    # gate / up: 12.02 / 15.27
    (1, 2560, 10240): _gemv(4, 1024, 1, 4),   # down: 11.87 / 16.46 / 18.15
    (1, 256, 2560): _gemv(4, 512, 1, 4),      # PLE gate (skipped by default): 4.17 / 6.31
    (1, 2560, 256): _gemv(4, 256, 1, 2),      # PLE projection: 2.10 / 2.36 / 3.22
    # word loop (run P): this config / the byte loop on the old table's tiles / cuBLAS bf16
    (1, 20480, 2560): _gemv(16, 512, 1, 2, words=True),  # gate|up merged: 12.55 / 19.58 / 28.21
    (1, 10752, 2560): _gemv(16, 512, 1, 2, words=True),  # W_plm: 9.62 / 12.44 / 15.40
    # the int4 head (lm_head=int4), run V: 106.98 us (3.3 TB/s) / the byte loop at 16 x 512, 8 warps 218.99
    (1, 262144, 2560): _gemv(32, 512, 1, 2, words=True),
    # M = 2..16 (the verify pass): the per-group kernel on packed scale / zero words (`pack_scale_zero`,
    # streamed ahead with the codes). bench_shapes(ms=(8,), sweep=True, per_group_only=True, packed=True)
    # on the H200 (2026-11-30, graph-timed, weights out of L2), us at M = 8: this config (run BD, which
    # added 32 rows per warp: 64 x 2 warps) / run BA's best on 16 rows per warp / the previous entry
    # (PER_GROUP_SEPARATE) on separate scales / zeros (run BA) / cuBLAS bf16 (run BD)
    (16, 2048, 2560): _grp(32, 4, 2),       # q (KV-shared layers): 5.45 / 5.46 / 6.84 / 6.75
    (16, 4096, 2560): _grp(64, 4, 2),       # q (full): 6.23 / 6.38 / 7.93 / 7.91
    (16, 3072, 2560): _grp(64, 5, 2),       # q|k|v: 5.70 / 5.99 / 7.06 / 7.17
    (16, 6144, 2560): _grp(64, 5, 2),       # q|k|v (full): 7.10 / 7.42 / 8.82 / 10.38
    (16, 2560, 2048): _grp(64, 8, 2),       # o: 5.35 / 5.38 / 6.83 / 6.18
    (16, 2560, 4096): _grp(64, 8, 2),       # o (full): 6.80 / 7.34 / 7.85 / 9.43
    # gate|up runs with the GeGLU epilogue (block_n = rows of each half), run BD, us: 32/4/2 15.46,
    # 32/2/2 15.82 (run BA: 15.80; separate scales / zeros 18.56), 64/4/2 17.15, 16/2/1 17.21, 32/1/2
    # 18.62, 64/2/2 18.61; plain (no epilogue) 64/2/2 15.09, 32/2/2 17.51; cuBLAS bf16 28.64
    (16, 20480, 2560): _grp(32, 4, 2),      # gate|up
    (16, 2560, 10240): _grp(64, 8, 2),      # down: 11.06 / 12.74 / 13.80 / 18.31
    (16, 2560, 256): _grp(16, 1, 1),        # PLE projection: 2.74 / 2.72 / 3.46 / 3.18
    (16, 10752, 2560): _grp(64, 4, 2),      # W_plm: 9.49 / 10.83 / 13.14 / 15.52
    (16, 262144, 2560): _mma(64, 128),      # head: 254.32 with this tl.dot config; per-group untimed
    # M > 16 (prompt chunks): the per-group kernel on large tiles. bench_shapes(ms=(256,), sweep=True,
    # graph=False) on the H200 (2026-11-30, eager launches, weights out of L2), us at M = 256: this
    # config / the first tl.dot kernel's default (_mma(64, 256, 1, 4, 3, 64)) / cuBLAS bf16
    (64, 3072, 2560): _grp(64, 1, 4, 3, 64),     # q|k|v: 35.07 / 35.44 / 14.11
    (64, 6144, 2560): _grp(64, 1, 4, 3, 64),     # q|k|v (full): 39.01 / 65.98 / 19.50
    (64, 2560, 2048): _grp(64, 1, 4, 3, 64),     # o: 25.38 / 30.59 / 11.02
    (64, 2560, 4096): _grp(64, 1, 4, 3, 128),    # o (full): 49.25 / 101.17 / 16.38
    (64, 20480, 2560): _grp(64, 1, 4, 3, 128),   # gate|up: 103.90 / 161.30 / 46.50
    (64, 2560, 10240): _grp(64, 1, 4, 3, 64),    # down: 101.10 / 125.31 / 33.66
    (64, 2560, 256): _grp(64, 1, 4, 3, 64),      # PLE projection: 7.14 / 9.25 / 6.59
    (64, 10752, 2560): _grp(128, 1, 8, 3, 256),  # W_plm: 62.02 / 97.41 / 28.54
    # M >= 256: W dequantized once per call, then cuBLAS, where it wins. bench_shapes(ms=(256,),
    # sweep=True, graph=False) on the H200 (run AF, eager launches, weights out of L2), us at M = 256:
    # this config / the per-group kernel's best tiles / cuBLAS bf16. Smaller shapes keep the M > 16
    # entries above (eager timings below ~50 us were launch-bound in that run)
    (256, 20480, 2560): _deq(16, 512),     # gate|up: 86.06 / 99.46 / 46.40
    (256, 2560, 10240): _deq(16, 1024),    # down: 52.83 / 92.90 / 33.73
    (256, 10752, 2560): _deq(16, 512),     # W_plm: 49.86 / 64.35 / 28.02
}

# M = 2..16, the per-group kernel on separate scales / zeros (PACKED_SZ = False): the table before
# the packed words, kept as the baseline of `bench.spec --verify-tiles separate`. Run AF (2026-11-30),
# us at M = 8; PLE projection and W_plm re-swept then
PER_GROUP_SEPARATE: dict[tuple[int, int, int], W4A16Config] = {
    (16, 2048, 2560): _grp(64, 5, 4),       # q (KV-shared layers): 6.82
    (16, 4096, 2560): _grp(64, 5, 4),       # q (full): 7.76
    (16, 3072, 2560): _grp(64, 5, 4),       # q|k|v: 7.02
    (16, 6144, 2560): _grp(32, 4, 2),       # q|k|v (full): 8.80
    (16, 2560, 2048): _grp(32, 4, 2),       # o: 6.80
    (16, 2560, 4096): _grp(64, 8, 4),       # o (full): 7.77
    (16, 20480, 2560): _grp(32, 2, 2),      # gate|up: 17.00 (GeGLU epilogue: 18.50, run AL)
    (16, 2560, 10240): _grp(64, 8, 4),      # down: 13.81
    (16, 2560, 256): _grp(32, 1, 2),        # PLE projection: 2.68
    (16, 10752, 2560): _grp(64, 4, 4),      # W_plm: 13.14
}

# M = 2..16 through the first tl.dot kernel (`_mma_kernel`): the table before the per-group
# kernel, kept as the baseline of `bench.spec --verify-tiles mma`. bench_shapes(ms=(8,), sweep=True)
# on the H200 (2026-11-30), us at M = 8: this config / the first untimed guess / cuBLAS bf16
MMA_M16: dict[tuple[int, int, int], W4A16Config] = {
    (16, 2048, 2560): _mma(32, 256, 5),     # q: 10.31 / 17.66 / 6.74
    (16, 4096, 2560): _mma(64, 128, 2),     # q (full): 13.42 / 23.61 / 7.97
    (16, 3072, 2560): _mma(32, 256, 5),     # q|k|v: 12.56 / 23.64 / 7.24
    (16, 6144, 2560): _mma(64, 128, 2),     # q|k|v (full): 15.37 / 23.20 / 10.61
    (16, 2560, 2048): _mma(32, 256, 4),     # o: 10.26 / 19.38 / 6.22
    (16, 2560, 4096): _mma(32, 256, 8),     # o (full): 15.80 / 27.54 / 10.45
    (16, 20480, 2560): _mma(64, 128, 2),    # gate|up: 27.37 / 33.96 / 29.50
    (16, 2560, 10240): _mma(32, 256, 8),    # down: 29.82 / 63.58 / 18.39
    (16, 2560, 256): _mma(64, 256),         # PLE projection: 2.85 / 4.33 / 3.19
    (16, 10752, 2560): _mma(64, 128, 2),    # W_plm: 18.93 / 31.59 / 15.78
}


DEQUANT_MIN_M = 256  # prompt chunks of this many rows look up the (256, N, K) entries first


def m_bucket(M: int) -> int:
    return 1 if M == 1 else (MAX_DECODE_M if M <= MAX_DECODE_M else 64)


def table_config(M: int, N: int, K: int) -> W4A16Config | None:
    """CONFIGS' entry for this launch: (m_bucket, N, K); chunks of DEQUANT_MIN_M rows or more try
    (DEQUANT_MIN_M, N, K) first (dequantizing W once costs the same for any M: worth it on long
    chunks, not on short ones)."""
    if M >= DEQUANT_MIN_M and (DEQUANT_MIN_M, N, K) in CONFIGS:
        return CONFIGS[(DEQUANT_MIN_M, N, K)]
    return CONFIGS.get((m_bucket(M), N, K))


def default_config(M: int, N: int, K: int) -> W4A16Config:
    """Shapes missing from CONFIGS: halve BLOCK_N until there are ~2 waves of programs."""
    bucket = m_bucket(M)
    if bucket == 1:
        bn = 8
        while bn > 2 and triton.cdiv(N, bn) < 2 * _SMS:
            bn //= 2
        return _gemv(bn, 512)
    if bucket == MAX_DECODE_M:
        bn = 32 if N >= 8192 else 16
        split = max(1, min(8, (2 * _SMS) // triton.cdiv(N, bn)))
        return _grp(bn, split, bn // 16)
    return _mma(64, 256, 1, 4, 3, 64)


def resolve_config(M: int, N: int, K: int, group_size: int, config: W4A16Config | None = None) -> W4A16Config:
    """The config a launch uses: `config`, else CONFIGS[(m_bucket, N, K)], else default_config,
    fitted to the shape: block_k -> the largest G * 2^j <= block_k dividing K; split_k -> the
    largest divisor of K / block_k <= split_k (so no K masks are needed). K / split_k is a
    constexpr of the kernels: one compile per (K, split, tiles), so warm up before graph capture."""
    cfg = config or table_config(M, N, K) or default_config(M, N, K)
    for name in ("block_n", "block_m"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"W4A16Config.{name} must be a power of two, got {v}")
    if cfg.block_m != 1 and cfg.block_m < 16:
        raise ValueError(f"W4A16Config.block_m must be 1 (GEMV) or >= 16 (tl.dot), got {cfg.block_m}")
    if cfg.block_m >= 16 and cfg.block_n < 16:
        raise ValueError(f"tl.dot needs block_n >= 16, got {cfg.block_n}")
    if cfg.per_group and cfg.block_m == 1:
        raise ValueError("W4A16Config.per_group needs block_m >= 16 (it is a tl.dot kernel)")
    if cfg.dequant and (cfg.per_group or cfg.block_m == 1 or cfg.split_k != 1):
        raise ValueError("W4A16Config.dequant is a prompt-chunk path: block_m >= 16, no split_k, not per_group")
    bk = group_size
    while bk * 2 <= cfg.block_k and K % (bk * 2) == 0 and not cfg.per_group:
        bk *= 2
    blocks = K // bk
    split = max(d for d in range(1, min(cfg.split_k, blocks) + 1) if blocks % d == 0)
    if (bk, split) == (cfg.block_k, cfg.split_k):
        return cfg
    return dataclasses.replace(cfg, block_k=bk, split_k=split)


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
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    N = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.shape[1] * 2 != K:
        raise ValueError(f"qweight must be uint8 [N, K/2] = [{N}, {K // 2}], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    if scales.shape != (K // group_size, N) or zeros.shape != scales.shape:
        raise ValueError(f"scales / zeros must be [K/G, N] = [{K // group_size}, {N}], "
                         f"got {tuple(scales.shape)} / {tuple(zeros.shape)}")
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("qweight, scales and zeros must be contiguous")
    if N * K // 2 >= 2**31:
        raise ValueError(f"int32 offsets: N * K / 2 must stay below 2^31, got {N} x {K}")
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


# ---------------------------------------------------------------------------------------------
# benchmark (CUDA only; not a test)

E4B_SHAPES: dict[str, tuple[int, int]] = {  # name: (N, K)
    "q": (2048, 2560), "k/v": (512, 2560), "o": (2560, 2048),
    "q_full": (4096, 2560), "k/v_full": (1024, 2560), "o_full": (2560, 4096),
    "qkv": (3072, 2560), "qkv_full": (6144, 2560),
    "gate/up": (10240, 2560), "gate|up": (20480, 2560), "down": (2560, 10240),
    "ple_gate": (256, 2560), "ple_proj": (2560, 256), "w_plm": (10752, 2560),
}


def candidates(M: int, N: int, K: int, per_group_only: bool = False) -> list[W4A16Config]:
    """The grid `bench_shapes(sweep=True)` tries (before resolve_config fits it to the shape).
    Kept to ~16 per kernel: each distinct (K / split_k, tiles) is one compile."""
    if per_group_only:
        return per_group_candidates(M) if M <= MAX_DECODE_M else prefill_candidates()
    if M == 1:  # byte loop: small tiles; word loop: several rows per thread (they share x's loads)
        out = [_gemv(bn, bk, sk) for bn in (2, 4, 8) for bk in (512, 1024) for sk in (1, 2)]
        out += [_gemv(bn, bk, sk, w, words=True) for bn, bk, sk, w in (
            (8, 512, 1, 2), (16, 512, 1, 2), (16, 512, 2, 2), (32, 512, 1, 2), (32, 512, 2, 2), (32, 512, 4, 2),
            (16, 1024, 1, 4), (32, 1024, 1, 4), (32, 1024, 2, 4))]
        return out + per_group_candidates(M)
    if M > MAX_DECODE_M:  # prefill: large tiles, no splits; the first tl.dot kernel's default as the baseline
        return [default_config(M, N, K), _mma(128, 128, 1, 8, 3, 128)] + prefill_candidates() + [
            _deq(bn, bk) for bn, bk in ((32, 512), (64, 512), (16, 1024))]
    bm = MAX_DECODE_M
    out = [_mma(bn, bk, sk, 4, 3, bm) for bn in (16, 32, 64) for bk in (128, 256) for sk in (1, 2)]
    out += [_mma(bn, 256, sk, 4, 3, bm) for bn in (16, 32) for sk in (4, 8)] + [_mma(64, 256, 1, 8, 3, bm)]
    return out + per_group_candidates(M)


def prefill_candidates() -> list[W4A16Config]:
    """`_group_mma_kernel` tiles (block_n, block_m, warps, stages) for prompt chunks (M > 16)."""
    return [_grp(bn, 1, w, st, bm) for bn, bm, w, st in (
        (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3),
        (64, 256, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4))]


def per_group_candidates(M: int) -> list[W4A16Config]:
    """`_group_mma_kernel` tiles (block_n, split_k, warps), 16-row dot tiles, for M <= 16."""
    # 32 rows per warp (64 / 2 warps) share each group's x fragments over two row tiles: ~20% fewer
    # loop instructions per row than 16 rows per warp, at ~146 registers. The last five: the cp.async
    # pipeline's depth (2 or 4 stages instead of 3) on the tiles runs BA / BD chose most
    out = [_grp(bn, sk, w) for bn, sk, w in ((16, 1, 1), (16, 4, 1), (32, 1, 2), (32, 2, 2), (32, 4, 2), (64, 1, 4),
                                             (64, 2, 4), (64, 4, 4), (64, 8, 4), (128, 1, 4), (128, 2, 8), (128, 4, 8),
                                             (64, 1, 2), (64, 2, 2), (64, 4, 2), (64, 8, 2), (128, 2, 4), (128, 4, 4))]
    return out + [_grp(bn, sk, w, st) for bn, sk, w, st in ((32, 4, 2, 2), (32, 4, 2, 4), (64, 4, 2, 4), (64, 8, 2, 2),
                                                            (64, 8, 2, 4))]


def _time_reduce_launch(x, qw, s, z, qbufs, group_size, cfg, timed_us) -> dict:
    """A split config with SPLIT_FIXUP off (partials, then `_splitk_reduce_kernel`): its time, and
    whether the fixup's output equals it bit for bit."""
    global SPLIT_FIXUP
    from .bench_util import rotating as _rotating

    fixed = w4a16_matmul(x, qw, s, z, group_size, cfg)
    SPLIT_FIXUP = False
    try:
        base = w4a16_matmul(x, qw, s, z, group_size, cfg)
        t = timed_us(_rotating(qbufs, lambda a, b, c, d: w4a16_matmul(x, a, b, c, group_size, cfg, sz=d)))
    finally:
        SPLIT_FIXUP = True
    return dict(reduce_launch_us=t, fixup_equal=bool(torch.equal(fixed, base)))


def bench_shapes(ms=(1, 8, 16), group_size: int = 128, shapes: dict | None = None, dtype=torch.bfloat16,
                 sweep: bool = False, graph: bool = True, rep_ms: int = 20, device: str = "cuda",
                 per_group_only: bool = False, packed: bool = False) -> list[dict]:
    """Time each E4B shape: int4 kernel vs cuBLAS bf16 (F.linear), weights rotated out of L2.

    graph=True times inside CUDA graphs (do_bench_cudagraph; the decode path), False times eager
    launches (do_bench). sweep=True also tries `candidates` and prints CONFIGS lines for the best
    (per_group_only: the table's config and the per-group kernel's candidates only). packed=True:
    the per-group kernel reads `pack_scale_zero` words (the row keeps the table's config on separate
    scales / zeros as `separate_sz_us`). Returns one dict per (shape, M). Needs a CUDA device.
    """
    from .bench_util import WRONG_REL_ERR, copies_past_l2, max_rel_err, rotating, timer

    if not torch.cuda.is_available():
        raise RuntimeError("bench_shapes needs a CUDA device")
    dev = torch.device(device)
    shapes = shapes or E4B_SHAPES
    gen = torch.Generator(device=dev).manual_seed(0)
    timed_us = timer(graph, rep_ms)

    rows, best_lines = [], []
    print(f"{torch.cuda.get_device_name(dev)}  group {group_size}  {dtype}  "
          f"{'graph' if graph else 'eager'}  (us, GB/s of weight + scale bytes)")
    print(f"{'shape':>10} {'N':>6} {'K':>6} {'M':>3} | {'int4 us':>8} {'GB/s':>6} | {'bf16 us':>8} {'GB/s':>6} "
          f"| {'x':>5} | {'err':>8} | config")
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=dtype, generator=gen) * 0.02
        q, s, z = quantize_int4(w, group_size)
        qw = pack_int4(q)
        q_bytes = qw.numel() + 2 * s.numel() * s.element_size()
        qbufs = [(qw.clone(), s.clone(), z.clone(), pack_scale_zero(s, z) if packed else None)
                 for _ in range(copies_past_l2(q_bytes, dev))]
        sz = qbufs[0][3]
        wbufs = [(w.clone(),) for _ in range(copies_past_l2(w.numel() * w.element_size(), dev))]
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
            ref = w4a16_torch(x, qw, s, z, group_size)
            t_ref = timed_us(rotating(wbufs, lambda w_: F.linear(x, w_)))
            cfgs = [resolve_config(M, N, K, group_size)]
            if M == 1:  # the baselines, same tiles: per-weight dequantisation, then the other loop
                cfgs.append(dataclasses.replace(cfgs[0], factored=False))
                cfgs.append(dataclasses.replace(cfgs[0], words=not cfgs[0].words))
            if sweep:
                cfgs += [resolve_config(M, N, K, group_size, c) for c in candidates(M, N, K, per_group_only)]
                cfgs = list(dict.fromkeys(cfgs))
            results, err = [], float("nan")
            for cfg in cfgs:
                try:
                    e = max_rel_err(w4a16_matmul(x, qw, s, z, group_size, cfg, sz=sz), ref)
                    t = timed_us(rotating(qbufs, lambda a, b, c, d, cfg=cfg: w4a16_matmul(x, a, b, c, group_size, cfg,
                                                                                         sz=d)))
                except Exception as ex:  # out of resources for a candidate: skip it
                    print(f"    skip {cfg}: {type(ex).__name__}")
                    continue
                if cfg == cfgs[0]:
                    err = e  # the table's config: its error goes in the row
                if not e < WRONG_REL_ERR:  # a wrong candidate is reported and never chosen
                    print(f"    WRONG {cfg}: max rel err {e:.2e}")
                    continue
                results.append((t, cfg))
            t_tab, cfg_tab = results[0]
            t_best, cfg_best = min((r for r in results if r[1].factored), key=lambda r: r[0])
            t_base = next((t for t, c in results if not c.factored), float("nan"))
            t_other = next((t for t, c in results if c.factored and c.words != cfg_tab.words
                            and dataclasses.replace(c, words=cfg_tab.words) == cfg_tab), float("nan"))
            row = dict(shape=name, N=N, K=K, M=M, int4_us=t_tab, unfactored_us=t_base, other_loop_us=t_other,
                       bf16_us=t_ref, config=cfg_tab, best_us=t_best, best_config=cfg_best, max_rel_err=err)
            if cfg_tab.split_k > 1:  # the same tiles with the partials summed by a second launch
                row.update(_time_reduce_launch(x, qw, s, z, qbufs, group_size, cfg_tab, timed_us))
            if packed and cfg_tab.per_group:  # the table's tiles on separate scales / zeros
                row["separate_sz_us"] = timed_us(rotating(qbufs, lambda a, b, c, d: w4a16_matmul(
                    x, a, b, c, group_size, cfg_tab)))
            rows.append(row)
            print(f"{name:>10} {N:>6} {K:>6} {M:>3} | {t_tab:8.2f} {q_bytes / t_tab / 1e3:6.0f} | "
                  f"{t_ref:8.2f} {2 * N * K / t_ref / 1e3:6.0f} | {t_ref / t_tab:5.2f} | {err:8.1e} | {cfg_tab}"
                  + (f" | unfactored {t_base:.2f} us, {'byte' if cfg_tab.words else 'word'} loop {t_other:.2f} us"
                     if M == 1 else "")
                  + (f" | reduce launch {row['reduce_launch_us']:.2f} us, bitwise equal {row['fixup_equal']}"
                     if "reduce_launch_us" in row else "")
                  + (f" | separate scales / zeros {row['separate_sz_us']:.2f} us" if "separate_sz_us" in row else ""))
            if sweep:
                print(f"{'best':>10} {'':>6} {'':>6} {M:>3} | {t_best:8.2f} {q_bytes / t_best / 1e3:6.0f} | {cfg_best}")
                pg = [r for r in results if r[1].per_group]
                if pg:
                    t_pg, cfg_pg = min(pg, key=lambda r: r[0])
                    row.update(per_group_us=t_pg, per_group_config=cfg_pg)
                    print(f"{'per-group':>10} {'':>6} {'':>6} {M:>3} | {t_pg:8.2f} {q_bytes / t_pg / 1e3:6.0f} | {cfg_pg}")
                key = (DEQUANT_MIN_M if M >= DEQUANT_MIN_M else m_bucket(M), N, K)
                best_lines.append(f"    {key}: {cfg_best!r},  # {name}: {t_best:.2f} us")
        del qbufs, wbufs
    if sweep:
        print("\n# CONFIGS entries (block_n, block_k, split_k, num_warps, num_stages, block_m):")
        print("\n".join(best_lines))
    return rows


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
