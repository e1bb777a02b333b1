"""A 16-bit skinny GEMM (2..16 rows of x) with the int4 kernels' split-K fixup and epilogues.

The verify pass's dense PLE gate (256 x 2560, kept bf16 by quant=int4's default skip list) took a
cuBLAS launch (~6 us at 8 rows on the H200) and then an elementwise kernel for gelu_tanh(.) * the
layer's per-layer input. Here one launch does both: tl.dot over [BLOCK_N, BLOCK_K] weight tiles,
split-K partials summed by the last program of each output tile (w4a16._split_store), and the
epilogue in that store (w4a16._store_out: none, geglu, gelu_mul), rounded where the torch path
rounds. `skinny_matmul` launches, `skinny_matmul_op` is the opaque op, `skinny_matmul_ref` the twin.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .counters import arrival_counters
from .gemv import _pdl_trigger, _pdl_wait, pdl_args
from .w4a16 import EPILOGUES, _INTERPRET, _split_store, apply_epilogue, check_epilogue
from .w4a16_table import _SMS

MAX_M = 16


@triton.jit
def _w_tile(w_ptrs, n_ok, EVEN_N: tl.constexpr):
    if EVEN_N:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)


@triton.jit
def _dense_mma_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, aux_ptr, M, N, stride_xm, stride_wn, stride_om,
                      stride_am, HALF: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, FIXUP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EPI: tl.constexpr,
                      EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    # EPI 1 (GeGLU): ROWS gate rows and the same up rows (HALF on) as two tiles with affine offsets
    ROWS: tl.constexpr = BLOCK_N // 2 if EPI == 1 else BLOCK_N
    offs_n = pid_n * ROWS + tl.arange(0, ROWS)
    n_ok = offs_n < (HALF if EPI == 1 else N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    up = HALF * stride_wn
    acc = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)  # EPI 1 only
    _pdl_wait(PDL)
    for _ in range(0, K_SPLIT, BLOCK_K):
        x = tl.trans(tl.load(x_ptrs, mask=m_ok[:, None], other=0.0))
        acc = tl.dot(_w_tile(w_ptrs, n_ok, EVEN_N), x, acc, input_precision=DOT_PRECISION)
        if EPI == 1:
            acc_u = tl.dot(_w_tile(w_ptrs + up, n_ok, EVEN_N), x, acc_u, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    _pdl_trigger(PDL)
    _split_store(acc, offs_n, offs_m, n_ok, m_ok, out_ptr, ws_ptr, cnt_ptr, M, N, stride_om, SPLIT, FIXUP,
                 aux_ptr, stride_am, HALF, EPI, acc_u)


@dataclass(frozen=True)
class SkinnyConfig:
    """block_n rows of W x block_k columns per step; split_k programs along K (a divisor of
    K / block_k); 16 rows of x per program."""
    block_n: int = 16
    block_k: int = 128
    split_k: int = 4
    num_warps: int = 1
    num_stages: int = 3


# (N, K) -> tiles on the H200 (bench_shapes(sweep=True), graph-timed, weights out of L2), us at 8
# rows with the gelu_mul epilogue (run AJ, 2026-11-30): this config / the default tiles (16, 128,
# 10, 1 warp) / cuBLAS + torch's gelu * input
CONFIGS: dict[tuple[int, int], SkinnyConfig] = {
    (256, 2560): SkinnyConfig(16, 128, 10, 2),  # the PLE gate: 4.13 / 4.48 / 9.10
}


def fits(M: int, K: int) -> bool:
    """Whether the kernel takes this shape: at most MAX_M rows, K a multiple of 16."""
    return M <= MAX_M and K % 16 == 0


def default_config(N: int, K: int) -> SkinnyConfig:
    """~2 programs per SM: 16-row tiles, 128 columns a step (fewer where K needs), K split in up to 10 parts."""
    bn, bk = 16, 128
    while bk > 16 and K % bk:
        bk //= 2
    blocks = max(1, K // bk)
    want = max(1, 2 * _SMS // triton.cdiv(N, bn))
    split = max(d for d in range(1, min(want, 10, blocks) + 1) if blocks % d == 0)
    return SkinnyConfig(bn, bk, split, 1)


def resolve_config(N: int, K: int, config: SkinnyConfig | None = None) -> SkinnyConfig:
    cfg = config or CONFIGS.get((N, K)) or default_config(N, K)
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1) or cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"SkinnyConfig: block_n / block_k must be powers of two >= 16, got {cfg}")
    if K % cfg.block_k or (K // cfg.block_k) % cfg.split_k:
        raise ValueError(f"SkinnyConfig: block_k x split_k must divide K={K}, got {cfg}")
    return cfg


def check_rows_operands(who: str, x, w, epilogue: str, aux) -> tuple[int, int, int]:
    """The operands of a dense GEMM for a few rows (this one, kernels/rows_gemv.py) -> (M, N, K); a clear error
    for what does not fit: x [M <= MAX_M, K] and w [N, K] in one float dtype, on CUDA (or the interpreter), the
    epilogue and its aux (w4a16.check_epilogue)."""
    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError(f"{who} runs on CUDA tensors (or with TRITON_INTERPRET=1); use {who}_ref")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{who} needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or not x.dtype.is_floating_point:
        raise ValueError(f"{who}: x and w must share a float dtype, got {x.dtype} and {w.dtype}")
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_M:
        raise ValueError(f"{who} takes at most {MAX_M} rows of x, got {M}")
    check_epilogue(epilogue, M, N, aux)
    return M, N, K


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig | None = None, epilogue: str = "none",
                  aux: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (M <= 16, one dtype) -> [M, N] (geglu: [M, N/2]) in x's dtype, through
    `epilogue` (w4a16.apply_epilogue). No host sync. `pdl` (sm90+): programmatic dependent launch
    (as w4a16_matmul's: the wait first, the next kernel's launch after the main loop)."""
    M, N, K = check_rows_operands("skinny_matmul", x, w, epilogue, aux)
    epi = EPILOGUES[epilogue]
    n_out = N // 2 if epi == 1 else N
    if M == 0:
        return x.new_empty(0, n_out)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    cfg = resolve_config(N, K, config)
    split = cfg.split_k
    out = torch.empty(M, n_out, device=x.device, dtype=x.dtype)
    ws = out if split == 1 and epi != 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, cfg.block_n), split, 1)
    cnt = arrival_counters(x.device, grid[0], "skinny split-K") if split > 1 else ws
    even = (N // 2) % (cfg.block_n // 2) == 0 if epi == 1 else N % cfg.block_n == 0
    _dense_mma_kernel[grid](x, w, out, ws, cnt, aux, M, N, x.stride(0), w.stride(0), n_out,
                            0 if aux is None else aux.stride(0), HALF=N // 2 if epi == 1 else 0,
                            K_SPLIT=K // split, SPLIT=split, FIXUP=split > 1,
                            BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EPI=epi, EVEN_N=even,
                            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(pdl, x.device))
    return out


def skinny_matmul_ref(x, w, config=None, epilogue: str = "none", aux=None):
    """The twin: F.linear in x's dtype, then the epilogue in torch."""
    check_epilogue(epilogue, x.shape[0], w.shape[0], aux)
    return apply_epilogue(F.linear(x, w), epilogue, aux)


@torch.library.custom_op("fastgemma::skinny_matmul", mutates_args=())
def skinny_matmul_op(x: torch.Tensor, w: torch.Tensor, epilogue: str, aux: torch.Tensor | None,
                     pdl: bool = False) -> torch.Tensor:
    return skinny_matmul(x, w, epilogue=epilogue, aux=aux, pdl=pdl)


@skinny_matmul_op.register_fake
def _(x, w, epilogue, aux, pdl=False):
    return x.new_empty((x.shape[0], w.shape[0] // 2 if epilogue == "geglu" else w.shape[0]))


def candidates(N: int, K: int) -> list[SkinnyConfig]:
    """What bench_shapes(sweep=True) tries (fitted: configs whose split does not divide are skipped)."""
    return [SkinnyConfig(bn, bk, sk, w) for bn, bk, sk, w in (
        (16, 128, 4, 1), (16, 128, 5, 1), (16, 128, 10, 1), (16, 128, 20, 1), (16, 256, 5, 1), (16, 256, 10, 1),
        (32, 128, 5, 2), (32, 128, 10, 2), (16, 128, 10, 2), (32, 256, 5, 2), (64, 128, 10, 4))]


def bench_shapes(shapes: dict | None = None, ms=(8,), sweep: bool = True, epilogue: str = "gelu_mul",
                 dtype=torch.bfloat16, device: str = "cuda", rep_ms: int = 10) -> list[dict]:
    """Time the kernel with `epilogue` against cuBLAS + torch's epilogue (both inside CUDA graphs,
    weights rotated out of L2), each output checked against the twin first; prints CONFIGS lines."""
    from .bench_util import WRONG_REL_ERR, cuda_bench, max_rel_err, rotated_copies, rotating

    dev, gen, timed_us = cuda_bench(device, "skinny_gemm.bench_shapes", rep_ms)
    shapes = shapes or {"ple_gate": (256, 2560)}
    rows, lines = [], []
    print(f"{torch.cuda.get_device_name(dev)}  skinny GEMM + {epilogue} vs cuBLAS + torch (us)")
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=dtype, generator=gen) * 0.02
        bufs = rotated_copies(w)
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
            aux = torch.randn(M, N, device=dev, dtype=dtype, generator=gen) if epilogue == "gelu_mul" else None
            ref = skinny_matmul_ref(x, w, epilogue=epilogue, aux=aux)
            t_ref = timed_us(rotating(bufs, lambda w_: skinny_matmul_ref(x, w_, epilogue=epilogue, aux=aux)))
            cfgs = [resolve_config(N, K)] + ([c for c in candidates(N, K) if not K % c.block_k
                                               and not (K // c.block_k) % c.split_k] if sweep else [])
            best = None
            for cfg in dict.fromkeys(cfgs):
                err = max_rel_err(skinny_matmul(x, w, cfg, epilogue, aux), ref)
                if not err < WRONG_REL_ERR:
                    print(f"    WRONG {cfg}: max rel err {err:.2e}")
                    continue
                t = timed_us(rotating(bufs, lambda w_, c=cfg: skinny_matmul(x, w_, c, epilogue, aux)))
                rows.append(dict(shape=name, N=N, K=K, M=M, config=cfg, us=t, ref_us=t_ref, max_rel_err=err))
                print(f"{name:>10} {N:>6} {K:>6} {M:>3} | {t:7.2f} | cuBLAS + torch {t_ref:7.2f} | {err:.1e} | {cfg}")
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best:
                lines.append(f"    ({N}, {K}): {best[1]!r},  # {name} at M = {M}: {best[0]:.2f} us, cuBLAS + "
                             f"torch {t_ref:.2f}")
        del bufs
    print("\n# CONFIGS entries:\n" + "\n".join(lines))
    return rows
