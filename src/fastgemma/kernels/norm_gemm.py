"""The wider steps' residual update + norm and the tensor-core int4 GEMM after it in one launch: the CUDA kernel's
w4_norm_kernel (kernels/cuda/w4_gemm.cu), in which every CTA makes the normed rows it multiplies from the residual
a, the GEMM output y before the update and the norms' weights, and CTA 0 writes h.

    out, h = norm_gemm(a, y, post, None, pre, W_gu, eps=eps, offset=off, epilogue="geglu", config=cfg)

gives, up to the order of the fp32 sums, kernels/residual_norm.py's launch followed by mma_w4a16 on its x:
h = (a + rmsnorm(y) (post + off)) s, out = epilogue(rmsnorm(h) (pre + off) W^T), rounded at the same points. A
row's result does not depend on the rows beside it (its sums run in one order at every M), so under
fuse.batch_invariant the one-row step and the verify pass, which both take it, keep equal rows. Taken with
fuse.norm_gemm where the table's entry for the GEMM is a CUDA config with all of K in a CTA (E4B: gate|up, after
the update by o). `norm_gemm_op` is the opaque op for torch.compile, `norm_gemm_ref` the torch twin, `bench_norm_gemm`
the GPU check and timing against the two launches it replaces.
"""
from __future__ import annotations

import torch

from .mma_table import MAX_ROWS, MmaConfig, config_problem, format_config
from .mma_w4a16 import EPILOGUES, MmaWeight, layout_problem, mma_w4a16_ref


def norm_gemm_problem(cfg: MmaConfig | None, N: int, K: int, G: int, epilogue: str) -> str | None:
    """Why the one-launch form cannot run cfg for W [N, K] with `epilogue`, or None: a CUDA entry of the table with
    all of K in a CTA (the Triton entries keep the norm launch)."""
    if cfg is None or not cfg.cuda:
        return f"the norm GEMM runs on the CUDA kernel (a 'cudaWxS[g]' entry), got {cfg and format_config(cfg)}"
    if cfg.splits > 1:
        return f"the norm GEMM makes x from all of K in a CTA; {format_config(cfg)} splits it over {cfg.splits} CTAs"
    return config_problem(cfg, N, K, G, epilogue)


def _check(a, y, post, scale, pre, K: int, epilogue: str):
    if a.dim() != 2 or a.shape[1] != K or not 1 <= a.shape[0] <= MAX_ROWS or y is None or y.shape != a.shape:
        raise ValueError(f"norm_gemm takes a and y [M, K={K}] with 1 <= M <= {MAX_ROWS}, got "
                         f"{tuple(a.shape)} / {None if y is None else tuple(y.shape)}")
    for t, name in ((a, "a"), (y, "y"), (post, "post"), (pre, "pre")):
        if t is None or t.dtype != torch.bfloat16:
            raise ValueError(f"norm_gemm: {name} must be bf16, got {None if t is None else t.dtype}")
    if post.numel() != K or pre.numel() != K:
        raise ValueError(f"norm_gemm: post and pre must hold {K} values, got {post.numel()} / {pre.numel()}")
    if scale is not None and (scale.numel() != 1 or not scale.is_floating_point()):
        raise ValueError(f"norm_gemm: scale is one float value, got {tuple(scale.shape)} {scale.dtype}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"norm_gemm epilogue must be one of {sorted(EPILOGUES)}, got {epilogue!r}")


def norm_gemm(a: torch.Tensor, y: torch.Tensor, post: torch.Tensor, scale: torch.Tensor | None, pre: torch.Tensor,
              weight: MmaWeight, *, eps: float, offset: float = 0.0, epilogue: str = "none",
              config: MmaConfig | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """a, y [M, K] bf16 (M <= 8), post / pre [K], scale one value or None -> (out [M, N] (geglu: [M, N/2]), h [M, K]);
    see the module docstring. config: a CUDA entry (`norm_gemm_problem`); pdl: programmatic dependent launch."""
    N, K, G = weight.N, weight.K, weight.group_size
    _check(a, y, post, scale, pre, K, epilogue)
    problem = norm_gemm_problem(config, N, K, G, epilogue) or layout_problem(weight, config)
    if problem:
        raise ValueError(f"norm_gemm: {problem}")
    from .cuda_gemm import cuda_norm

    return cuda_norm(a, y, post.reshape(-1), scale, pre.reshape(-1), weight.words, weight.sz, N, config.warps,
                     config.depth, epilogue, eps, offset, pdl)


def norm_gemm_ref(a, y, post, scale, pre, qweight, scales, zeros, group_size: int, *, eps: float,
                  offset: float = 0.0, epilogue: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """The twin from the standard packing: kernels/residual_norm.py's twin, then mma_w4a16's on its x."""
    from .residual_norm import residual_norm_ref

    h, x = residual_norm_ref(a, y, post.reshape(-1), scale, pre.reshape(-1), eps=eps, offset=offset)
    return mma_w4a16_ref(x, qweight, scales, zeros, group_size, epilogue), h


@torch.library.custom_op("fastgemma::norm_gemm", mutates_args=())
def norm_gemm_op(a: torch.Tensor, y: torch.Tensor, post: torch.Tensor, scale: torch.Tensor | None, pre: torch.Tensor,
                 words: torch.Tensor, sz: torch.Tensor, N: int, group_size: int, epilogue: str, warps: int, depth: int,
                 pairs: bool, eps: float, offset: float, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weight = MmaWeight(words, sz, N, a.shape[1], group_size, pairs)
    return norm_gemm(a, y, post, scale, pre, weight, eps=eps, offset=offset, epilogue=epilogue,
                     config=MmaConfig(1, warps, depth, pairs=pairs, cuda=True), pdl=pdl)


@norm_gemm_op.register_fake
def _(a, y, post, scale, pre, words, sz, N, group_size, epilogue, warps, depth, pairs, eps, offset, pdl):
    return a.new_empty((a.shape[0], N // 2 if epilogue == "geglu" else N)), torch.empty_like(a)


# ---------------------------------------------------------------------------------------------
# GPU check and timing

# E4B's GEMM after a residual update + norm on a CUDA entry: gate|up (+ GeGLU) after o's update
NORM_CASES = {"gate|up": (20480, 2560, "geglu")}


def bench_norm_gemm(cases: dict | None = None, ms=(1, 8), device: str = "cuda", rep_ms: int = 10) -> list[dict]:
    """The one launch against the two it replaces (kernels/residual_norm.py, then mma_w4a16 on the same CUDA entry)
    at each row count: both checked against the twin (`norm_gemm_ref`), the one launch's rows bit-equal to its
    one-row launches (what fuse.batch_invariant needs), then timed inside CUDA graphs with PDL launches, the words
    rotated out of L2. Prints a table; returns one dict per (case, M, form)."""
    from .bench_util import WRONG_REL_ERR, copies_past_l2, cuda_bench, max_rel_err, rotating
    from .int4_pack import pack_int4, quantize_int4
    from .mma_table import mma_config
    from .mma_w4a16 import mma_w4a16
    from .residual_norm import residual_norm

    dev, gen, timed_us = cuda_bench(device, "norm_gemm.bench_norm_gemm", rep_ms)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    eps, off = 1e-6, 1.0
    out_rows = []
    print(f"{torch.cuda.get_device_name(dev)}  residual update + norm + int4 GEMM: one launch vs two (us; PDL; "
          "words out of L2; errors against norm_gemm_ref)")
    print(f"{'case':>8} | {'M':>2} | {'form':<28} | {'us':>7} | out err | h err | rows = one-row launches")
    for case, (N, K, epi) in (cases or NORM_CASES).items():
        cfg = mma_config(N, K, 8, epi)
        problem = norm_gemm_problem(cfg, N, K, 128, epi)
        if problem:
            print(f"{case:>8} | skipped: {problem}")
            continue
        q, s, z = quantize_int4(rnd(N, K) * 0.02, 128)
        w = MmaWeight.from_codes(q, s, z, 128, pairs=cfg.pairs)
        bufs = [(MmaWeight(w.words.clone(), w.sz.clone(), N, K, 128, cfg.pairs),)
                for _ in range(copies_past_l2(w.words.numel() * 4, dev))]
        post, pre = rnd(K) * 0.3, rnd(K) * 0.3
        for M in ms:
            a, y = rnd(M, K) * 2, rnd(M, K)
            ref, href = norm_gemm_ref(a, y, post, None, pre, pack_int4(q), s, z, 128, eps=eps, offset=off,
                                      epilogue=epi)

            def one(wt, a=a, y=y):
                return norm_gemm(a, y, post, None, pre, wt, eps=eps, offset=off, epilogue=epi, config=cfg, pdl=True)

            def two(wt, a=a, y=y):
                h, x = residual_norm(a, y, post, None, pre, eps=eps, offset=off, pdl=True)
                return mma_w4a16(x, wt, epi, cfg, pdl=True), h

            rows = [norm_gemm(a[m:m + 1], y[m:m + 1], post, None, pre, w, eps=eps, offset=off, epilogue=epi,
                              config=cfg) for m in range(M)]
            got = one(w)
            same = torch.equal(got[0], torch.cat([r[0] for r in rows])) and torch.equal(got[1],
                                                                                      torch.cat([r[1] for r in rows]))
            for form, fn, res in (("residual_norm + " + format_config(cfg), two, two(w)),
                                  ("one launch (w4_norm_kernel)", one, got)):
                err, herr = max_rel_err(res[0], ref), max_rel_err(res[1], href)
                ok = err < WRONG_REL_ERR and herr < WRONG_REL_ERR
                us = timed_us(rotating(bufs, fn))
                eq = same if fn is one else ""
                out_rows.append(dict(case=case, M=M, form=form, us=us, max_rel_err=err, h_rel_err=herr, ok=ok,
                                     rows_equal=same if fn is one else None))
                print(f"{case:>8} | {M:>2} | {form:<28} | {us:7.2f} | {err:.1e} | {herr:.1e} | {eq}"
                      f"{'' if ok else '  WRONG'}")
        del bufs
    return out_rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=bench_norm_gemm.__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 8], help="row counts")
    bench_norm_gemm(ms=tuple(p.parse_args().m))
