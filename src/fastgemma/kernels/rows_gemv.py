"""A dense GEMV for a few rows of x and a small weight: the fused one-row GEMV's program (every weight
block in registers before the PDL wait, kernels/fused_gemv.py's sums and epilogue stores) with the rows of x as a
second grid axis.

The verify pass's one dense linear, E4B's PLE gate (256 x 2560 bf16, 1.3 MB), took the skinny GEMM: 16 weight rows
a tl.dot tile, so 16 tiles, K split over 10 programs each and an arrival counter whose last program sums the
partials and applies the epilogue: 4.15 / 4.32 us alone at 1 / 8 rows on the H100 (run LW), ~3x the time of its
bytes. Here a program takes BLOCK_N weight rows over all of K for one row of x, no split, no counter: each row of
the output is computed by the same code whatever the row count (bit for bit: `fuse.batch_invariant` holds), and
rows past the first read the weights from the L2. Alone 1.60 / 2.81-3.14 us; in the step (run MB, H100) the
batch-invariant one-row step 2.045 -> 1.971 ms, the k=7 verify pass 1.998 -> 1.956. Tried and slower in the verify
pass (runs LY, LZ): the dependents launched after the sums at several rows, and 8 rows of x a program (the weights
loaded once for them: 6.6 us alone, the rows' L2 round trips in series). `rows_gemv` launches, `rows_gemv_op` is
the opaque op, `rows_gemv_ref` the twin (skinny_gemm's: F.linear in x's dtype, then the epilogue)."""
from __future__ import annotations

import dataclasses

import triton
import triton.language as tl
import torch

from .fused_gemv import EPILOGUES, _aux_rows, _finish, _fma_block, _rows
from .gemv import MAX_KB, GemvConfig, _pdl_trigger, _pdl_wait, _wload_all, pdl_args
from .skinny_gemm import MAX_M, check_rows_operands, skinny_matmul_ref

MAX_BYTES = 4 << 20  # dense weights up to this size take this kernel in the fused steps (fits)


@triton.jit
def _rows_gemv_kernel(x_ptr, w_ptr, aux_ptr, out_ptr, N, HALF, stride_wn, stride_xm, stride_am, stride_om,
                      K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EPI: tl.constexpr,
                      PDL: tl.constexpr):
    _pdl_trigger(PDL)
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows, n_ok = _rows(pid, N, HALF, BLOCK_N, EPI)
    offs_k = tl.arange(0, BLOCK_K)
    ws = _wload_all(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], n_ok, offs_k, K, BLOCK_K)
    _pdl_wait(PDL)  # x (and aux) are the previous kernels' outputs
    DT: tl.constexpr = out_ptr.dtype.element_ty
    x_row = x_ptr + m * stride_xm
    aux = _aux_rows(aux_ptr + m * stride_am, rows, n_ok, EPI)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kb in tl.static_range((K + BLOCK_K - 1) // BLOCK_K):  # no prologue: x's blocks as stored
        acc = _fma_block(acc, ws[kb], x_row, x_row, ((), (), 1.0), kb, offs_k, 0.0, 0.0, 0.0, K, BLOCK_K, 0, False,
                         False, DT)
    _finish(tl.sum(acc, axis=1), rows, n_ok, pid, aux, out_ptr + m * stride_om, HALF, BLOCK_N, EPI, DT)


# (N, K, epilogue) -> tiles where another than DEFAULT_CONFIG was faster (rows_gemv.bench_rows); none: of eight tiles,
# DEFAULT_CONFIG's was the fastest for E4B's PLE gate at 8 rows and within 0.02 us of it at one, alone on the H100
# (run LX: 1.58 / 2.81 us against the skinny GEMM's 3.55 / 3.73)
CONFIGS: dict[tuple[int, int, str], GemvConfig] = {}
DEFAULT_CONFIG = GemvConfig(2, 512, 2)


def tiles(N: int, K: int, epilogue: str, config: GemvConfig | None = None) -> GemvConfig:
    """The tiles a launch takes: `config`, else CONFIGS' entry, else DEFAULT_CONFIG; GeGLU programs at least one
    gate row and its up row."""
    cfg = config or CONFIGS.get((N, K, epilogue), DEFAULT_CONFIG)
    return dataclasses.replace(cfg, block_n=max(cfg.block_n, 2)) if epilogue == "geglu" else cfg


def fits(M: int, N: int, K: int, nbytes: int, epilogue: str = "none") -> bool:
    """Whether the fused steps give a dense [N, K] weight of nbytes at M rows to this kernel (by the weight, its
    epilogue and its tiles only, so that a shape takes the same kernel at every row count): its tiles hold all of K
    in registers (at most MAX_KB blocks)."""
    return (1 <= M <= MAX_M and nbytes <= MAX_BYTES and N >= 2
            and triton.cdiv(K, tiles(N, K, epilogue).block_k) <= MAX_KB)


def rows_gemv(x: torch.Tensor, w: torch.Tensor, epilogue: str = "none", aux: torch.Tensor | None = None,
              pdl: bool = False, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (M <= MAX_M, one float dtype) -> [M, N] (geglu: [M, N / 2]) through `epilogue`
    (kernels/w4a16.apply_epilogue's: none, geglu, gelu_mul with aux [M, N]). No host sync. `pdl` (sm90+): the next
    kernel may launch at once, this one waits for the previous one after its weight loads."""
    M, N, K = check_rows_operands("rows_gemv", x, w, epilogue, aux)
    epi = EPILOGUES[epilogue]
    cfg = tiles(N, K, epilogue, config)
    bn = cfg.block_n
    if triton.cdiv(K, cfg.block_k) > MAX_KB:
        raise ValueError(f"rows_gemv holds at most {MAX_KB} K blocks a program; K={K} needs BLOCK_K >= "
                         f"{triton.cdiv(K, MAX_KB)}, got {cfg.block_k}")
    half = N // 2
    out = torch.empty(M, half if epi == 1 else N, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    a = aux if aux is not None else out  # aux in place, its rows strided (the PLE inputs' slice of a layer): a copy
    # here was a torch launch per layer outside the PDL chain, 0.14 ms of the verify pass (run MA)
    grid = (triton.cdiv(half, bn // 2) if epi == 1 else triton.cdiv(N, bn), M)
    _rows_gemv_kernel[grid](x, w, a, out, N, half, w.stride(0), x.stride(0), a.stride(0), out.stride(0), K=K,
                            BLOCK_N=bn, BLOCK_K=cfg.block_k, EPI=epi, num_warps=cfg.num_warps,
                            **pdl_args(pdl, x.device))
    return out


def rows_gemv_ref(x, w, epilogue: str = "none", aux=None, pdl: bool = False, config=None):
    """The twin: F.linear in x's dtype, then the epilogue in torch (the skinny GEMM's)."""
    return skinny_matmul_ref(x, w, epilogue=epilogue, aux=aux)


@torch.library.custom_op("fastgemma::rows_gemv", mutates_args=())
def rows_gemv_op(x: torch.Tensor, w: torch.Tensor, epilogue: str, aux: torch.Tensor | None,
                 pdl: bool = False) -> torch.Tensor:
    return rows_gemv(x, w, epilogue, aux, pdl)


@rows_gemv_op.register_fake
def _(x, w, epilogue, aux, pdl=False):
    return x.new_empty((x.shape[0], w.shape[0] // 2 if epilogue == "geglu" else w.shape[0]))


TILES = [GemvConfig(bn, bk, nw) for bn, bk, nw in ((1, 512, 1), (1, 1024, 2), (2, 512, 2), (2, 1024, 4),
                                                    (4, 512, 4), (4, 256, 2), (8, 512, 4), (1, 256, 1))]


def bench_rows(shapes: dict | None = None, ms=(1, 8), epilogue: str = "gelu_mul", tiles=None,
               dtype=torch.bfloat16, device: str = "cuda", rep_ms: int = 10) -> list[dict]:
    """Each tile of this kernel against the skinny GEMM (its table's config) at each row count in ms, inside CUDA
    graphs with PDL launches, weights rotated out of L2, every output checked against the twin first; prints a
    table and CONFIGS lines (the fastest tile at the largest row count)."""
    from .bench_util import WRONG_REL_ERR, cuda_bench, max_rel_err, rotated_copies, rotating
    from .skinny_gemm import skinny_matmul

    dev, gen, timed_us = cuda_bench(device, "rows_gemv.bench_rows", rep_ms)
    shapes = shapes or {"ple_gate": (256, 2560)}
    rows, lines = [], []
    print(f"{torch.cuda.get_device_name(dev)}  rows GEMV + {epilogue} vs the skinny GEMM (us; PDL; weights out of L2)")
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=dtype, generator=gen) * 0.02
        bufs = rotated_copies(w)
        best = None
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=dtype, generator=gen)
            aux = torch.randn(M, N, device=dev, dtype=dtype, generator=gen) if epilogue == "gelu_mul" else None
            ref = rows_gemv_ref(x, w, epilogue, aux)
            ones = torch.cat([rows_gemv(x[m:m + 1], w, epilogue, aux[m:m + 1] if aux is not None else None)
                              for m in range(M)])
            same = torch.equal(ones, rows_gemv(x, w, epilogue, aux))
            print(f"{name:>10} {N:>6} {K:>6} {M:>3} | rows bit-equal to one-row launches: {same}")
            t_sk = timed_us(rotating(bufs, lambda w_: skinny_matmul(x, w_, None, epilogue, aux, pdl=True)))
            print(f"{name:>10} {N:>6} {K:>6} {M:>3} | skinny GEMM (its table)   | {t_sk:7.2f}")
            rows.append(dict(shape=name, N=N, K=K, M=M, kernel="skinny", us=t_sk))
            for cfg in tiles or TILES:
                if triton.cdiv(K, cfg.block_k) > MAX_KB:
                    continue
                err = max_rel_err(rows_gemv(x, w, epilogue, aux, True, cfg), ref)
                if not err < WRONG_REL_ERR:
                    print(f"    WRONG {cfg}: max rel err {err:.2e}")
                    continue
                t = timed_us(rotating(bufs, lambda w_, c=cfg: rows_gemv(x, w_, epilogue, aux, True, c)))
                label = f"rows {cfg.block_n}x{cfg.block_k}w{cfg.num_warps}"
                print(f"{name:>10} {N:>6} {K:>6} {M:>3} | {label:<25} | {t:7.2f} | {err:.1e}")
                rows.append(dict(shape=name, N=N, K=K, M=M, kernel="rows", config=cfg, us=t, max_rel_err=err))
                if M == max(ms) and (best is None or t < best[0]):
                    best = (t, cfg)
        if best:
            lines.append(f"    ({N}, {K}, {epilogue!r}): {best[1]!r},  # {name}: {best[0]:.2f} us at {max(ms)} rows")
        del bufs
    print("\n# CONFIGS entries:\n" + "\n".join(lines))
    return rows
