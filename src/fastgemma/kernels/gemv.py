"""Dense 16-bit GEMV for decode (x [M, K] @ W[N, K]^T with M = 1..4): a Triton kernel, torch twin.

At one row, cuBLAS reaches 3.4-3.7 TB/s on the large E4B matrices but only 1.6 TB/s or less on the
small ones (q 2048x2560: 6.6 us, the PLE gate 256x2560: 6.3 us): too few bytes in flight per SM.
This kernel keeps each program's whole K slice in flight: the loop over K blocks is unrolled
(tl.static_range), so every weight load of a program is issued before the first FMA waits, and the
grid is sized by rows alone (BLOCK_N rows per program, no split-K, so no second kernel and no
atomics: the result is deterministic). Rows of x are a grid axis; each re-reads W, so it pays
only at M = 1 (decode) and the verify pass's few rows stay on cuBLAS (`MAX_M`).

`gemv(x, w)` launches; `gemv_op` is the same as an opaque op for torch.compile; `gemv_ref` is the
twin (F.linear). Tiles: `CONFIGS[(N, K)]` (E4B shapes on the H200) else `default_config`.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_M = 1  # rows of x above which callers use cuBLAS
_SMS = 132
_INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _pdl_trigger(PDL: tl.constexpr):
    """Programmatic dependent launch: let the next kernel launch (it waits for this one's end). The
    one-row GEMVs call it first (one wave of programs); the verify pass's kernels after their main
    loop: called first there, the next kernel's programs took SM room while this one still streamed
    its weights (runs CC-CD, the verify pass's kernels alone: 2,340-2,346 us with the trigger first,
    2,111-2,141 after the loop, 2,161-2,302 plain)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Wait for the kernel before (and its memory) before reading what it wrote or writing anything."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _program_ptrs(x_ptr, w_ptr, N, stride_xm, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program's rows of W (BLOCK_N, program axis 0) and row of x (axis 1), first K block."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + pid_m * stride_xm + offs_k
    return offs_n, n_ok, offs_k, w_ptrs, x_ptrs, pid_m


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_xm, stride_wn, stride_om,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n, n_ok, offs_k, w_ptrs, x_ptrs, pid_m = _program_ptrs(x_ptr, w_ptr, N, stride_xm, stride_wn, BLOCK_N,
                                                                BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    FULL: tl.constexpr = K // BLOCK_K
    for kb in tl.static_range(FULL):  # unrolled: all loads of the slice can be in flight at once
        w = tl.load(w_ptrs + kb * BLOCK_K, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs + kb * BLOCK_K)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if K % BLOCK_K:  # constexpr tail
        k_ok = FULL * BLOCK_K + offs_k < K
        w = tl.load(w_ptrs + FULL * BLOCK_K, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + FULL * BLOCK_K, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + pid_m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


MAX_KB = 16  # K blocks a program can hold in registers before it waits (prefetch kernel)


@triton.jit
def _wload(w_ptrs, kb: tl.constexpr, n_ok, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight block kb of a program's rows (the K tail masked)."""
    if (kb + 1) * BLOCK_K <= K:
        w = tl.load(w_ptrs + kb * BLOCK_K, mask=n_ok[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs + kb * BLOCK_K, mask=n_ok[:, None] & (kb * BLOCK_K + offs_k < K)[None, :], other=0.0)
    return w


@triton.jit
def _wload_all(w_ptrs, n_ok, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Every weight block of a program (up to MAX_KB = 16), loads issued back to back; slots past
    the last block repeat block 0 (never read, no load)."""
    NKB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    w0 = _wload(w_ptrs, 0, n_ok, offs_k, K, BLOCK_K)
    w1 = w0
    w2 = w0
    w3 = w0
    w4 = w0
    w5 = w0
    w6 = w0
    w7 = w0
    w8 = w0
    w9 = w0
    w10 = w0
    w11 = w0
    w12 = w0
    w13 = w0
    w14 = w0
    w15 = w0
    if NKB > 1:
        w1 = _wload(w_ptrs, 1, n_ok, offs_k, K, BLOCK_K)
    if NKB > 2:
        w2 = _wload(w_ptrs, 2, n_ok, offs_k, K, BLOCK_K)
    if NKB > 3:
        w3 = _wload(w_ptrs, 3, n_ok, offs_k, K, BLOCK_K)
    if NKB > 4:
        w4 = _wload(w_ptrs, 4, n_ok, offs_k, K, BLOCK_K)
    if NKB > 5:
        w5 = _wload(w_ptrs, 5, n_ok, offs_k, K, BLOCK_K)
    if NKB > 6:
        w6 = _wload(w_ptrs, 6, n_ok, offs_k, K, BLOCK_K)
    if NKB > 7:
        w7 = _wload(w_ptrs, 7, n_ok, offs_k, K, BLOCK_K)
    if NKB > 8:
        w8 = _wload(w_ptrs, 8, n_ok, offs_k, K, BLOCK_K)
    if NKB > 9:
        w9 = _wload(w_ptrs, 9, n_ok, offs_k, K, BLOCK_K)
    if NKB > 10:
        w10 = _wload(w_ptrs, 10, n_ok, offs_k, K, BLOCK_K)
    if NKB > 11:
        w11 = _wload(w_ptrs, 11, n_ok, offs_k, K, BLOCK_K)
    if NKB > 12:
        w12 = _wload(w_ptrs, 12, n_ok, offs_k, K, BLOCK_K)
    if NKB > 13:
        w13 = _wload(w_ptrs, 13, n_ok, offs_k, K, BLOCK_K)
    if NKB > 14:
        w14 = _wload(w_ptrs, 14, n_ok, offs_k, K, BLOCK_K)
    if NKB > 15:
        w15 = _wload(w_ptrs, 15, n_ok, offs_k, K, BLOCK_K)
    return w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15


@triton.jit
def _xfma(acc, w, x_ptrs, kb: tl.constexpr, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + w * x[kb block] in fp32."""
    if (kb + 1) * BLOCK_K <= K:
        x = tl.load(x_ptrs + kb * BLOCK_K)
    else:
        x = tl.load(x_ptrs + kb * BLOCK_K, mask=kb * BLOCK_K + offs_k < K, other=0.0)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _prefetch_gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_xm, stride_wn, stride_om,
                          K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """The same GEMV with every weight block loaded into registers before x is touched. With
    PDL (programmatic dependent launch, sm90+), the program lets the next kernel launch at once
    and waits for the previous kernel only after its weight loads are issued: the weights (which
    no kernel writes) stream in while the previous kernel finishes."""
    _pdl_trigger(PDL)
    offs_n, n_ok, offs_k, w_ptrs, x_ptrs, pid_m = _program_ptrs(x_ptr, w_ptr, N, stride_xm, stride_wn, BLOCK_N,
                                                                BLOCK_K)
    NKB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _wload_all(w_ptrs, n_ok, offs_k, K,
                                                                                        BLOCK_K)
    _pdl_wait(PDL)  # the previous kernel's writes (x, and reuse of out) are visible
    acc = _xfma(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), w0, x_ptrs, 0, offs_k, K, BLOCK_K)
    if NKB > 1:
        acc = _xfma(acc, w1, x_ptrs, 1, offs_k, K, BLOCK_K)
    if NKB > 2:
        acc = _xfma(acc, w2, x_ptrs, 2, offs_k, K, BLOCK_K)
    if NKB > 3:
        acc = _xfma(acc, w3, x_ptrs, 3, offs_k, K, BLOCK_K)
    if NKB > 4:
        acc = _xfma(acc, w4, x_ptrs, 4, offs_k, K, BLOCK_K)
    if NKB > 5:
        acc = _xfma(acc, w5, x_ptrs, 5, offs_k, K, BLOCK_K)
    if NKB > 6:
        acc = _xfma(acc, w6, x_ptrs, 6, offs_k, K, BLOCK_K)
    if NKB > 7:
        acc = _xfma(acc, w7, x_ptrs, 7, offs_k, K, BLOCK_K)
    if NKB > 8:
        acc = _xfma(acc, w8, x_ptrs, 8, offs_k, K, BLOCK_K)
    if NKB > 9:
        acc = _xfma(acc, w9, x_ptrs, 9, offs_k, K, BLOCK_K)
    if NKB > 10:
        acc = _xfma(acc, w10, x_ptrs, 10, offs_k, K, BLOCK_K)
    if NKB > 11:
        acc = _xfma(acc, w11, x_ptrs, 11, offs_k, K, BLOCK_K)
    if NKB > 12:
        acc = _xfma(acc, w12, x_ptrs, 12, offs_k, K, BLOCK_K)
    if NKB > 13:
        acc = _xfma(acc, w13, x_ptrs, 13, offs_k, K, BLOCK_K)
    if NKB > 14:
        acc = _xfma(acc, w14, x_ptrs, 14, offs_k, K, BLOCK_K)
    if NKB > 15:
        acc = _xfma(acc, w15, x_ptrs, 15, offs_k, K, BLOCK_K)
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + pid_m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    per_sm: int = 0  # fused GEMVs: > 0 runs kernels/stream_gemv.py, this many programs a multiprocessor
    depth: int = 0   # ... keeping this many weight blocks in flight a program


# (N, K) -> tiles: bench_shapes(sweep=True) on the H200 (2026-11-30, graph-timed, weights out of L2);
# comments: ours / cuBLAS in us at M = 1
CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (3072, 2560): GemvConfig(8, 512, 4),    # q|k|v (sliding): 5.97 / 7.24
    (6144, 2560): GemvConfig(8, 512, 4),    # q|k|v (full): 9.53 / 11.32
    (2048, 2560): GemvConfig(8, 512, 4),    # q (KV-shared, sliding): 4.85 / 6.71
    (4096, 2560): GemvConfig(4, 512, 8),    # q (KV-shared, full): 7.11 / 8.07
    (2560, 2048): GemvConfig(1, 1024, 4),   # o (sliding): 4.57 / 6.23
    (2560, 4096): GemvConfig(2, 1024, 4),   # o (full): 7.33 / 10.85
    (20480, 2560): GemvConfig(8, 512, 4),   # gate|up: 26.50 / 29.05
    (2560, 10240): GemvConfig(1, 1024, 4),  # down: 14.69 / 18.06 (cuBLAS adds a split-K reduce)
    (256, 2560): GemvConfig(1, 512, 1),     # PLE gate: 2.65 / 6.32
    (2560, 256): GemvConfig(4, 256, 4),     # PLE projection: 2.10 / 3.16
    (10752, 2560): GemvConfig(8, 512, 4),   # W_plm: 15.60 / 15.53
}


def default_config(N: int, K: int) -> GemvConfig:
    """BLOCK_K 512 (a warp reads 1 KB of a row per load; wider where K holds more than MAX_KB such blocks, e.g.
    E2B's down, 12,288); BLOCK_N halves from 8 until there are >= 4 waves of programs; warps so that a thread holds
    <= 16 accumulators per K block."""
    bk = max(min(512, triton.next_power_of_2(K)), triton.next_power_of_2(triton.cdiv(K, MAX_KB)))
    bn = 8
    while bn > 1 and triton.cdiv(N, bn) < 4 * _SMS:
        bn //= 2
    warps = max(1, min(8, bn * bk // 32 // 16))
    return GemvConfig(bn, bk, warps)


def resolve_config(N: int, K: int, config: GemvConfig | None = None) -> GemvConfig:
    cfg = config or CONFIGS.get((N, K)) or default_config(N, K)
    for name in ("block_n", "block_k", "num_warps"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
    if cfg.per_sm < 0 or (cfg.per_sm > 0) != (cfg.depth > 0) or cfg.depth > MAX_KB:
        raise ValueError(f"GemvConfig: per_sm >= 0, and a streamed one (per_sm > 0) keeps 1..{MAX_KB} blocks in "
                         f"flight (depth); got per_sm={cfg.per_sm}, depth={cfg.depth}")
    return cfg


LAUNCHES = ("plain", "prefetch", "pdl")


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; off one (the interpreter), the H200's 132."""
    if device.type != "cuda":
        return _SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def pdl_supported(device) -> bool:
    """Programmatic dependent launch: sm90+ and a real launch (not the CPU interpreter). Asked once
    per device: launchers call it on every launch."""
    return not _INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(pdl: bool, device) -> dict:
    """A Triton launch's PDL arguments: the kernels' `PDL` constexpr, plus `launch_pdl` where PDL is
    asked for and `pdl_supported`."""
    return {"PDL": True, "launch_pdl": True} if pdl and pdl_supported(device) else {"PDL": False}


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None, launch: str = "plain") -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype, fp32 accumulation. No host sync.
    launch: "plain" (the unrolled loop), "prefetch" (all weight blocks loaded before x) or "pdl"
    (prefetch + programmatic dependent launch where the GPU has it, else prefetch)."""
    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError("gemv runs on CUDA tensors (or with TRITON_INTERPRET=1); use gemv_ref on the CPU")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if w.stride(1) != 1:
        raise ValueError("gemv needs w contiguous along K")
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = w.shape[0]
    cfg = resolve_config(N, K, config)
    if cfg.per_sm:
        raise ValueError("gemv: streamed tiles (per_sm > 0) are kernels/fused_gemv.py's; give block_n, block_k, "
                         "num_warps only")
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    grid = (triton.cdiv(N, cfg.block_n), M)
    if launch == "plain":
        _dense_gemv_kernel[grid](x, w, out, N, x.stride(0), w.stride(0), out.stride(0),
                                 K=K, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
        return out
    if launch not in LAUNCHES:
        raise ValueError(f"gemv launch must be one of {LAUNCHES}, got {launch!r}")
    if triton.cdiv(K, cfg.block_k) > MAX_KB:
        raise ValueError(f"prefetch GEMV holds at most {MAX_KB} K blocks; K={K} needs BLOCK_K >= {triton.cdiv(K, MAX_KB)}")
    _prefetch_gemv_kernel[grid](x, w, out, N, x.stride(0), w.stride(0), out.stride(0),
                                K=K, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                                **pdl_args(launch == "pdl", x.device))
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, config=None) -> torch.Tensor:
    return F.linear(x, w)


@torch.library.custom_op("fastgemma::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return gemv(x, w)


@gemv_op.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))


# ---------------------------------------------------------------------------------------------
# benchmark (CUDA only; not a test)

E4B_SHAPES: dict[str, tuple[int, int]] = {  # name: (N, K), merged projections as the fast path runs them
    "qkv": (3072, 2560), "qkv_full": (6144, 2560), "q_shared": (2048, 2560), "q_shared_full": (4096, 2560),
    "o": (2560, 2048), "o_full": (2560, 4096), "gate|up": (20480, 2560), "down": (2560, 10240),
    "ple_gate": (256, 2560), "ple_proj": (2560, 256), "w_plm": (10752, 2560),
}


def candidates(N: int, K: int) -> list[GemvConfig]:
    """<= 8 tiles per shape (one compile each): BLOCK_K 512 or 1024 (capped at K), BLOCK_N 1..8,
    4 or 8 warps, 8..32 fp32 accumulators per thread."""
    out = []
    for bk in dict.fromkeys(min(b, triton.next_power_of_2(K)) for b in (512, 1024)):
        for bn in (1, 2, 4, 8):
            for warps in (4, 8):
                if 8 <= bn * bk // (32 * warps) <= 32:
                    out.append(GemvConfig(bn, bk, warps))
    return out


def bench_shapes(shapes: dict | None = None, dtype=torch.bfloat16, sweep: bool = False, graph: bool = True,
                 rep_ms: int = 20, device: str = "cuda") -> list[dict]:
    """Our GEMV against cuBLAS (F.linear) at M = 1 on every E4B shape, weights rotated out of L2.
    sweep=True also times `candidates` and prints CONFIGS lines. Needs a CUDA device."""
    from .bench_util import copies_past_l2, rotating, timer

    if not torch.cuda.is_available():
        raise RuntimeError("gemv.bench_shapes needs a CUDA device")
    dev = torch.device(device)
    timed_us = timer(graph, rep_ms)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, lines = [], []
    print(f"{torch.cuda.get_device_name(dev)} {dtype} M=1 {'graph' if graph else 'eager'} (us, TB/s of weight bytes)")
    print(f"{'shape':>14} {'N':>6} {'K':>6} | {'ours':>7} {'TB/s':>5} | {'cuBLAS':>7} {'TB/s':>5} | {'x':>5} | "
          f"{'err':>8} | config")
    total_ours = total_ref = 0.0
    for name, (N, K) in (shapes or E4B_SHAPES).items():
        w = torch.randn(N, K, device=dev, dtype=dtype, generator=gen) * 0.02
        x = torch.randn(1, K, device=dev, dtype=dtype, generator=gen)
        nbytes = w.numel() * w.element_size()
        bufs = [(w.clone(),) for _ in range(copies_past_l2(nbytes, dev))]
        ref = F.linear(x.float(), w.float())
        err = ((gemv(x, w).float() - ref).abs().max() / ref.abs().max()).item()
        t_ref = timed_us(rotating(bufs, lambda w_: F.linear(x, w_)))
        cfgs = [resolve_config(N, K)] + (candidates(N, K) if sweep else [])
        results = []
        for cfg in dict.fromkeys(cfgs):
            try:
                results.append((timed_us(rotating(bufs, lambda w_, c=cfg: gemv(x, w_, c))), cfg))
            except Exception as e:  # a candidate out of resources: skip it
                print(f"    skip {cfg}: {type(e).__name__}")
        t, cfg = results[0]
        tb, cb = min(results, key=lambda r: r[0])
        total_ours += tb
        total_ref += t_ref
        rows.append(dict(shape=name, N=N, K=K, ours_us=t, cublas_us=t_ref, best_us=tb,
                         best_config=dataclasses.astuple(cb), max_rel_err=err))
        print(f"{name:>14} {N:>6} {K:>6} | {t:7.2f} {nbytes / t / 1e6:5.2f} | {t_ref:7.2f} {nbytes / t_ref / 1e6:5.2f} | "
              f"{t_ref / t:5.2f} | {err:8.1e} | {cfg}")
        if sweep:
            print(f"{'best':>14} {'':>6} {'':>6} | {tb:7.2f} {nbytes / tb / 1e6:5.2f} | {'':>7} {'':>5} | "
                  f"{t_ref / tb:5.2f} | {'':>8} | {cb}")
            lines.append(f"    ({N}, {K}): GemvConfig{dataclasses.astuple(cb)},  # {name}")
        del bufs
    print(f"sum over shapes: ours (best) {total_ours:.1f} us, cuBLAS {total_ref:.1f} us")
    if sweep:
        print("\n# CONFIGS entries (block_n, block_k, num_warps):")
        print("\n".join(lines))
    return rows
