"""INT4 weights: round-to-nearest quantization, nibble packing and its inverse (torch).

Format: asymmetric round-to-nearest int4 per group of G consecutive k (G in 32 / 64 / 128):
    w[n, k] ~= q[n, k] * scales[k // G, n] + zeros[k // G, n],   q in 0..15
`zeros` is the group minimum stored as a float (a tinygemm / HQQ style float zero point, no integer
code), so dequantization is one FMA and the RTN error is <= scale / 2 per element. With `clip_search`
a group's range is its (min, max) times the factor p in SHRINK whose codes leave the least
sum |w - dequant|^2.4 (GPTQ's Quantizer mse search: an outlier clipped for a finer grid elsewhere).

Layout of one W [N, K] (nn.Linear layout), K % G == 0:
    qweight  uint8 [N, K/2]  byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4     N*K/2 bytes
    scales   [K/G, N]        weight dtype (bf16 on the GPU; fp32 for fp32 models)  N*K/G*2 bytes (bf16)
    zeros    [K/G, N]        same dtype as scales                                  N*K/G*2 bytes (bf16)
Rows of qweight are contiguous along K: 16 bytes = 32 consecutive k of one row, and K/2 % 16 == 0
(G >= 32), so every row and every K block starts 16-byte aligned: weight loads can be 128-bit.
scales / zeros are group-major: BLOCK_N rows of one group are 2*BLOCK_N contiguous bytes.
E4B: 4.644B matrix params (tied head included) -> 2.32 GB int4 + 145 MB scale/zero at g128
(290 MB g64, 580 MB g32); the body alone (3.973B) -> 1.99 GB + 124 MB; bf16 reads 9.29 GB.
"""
from __future__ import annotations

import torch

GROUP_SIZES = (32, 64, 128)
SHRINK = tuple(1 - i / 100 for i in range(26))  # clip_search's range factors: 1.00, 0.99, .., 0.75
CLIP_NORM = 2.4  # the error's exponent in the search (GPTQ's)
SEARCH_CHUNK = 1 << 22  # elements of w searched at a time (bounds the search's temporaries)


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


def scale_zero(lo: torch.Tensor, hi: torch.Tensor, scale_dtype: torch.dtype):
    """A group range (lo, hi) -> its stored (scale, zero) in scale_dtype: 16 levels from lo to hi."""
    return ((hi - lo) / 15).to(scale_dtype), lo.to(scale_dtype)


def _codes(wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale_dtype: torch.dtype):
    """Groups wg [..., G] (fp32) on the ranges lo, hi [...] -> (codes [..., G] fp32, scale, zero [...] in
    scale_dtype), the codes from the stored scale and zero. A constant group (or a range that underflows
    the scale dtype) gets scale 0 and codes 0."""
    scale, zero = scale_zero(lo, hi, scale_dtype)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round((wg - z) / torch.where(s > 0, s, 1.0)), 0.0).clamp_(0, 15)
    return q, scale, zero


def group_range(wg: torch.Tensor, scale_dtype: torch.dtype, clip_search: bool = False):
    """Groups wg [..., G] (fp32) -> their ranges (lo, hi) [...]: (min, max), or with clip_search that times
    the factor of SHRINK with the least sum |w - dequant|^CLIP_NORM (ties: the widest)."""
    lo, hi = wg.amin(-1), wg.amax(-1)
    if not clip_search:
        return lo, hi
    factor = torch.ones_like(lo)  # the best factor of each group
    flat, lo1, hi1, f1 = wg.reshape(-1, wg.shape[-1]), lo.view(-1), hi.view(-1), factor.view(-1)
    step = max(1, SEARCH_CHUNK // wg.shape[-1])
    for r in range(0, flat.shape[0], step):
        x, l0, h0 = flat[r:r + step], lo1[r:r + step], hi1[r:r + step]
        best = torch.full_like(l0, float("inf"))
        for p in SHRINK:
            q, s, z = _codes(x, l0 * p, h0 * p, scale_dtype)
            err = (q * s.float().unsqueeze(-1) + z.float().unsqueeze(-1) - x).abs_().pow_(CLIP_NORM).sum(-1)
            better = err < best
            best = torch.where(better, err, best)
            f1[r:r + step] = torch.where(better, p, f1[r:r + step])
    return lo * factor, hi * factor


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype | None = None,
                  clip_search: bool = False):
    """RTN asymmetric int4. w [N, K] -> (codes [N, K] uint8, scales [K/G, N], zeros [K/G, N]).

    Codes are computed from the *stored* (rounded) scale and zero, so |w - dequant| <= scale / 2
    except at a clamped group end, where bf16 rounding of scale / zero adds ~2^-8 of the range
    (and, with clip_search, beyond a clipped end).
    """
    check_group_size(group_size)
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide K={K}")
    if scale_dtype is None:
        scale_dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float32
    wg = w.detach().float().reshape(N, K // group_size, group_size)
    q, scales, zeros = _codes(wg, *group_range(wg, scale_dtype, clip_search), scale_dtype)
    return q.to(torch.uint8).reshape(N, K), scales.t().contiguous(), zeros.t().contiguous()


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
    return dequantize_codes(unpack_int4(qweight), scales, zeros, group_size, dtype)


def dequantize_codes(codes, scales, zeros, group_size: int, dtype: torch.dtype = torch.float32):
    """`dequantize_int4` of codes not yet packed: codes [N, K] (0..15), scales / zeros [K/G, N] -> W [N, K]."""
    N, K = codes.shape
    q = codes.float().reshape(N, K // group_size, group_size)
    w = q * scales.t().float().unsqueeze(-1) + zeros.t().float().unsqueeze(-1)
    return w.reshape(N, K).to(dtype)
