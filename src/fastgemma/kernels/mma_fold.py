"""The norm fold's launches (kernels/norm_fold.py): a one-row tensor-core int4 GEMV that ends in the
producer's store (`mma_rows`) and one that starts from the two rows and the partials (`mma_fold`),
their torch twins and their opaque ops for torch.compile.

    y, rows, parts = mma_rows(x, W_o, res=a, post=post, pre=pre)          # y = x W_o^T, as mma_w4a16's
    out, h = mma_fold(rows, parts, W_gu, res=a, y=y, post=post, scale=None, epilogue="geglu")

give, up to bf16 rounding, what kernels/residual_norm.py's launch between the two GEMVs gives:
h = (a + rmsnorm(y) (post + off)) s and out = epilogue(rmsnorm(h) (pre + off) W_gu^T).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from .attn_fold import parts_problem
from .gemv import _INTERPRET, pdl_args
from .int4_pack import dequantize_int4
from .mma_table import MmaConfig, config_problem, format_config, mma_config
from .mma_w4a16 import (EPILOGUES, MmaWeight, _mma_stream_kernel, _mma_w4a16_kernel, kernel_epilogue, layout_problem,
                        mma_w4a16, mma_w4a16_ref, persistent_programs, program_tiles)
from .norm_fold import N_PARTS, parts_block


def _cuda_or_interpret(t: torch.Tensor, name: str) -> None:
    if not (t.is_cuda or _INTERPRET):
        raise RuntimeError(f"{name} runs on CUDA tensors (or with TRITON_INTERPRET=1); use {name}_ref")


def _vec(t: torch.Tensor, n: int, what: str, name: str) -> torch.Tensor:
    if t is None or t.numel() != n or t.dtype != torch.bfloat16:
        raise ValueError(f"{name}: {what} must hold {n} bf16 values, got "
                         f"{None if t is None else (tuple(t.shape), t.dtype)}")
    return t.reshape(-1).contiguous()


def rows_tiles(N: int, cfg: MmaConfig) -> int:
    """The producer's tiles (rows of its partials) for W [N, K] on cfg."""
    return N // 16 // cfg.tiles


def producer_problem(cfg: MmaConfig | None, N: int, K: int, G: int) -> str | None:
    """Why `mma_rows` cannot run cfg for W [N, K], or None."""
    if cfg is None:
        return "no one-row config in the tensor-core kernel's table"
    if cfg.splits > 1:
        return f"a K split ({cfg}) sums a tile in several programs; the producer's store needs it whole"
    return config_problem(cfg, N, K, G, "none")


def consumer_problem(cfg: MmaConfig | None, N: int, K: int, G: int, epilogue: str) -> str | None:
    """Why `mma_fold` cannot run cfg for W [N, K] with `epilogue`, or None."""
    if cfg is not None and cfg.cuda:
        from .cuda_gemm import fold_problem

        problem = fold_problem(N, K, cfg.warps, cfg.splits)
        return f"{format_config(cfg)}: {problem}" if problem else config_problem(cfg, N, K, G, epilogue)
    if cfg is None or not cfg.persist:
        return f"the consumer runs the persistent kernel (a config with persist > 0), got {cfg}"
    return config_problem(cfg, N, K, G, epilogue)


def mma_rows(x: torch.Tensor, weight: MmaWeight, res: torch.Tensor, post: torch.Tensor, pre: torch.Tensor, *,
             offset: float = 0.0, config: MmaConfig | None = None, pdl: bool = False,
             lse: torch.Tensor | None = None):
    """One row x [1, K] @ W^T -> (y [1, N] bf16, rows [2, N] bf16: a (pre + off) and y (post + off)
    (pre + off), parts [tiles, 4] fp32: each tile's sums of y^2, a^2, a u, u^2); a = res [N]. With lse:
    x is a one-row attention's split partials [Hkv, splits, heads per KV head, head dim] (bf16) and lse
    theirs [Hkv, splits, heads per KV head], combined in the GEMV (kernels/attn_fold.py; persistent
    configs only)."""
    N, K, G = weight.N, weight.K, weight.group_size
    cfg = config or mma_config(N, K, 1)
    if lse is not None:
        problem = parts_problem(x, lse, K, G) or (None if cfg is None or cfg.persist else
                                                  f"the partials take the persistent kernel (persist > 0), got {cfg}")
        if problem:
            raise ValueError(f"mma_rows: {problem}")
    elif x.dim() != 2 or x.shape != (1, K) or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"mma_rows takes one bf16 row x [1, {K}], contiguous, got {tuple(x.shape)} {x.dtype}")
    res, post, pre = (_vec(t, N, w, "mma_rows") for t, w in ((res, "res"), (post, "post"), (pre, "pre")))
    _cuda_or_interpret(x, "mma_rows")
    problem = producer_problem(cfg, N, K, G)
    if problem:
        raise ValueError(f"mma_rows: {problem}")
    n_tiles = rows_tiles(N, cfg)
    out = torch.empty(1, N, device=x.device, dtype=x.dtype)
    rows = torch.empty(2, N, device=x.device, dtype=x.dtype)
    parts = torch.empty(n_tiles, N_PARTS, device=x.device, dtype=torch.float32)
    common = dict(K=K, GROUP=G, T=cfg.tiles, W=cfg.warps, EPI=0, EMU=_INTERPRET, FOLD=1, **cfg.launch,
                  **pdl_args(pdl, x.device))
    if cfg.persist:
        grid = (persistent_programs(n_tiles, cfg.persist, x.device),)
        niter = triton.cdiv(n_tiles, grid[0])
        part = dict(NS=x.shape[1], PG=x.shape[2], PD=x.shape[3]) if lse is not None else {}
        _mma_stream_kernel[grid](x, weight.words, weight.sz, out, 1, N, N // 2, x.stride(0), out.stride(0), n_tiles,
                                 niter, res, res, post, pre, res, rows, parts, res, 0.0, float(offset),
                                 lse if lse is not None else x, DEPTH=min(cfg.depth, K // cfg.warps // G),
                                 FRESH=cfg.fresh, ONE=niter == 1, **part, **common)
    else:
        grid = (triton.cdiv(n_tiles, cfg.iters),)
        _mma_w4a16_kernel[grid](x, weight.words, weight.sz, out, out, out, 1, N, N // 2, x.stride(0), out.stride(0),
                                n_tiles, res, post, pre, rows, parts, float(offset), DEPTH=cfg.depth,
                                ITERS=cfg.iters, S=1, **common)
    return out, rows, parts


def mma_fold(rows: torch.Tensor, parts: torch.Tensor, weight: MmaWeight, res: torch.Tensor, y: torch.Tensor,
             post: torch.Tensor, scale: torch.Tensor | None = None, *, eps: float, offset: float = 0.0,
             epilogue: str = "none", config: MmaConfig | None = None, pdl: bool = False):
    """From `mma_rows`' rows [2, K] and parts [P, 4] (its a = res, its y and post): one row of
    epilogue(rmsnorm(h) (pre + off) @ W^T) -> (out [1, N] (geglu: [1, N/2]), h [1, K]), where
    h = (a + rmsnorm(y) (post + off)) * scale (pre is in the rows)."""
    N, K, G = weight.N, weight.K, weight.group_size
    if rows.dim() != 2 or rows.shape != (2, K) or rows.dtype != torch.bfloat16 or not rows.is_contiguous():
        raise ValueError(f"mma_fold takes the producer's rows [2, {K}] bf16, got {tuple(rows.shape)} {rows.dtype}")
    if parts.dim() != 2 or parts.shape[1] != N_PARTS or parts.dtype != torch.float32 or not parts.is_contiguous():
        raise ValueError(f"mma_fold takes the producer's parts [tiles, {N_PARTS}] fp32, got {tuple(parts.shape)} "
                         f"{parts.dtype}")
    res, y, post = (_vec(t, K, w, "mma_fold") for t, w in ((res, "res"), (y, "y"), (post, "post")))
    if scale is not None and (scale.numel() != 1 or not scale.is_floating_point()):
        raise ValueError(f"mma_fold: scale is one float value, got {tuple(scale.shape)} {scale.dtype}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"mma_fold epilogue must be one of {sorted(EPILOGUES)}, got {epilogue!r}")
    _cuda_or_interpret(rows, "mma_fold")
    cfg = config or mma_config(N, K, 1, epilogue)
    problem = consumer_problem(cfg, N, K, G, epilogue) or layout_problem(weight, cfg)
    if problem:
        raise ValueError(f"mma_fold: {problem}")
    if cfg.cuda:
        from .cuda_gemm import cuda_fold

        return cuda_fold(rows, parts, weight.words, weight.sz, N, cfg.warps, cfg.depth, epilogue, res, y, post, scale,
                         eps, offset, pdl)
    epi = kernel_epilogue(epilogue, cfg)
    out = torch.empty(1, N // 2 if epi else N, device=rows.device, dtype=rows.dtype)
    h = torch.empty(1, K, device=rows.device, dtype=rows.dtype)
    n_tiles = program_tiles(N, cfg, epi)
    grid = (persistent_programs(n_tiles, cfg.persist, rows.device),)
    hb = max(64, triton.next_power_of_2(triton.cdiv(K, grid[0])))  # h's entries per writing program
    niter = triton.cdiv(n_tiles, grid[0])
    _mma_stream_kernel[grid](rows, weight.words, weight.sz, out, 2, N, N // 2, K, out.stride(0), n_tiles,
                             niter, res, y, post, res, scale if scale is not None else res,
                             rows, parts, h, float(eps), float(offset), rows,
                             K=K, GROUP=G, T=cfg.tiles, W=cfg.warps, EPI=epi,
                             DEPTH=min(cfg.depth, K // cfg.warps // G), FRESH=cfg.fresh, EMU=_INTERPRET,
                             FOLD=2, NPART=parts.shape[0], NP2=parts_block(parts.shape[0]),
                             HAS_SCALE=scale is not None, HB=hb, ONE=niter == 1,
                             **cfg.launch, **pdl_args(pdl, rows.device))
    return out, h


# ---------------------------------------------------------------------------------------------
# twins


def mma_rows_ref(x, qweight, scales, zeros, group_size: int, res, post, pre, *, offset: float = 0.0,
                 tile_rows: int = 16):
    """The twin of `mma_rows` from the standard packing; tile_rows: 16 x the config's tiles."""
    y = mma_w4a16_ref(x, qweight, scales, zeros, group_size)
    a, yf = res.reshape(-1).float(), y.reshape(-1).float()
    u = yf * (post.reshape(-1).float() + offset)
    p = pre.reshape(-1).float() + offset
    rows = torch.stack([a * p, u * p]).to(y.dtype)
    per_tile = torch.stack([yf * yf, a * a, a * u, u * u], dim=-1).reshape(-1, tile_rows, N_PARTS).sum(1)
    return y, rows, per_tile


def mma_fold_ref(rows, parts, qweight, scales, zeros, group_size: int, res, y, post, scale=None, *, eps: float,
                 offset: float = 0.0, epilogue: str = "none"):
    """The twin of `mma_fold`: fp32 sums of the two rows, combined, the epilogue rounded as the kernel
    rounds; h as kernels/residual_norm.py rounds it, with the partials' r1."""
    K = rows.shape[1]
    dt = rows.dtype
    syy, saa, sau, suu = parts.double().sum(0).float()
    r1 = torch.rsqrt(syy / K + eps)
    s = scale.reshape(()).float() if scale is not None else torch.tensor(1.0)
    r2s = s * torch.rsqrt(s * s * (saa + r1 * (2 * sau + r1 * suu)) / K + eps)
    w = dequantize_int4(qweight, scales, zeros, group_size, dtype=torch.float32)
    d = F.linear(rows.float(), w)
    out = r2s * (d[0] + r1 * d[1])
    if epilogue == "geglu":
        gate, up = out.chunk(2, dim=-1)
        out = F.gelu(gate.to(dt).float(), approximate="tanh").to(dt).float() * up.to(dt).float()

    def rnd(t):
        return t.to(dt).float()

    h = rnd(res.reshape(-1).float() + rnd(y.reshape(-1).float() * r1 * (post.reshape(-1).float() + offset)))
    if scale is not None:
        h = rnd(h * s)
    return out.to(dt).reshape(1, -1), h.to(dt).reshape(1, -1)


# ---------------------------------------------------------------------------------------------
# GPU check and timing

# consumer -> (producer N, producer K, consumer N, the consumer's epilogue, a layer scalar in h); the consumer's K is
# the producer's N. E4B: gate|up after o (no scalar), the next layer's q|k|v after the PLE projection (the layer's)
FOLD_CASES = {"gate|up": (2560, 2048, 20480, "geglu", False), "q|k|v": (2560, 256, 3072, "none", True)}


def bench_fold(cases: dict | None = None, configs: list[MmaConfig] | None = None, timer=None, device: str = "cuda",
               pdl: bool = True, producer: MmaConfig | None = None, plain: bool = False) -> list[dict]:
    """The norm fold's consumer (cases: `FOLD_CASES`' form, default E4B's) on the table's one-row entry and on each
    of `configs` that can take the case (`consumer_problem`): the producer's rows and partials made once on its
    table entry (or `producer`), each consumer's output and h checked against the twin (`mma_fold_ref`), then timed
    with its words rotated out of L2 (PDL launches). plain: also each config's plain launch (`mma_w4a16`) on the
    same two rows and words, what the fold adds. Prints a table; returns one dict per (case, config)."""
    from .bench_util import WRONG_REL_ERR, copies_past_l2, max_rel_err, rotating, timer_or_graphs
    from .int4_pack import pack_int4, quantize_int4

    dev = torch.device(device)
    timer = timer_or_graphs(timer, "bench_fold")
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    rows_out = []
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}  the norm fold's consumer, one row "
          f"(us; words rotated out of L2; {'PDL' if pdl else 'plain'}; errors against mma_fold_ref)")
    print(f"{'case':>8} | {'config':<12} | {'us':>7} | out err | h err")
    for case, (N0, K0, N1, epi, has_scale) in (cases or FOLD_CASES).items():
        K1 = N0
        q0, s0, z0 = quantize_int4(rnd(N0, K0) * 0.02, 128)
        q1, s1, z1 = quantize_int4(rnd(N1, K1) * 0.02, 128)
        x, a = rnd(1, K0), rnd(1, N0) * 2
        post, pre = rnd(N0) * 0.3, rnd(N0) * 0.3
        scale = torch.tensor([0.7], device=dev, dtype=torch.bfloat16) if has_scale else None
        y, rows, parts = mma_rows(x, MmaWeight.from_codes(q0, s0, z0, 128), a, post, pre, offset=1.0,
                                  config=producer)
        ref, href = mma_fold_ref(rows, parts, pack_int4(q1), s1, z1, 128, a, y, post, scale, eps=1e-6, offset=1.0,
                                 epilogue=epi)
        shipped = mma_config(N1, K1, 1, epi)
        for cfg in [shipped] + [c for c in configs or [] if c != shipped]:
            text = format_config(cfg) if cfg else "none"
            problem = consumer_problem(cfg, N1, K1, 128, epi)
            if problem:
                print(f"{case:>8} | {text:<12} | skipped: {problem}"[:160])
                continue
            w1 = MmaWeight.from_codes(q1, s1, z1, 128, pairs=cfg.pairs)
            bufs = [(MmaWeight(w1.words.clone(), w1.sz.clone(), N1, K1, 128, cfg.pairs),)
                    for _ in range(copies_past_l2(w1.words.numel() * 4, dev))]

            def call(w, cfg=cfg):
                return mma_fold(rows, parts, w, a, y, post, scale, eps=1e-6, offset=1.0, epilogue=epi, config=cfg,
                                pdl=pdl)

            try:
                out, h = call(*bufs[0])
                us = timer(rotating(bufs, call))
            except (RuntimeError, ValueError) as e:  # no nvcc, not sm_90, out of resources: report, go on
                print(f"{case:>8} | {text:<12} | skipped: {type(e).__name__}: {e}"[:160])
                continue
            err, herr = max_rel_err(out, ref), max_rel_err(h, href)
            ok = err < WRONG_REL_ERR and herr < WRONG_REL_ERR
            rows_out.append(dict(case=case, config=text, us=us, max_rel_err=err, h_rel_err=herr, ok=ok))
            print(f"{case:>8} | {text:<12} | {us:7.2f} | {err:.1e} | {herr:.1e}{'' if ok else '  WRONG'}")
            if plain:
                us = timer(rotating(bufs, lambda w, cfg=cfg: mma_w4a16(rows, w, epi, cfg, pdl)))
                rows_out.append(dict(case=case, config=text, us=us, plain=True))
                print(f"{case:>8} | {text + ' plain':<12} | {us:7.2f} | the same rows, no fold")
            del bufs
    return rows_out


# ---------------------------------------------------------------------------------------------
# ops


@torch.library.custom_op("fastgemma::mma_rows", mutates_args=())
def mma_rows_op(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int, group_size: int, res: torch.Tensor,
                post: torch.Tensor, pre: torch.Tensor, offset: float, tiles: int, warps: int, depth: int, iters: int,
                splits: int, persist: int, fresh: bool, hw: int, regs: int, pairs: bool, cuda: bool, pdl: bool,
                lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lse given: x is an attention's split partials (`mma_rows`)."""
    weight = MmaWeight(words, sz, N, words.shape[1] * 64, group_size)  # words [N/16, K/64, 32, 4]
    return mma_rows(x, weight, res, post, pre, offset=offset,
                    config=MmaConfig(tiles, warps, depth, iters, splits, persist, fresh, hw, regs, pairs, cuda),
                    pdl=pdl, lse=lse)


@mma_rows_op.register_fake
def _(x, words, sz, N, group_size, res, post, pre, offset, tiles, warps, depth, iters, splits, persist, fresh, hw,
      regs, pairs, cuda, pdl, lse=None):
    return (x.new_empty((1, N)), x.new_empty((2, N)),
            x.new_empty((rows_tiles(N, MmaConfig(tiles)), N_PARTS), dtype=torch.float32))


@torch.library.custom_op("fastgemma::mma_fold", mutates_args=())
def mma_fold_op(rows: torch.Tensor, parts: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int,
                group_size: int, epilogue: str, res: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                scale: torch.Tensor | None, eps: float, offset: float, tiles: int, warps: int, depth: int, iters: int,
                splits: int, persist: int, fresh: bool, hw: int, regs: int, pairs: bool, cuda: bool,
                pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weight = MmaWeight(words, sz, N, rows.shape[1], group_size, pairs)
    return mma_fold(rows, parts, weight, res, y, post, scale, eps=eps, offset=offset, epilogue=epilogue,
                    config=MmaConfig(tiles, warps, depth, iters, splits, persist, fresh, hw, regs, pairs, cuda),
                    pdl=pdl)


@mma_fold_op.register_fake
def _(rows, parts, words, sz, N, group_size, epilogue, res, y, post, scale, eps, offset, tiles, warps, depth, iters,
      splits, persist, fresh, hw, regs, pairs, cuda, pdl):
    return rows.new_empty((1, N // 2 if epilogue == "geglu" else N)), rows.new_empty((1, rows.shape[1]))
