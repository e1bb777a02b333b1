"""The fused one-row GEMV (kernels/fused_gemv.py) on W4A16 weights: the same prologues (norm,
residual update, layer scale) and epilogues (GeGLU, PLE gate), around the factored int4 GEMV of
kernels/w4a16.py (per group and row: sum w*x = 16 s (sum f*x - sum x) + z sum x, f = 1 + q/16).

Tiles come from `TILES` (swept for the fused kernel by `bench_tiles`), else from the one-row W4A16
table (`w4a16.resolve_config(1, N, K, G)`); whole K per program (no split-K: the prologue and
epilogue need every column), the K loop unrolled. The config's `words` picks the inner loop: the
byte loop, or the word loop of `w4a16._gemv_kernel` with x computed as [words, 8] (one vector per
word, no repeated prologue work per code) and split into the 8 code positions in registers. The
byte loop loads every block's weights before the PDL wait (a prefetch, as the dense fused GEMV
does); the word loop waits first. `pdl` also lets the next kernel launch at once.
`fused_w4a16` launches, `fused_w4a16_op` is the opaque op, `fused_w4a16_ref` the twin (dequantize to
the activation dtype, then the dense twin: what the unfused torch path computes).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .fused_gemv import (_aux_rows, _check, _finish, _h_store, _Launch, _pro_params, _prologue_scalars, _rows,
                         _x_block, fused_gemv_ref)
from .gemv import _INTERPRET, MAX_KB, _pdl_trigger, _pdl_wait
from .int4_pack import dequantize_int4
from .w4a16 import _byte_terms, _group_terms, _word_dot
from .w4a16_table import W4A16Config, resolve_config


@triton.jit
def _split8(x):
    """[W, 8] -> its 8 columns, in the order 0, 4, 2, 6, 1, 5, 3, 7 (three in-register splits)."""
    ev, od = tl.split(tl.reshape(x, (x.shape[0], 4, 2)))
    e0, e1 = tl.split(tl.reshape(ev, (x.shape[0], 2, 2)))
    o0, o1 = tl.split(tl.reshape(od, (x.shape[0], 2, 2)))
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x4, x2, x6, x1, x5, x3, x7


@triton.jit
def _block_loads(w_ptrs, w_mask, s_ptrs, z_ptrs, n_ok, kb: tl.constexpr, WSTEP: tl.constexpr, NG: tl.constexpr, N):
    """K block kb's codes, scales and zeros (as stored)."""
    w = tl.load(w_ptrs + kb * WSTEP, mask=w_mask, other=0)
    s = tl.load(s_ptrs + kb * NG * N, mask=n_ok[:, None], other=0.0)
    z = tl.load(z_ptrs + kb * NG * N, mask=n_ok[:, None], other=0.0)
    return w, s, z


@triton.jit
def _params2(post_ptr, pre_ptr, scale_ptr, offs_x, K: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
             HAS_SCALE: tl.constexpr, HAS_PRE: tl.constexpr):
    """The prologue's parameters (`fused_gemv._pro_params`) at its own offsets and at x's."""
    return (_pro_params(post_ptr, pre_ptr, scale_ptr, tl.arange(0, BLOCK_K), K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE),
            _pro_params(post_ptr, pre_ptr, scale_ptr, offs_x, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE))


@triton.jit
def _fused_w4a16_kernel(a_ptr, y_ptr, post_ptr, scale_ptr, pre_ptr, h_ptr, qw_ptr, s_ptr, z_ptr, aux_ptr, out_ptr,
                        N, HALF, eps, off,
                        K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRO: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_PRE: tl.constexpr, EPI: tl.constexpr,
                        PDL: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr):
    _pdl_trigger(PDL)
    pid = tl.program_id(0)
    rows, n_ok = _rows(pid, N, HALF, BLOCK_N, EPI)
    NG: tl.constexpr = BLOCK_K // GROUP
    NKB: tl.constexpr = K // BLOCK_K
    offs_g = tl.arange(0, NG)
    s_ptrs = s_ptr + offs_g[None, :] * N + rows[:, None]  # [BLOCK_N, NG]
    z_ptrs = z_ptr + offs_g[None, :] * N + rows[:, None]
    WG: tl.constexpr = GROUP // 8  # int32 words per group and row
    WK: tl.constexpr = BLOCK_K // 8
    HG: tl.constexpr = GROUP // 2  # bytes per group and row
    if WORDS:  # [BLOCK_N, WK] int32 words: 8 consecutive k each
        w_ptrs = qw_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 8) + tl.arange(0, WK)[None, :]
        w_mask = n_ok[:, None]
    else:  # [BLOCK_N, NG, HG] code bytes
        w_ptrs = (qw_ptr + rows[:, None, None] * (K // 2) + offs_g[None, :, None] * HG
                  + tl.arange(0, HG)[None, None, :])
        w_mask = n_ok[:, None, None]
    WSTEP: tl.constexpr = BLOCK_K // 8 if WORDS else BLOCK_K // 2  # pointer step per K block
    if not WORDS:
        # byte loop: every block's weights, scales and zeros are loaded first; with PDL they stream in
        # while the previous kernel finishes (they are constants; its outputs are read after the wait).
        # The word loop loads per block after the wait: up front, its 16-row tiles ran slower on the
        # H200 (gate|up 14.97 -> 22.98 us; only the first one or two blocks up front: 15.32 -> 19.25 /
        # 19.44 us, run W)
        blocks = ()
        for kb in tl.static_range(NKB):
            blocks = blocks + (_block_loads(w_ptrs, w_mask, s_ptrs, z_ptrs, n_ok, kb, WSTEP, NG, N),)
    if WORDS:  # x as [WK, 8] k of each word's codes (split in registers), else [NG, GROUP] columns of a K block
        offs_x = tl.arange(0, WK)[:, None] * 8 + tl.arange(0, 8)[None, :]
    else:
        offs_x = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    if not WORDS:  # the norm weights with the weights, before the wait
        params, params_x = _params2(post_ptr, pre_ptr, scale_ptr, offs_x, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE)
    _pdl_wait(PDL)
    if WORDS:  # the word loop waits first (above), its parameters too
        params, params_x = _params2(post_ptr, pre_ptr, scale_ptr, offs_x, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    aux = _aux_rows(aux_ptr, rows, n_ok, EPI)
    inv_y, inv_x = _prologue_scalars(a_ptr, y_ptr, params, eps, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    if WORDS:  # codes two at a time (w4a16._nibble_pair)
        for kb in tl.static_range(NKB):
            x = _x_block(a_ptr, y_ptr, params_x, kb, offs_x, inv_y, inv_x, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE,
                         DT)
            x0, x4, x2, x6, x1, x5, x3, x7 = _split8(x)
            w, s, z = _block_loads(w_ptrs, w_mask, s_ptrs, z_ptrs, n_ok, kb, WSTEP, NG, N)
            p = _word_dot(w, x0, x4, x1, x5, x2, x6, x3, x7, ASM, EXACT)
            acc += _group_terms(p, x0 + x1 + x2 + x3, x4 + x5 + x6 + x7, s.to(tl.float32), z.to(tl.float32),
                                BLOCK_N, NG, WG, EXACT)
    else:  # bytes: one code byte per int32, each code shifted and masked on its own
        for kb in tl.static_range(NKB):
            w, s, z = blocks[kb]
            w = w.to(tl.int32)
            s = s.to(tl.float32)
            z = z.to(tl.float32)
            x = _x_block(a_ptr, y_ptr, params_x, kb, offs_x, inv_y, inv_x, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE,
                         DT)  # [NG, GROUP] fp32
            x_even, x_odd = tl.split(tl.reshape(x, (NG, HG, 2)))
            acc += _byte_terms(w, x_even, x_odd, tl.sum(x, axis=1), s, z)
    y = tl.sum(acc, axis=1)
    _h_store(pid, a_ptr, y_ptr, params, h_ptr, inv_y, off, K, BLOCK_K, PRO, HAS_SCALE, DT)
    _finish(y, rows, n_ok, pid, aux, out_ptr, HALF, BLOCK_N, EPI, DT)


# (N, K, prologue, epilogue) -> tiles, ahead of the one-row W4A16 table. `bench_tiles` on the H200
# (2026-11-30, PDL launches, weights rotated out of L2), us: this entry / what launched before (the
# one-row table's tiles, byte loop, no prefetch; run Q). Byte-loop rows from run S (prefetch before
# the PDL wait), the word-loop row from run Q (no prefetch; with it, 22.98 us).
TILES: dict[tuple[int, int, int, int], W4A16Config] = {
    (3072, 2560, 2, 0): W4A16Config(16, 512, 1, 4),  # q|k|v: 7.39 / 11.10
    (6144, 2560, 2, 0): W4A16Config(16, 512, 1, 4),  # q|k|v full: 7.87 / 12.09
    (2048, 2560, 2, 0): W4A16Config(4, 512, 1, 4),  # q (KV-shared layers): 5.66 / 11.38
    (2560, 2048, 0, 0): W4A16Config(4, 1024, 1, 4),  # o: 4.11 / 4.45
    (2560, 4096, 0, 0): W4A16Config(8, 512, 1, 4),  # o full: 4.90 / 6.40
    (20480, 2560, 2, 1): W4A16Config(16, 512, 1, 2, words=True),  # gate|up with GeGLU: 14.97 / 26.51
    (2560, 10240, 0, 0): W4A16Config(4, 1024, 1, 4),  # down: 11.09 / 14.19
    (2560, 256, 0, 0): W4A16Config(4, 256, 1, 2),  # PLE projection: 1.42 / 1.93
}

# name -> (N, K, mode) as fuse=layers launches them on E4B (mode: residual = the residual update
# with the layer scalar and the input norm; geglu = residual update, norm and GeGLU; plain = none)
E4B_CASES = {
    "q|k|v": (3072, 2560, "residual"), "q|k|v full": (6144, 2560, "residual"), "q": (2048, 2560, "residual"),
    "o": (2560, 2048, "plain"), "o full": (2560, 4096, "plain"), "gate|up": (20480, 2560, "geglu"),
    "down": (2560, 10240, "plain"), "PLE projection": (2560, 256, "plain"),
    "q full": (4096, 2560, "residual"),  # the KV-shared full layers' q (fuse.batch_invariant's table entry)
    "W_plm": (10752, 2560, "plain"),  # the PLE context projection (in the embedding; fuse.batch_invariant)
}


def case_inputs(mode: str, K: int, vec) -> dict:
    """The prologue / epilogue arguments of a `E4B_CASES` mode (vec(n) -> a [1, n] activation):
    residual: y, post, pre and the layer scale; geglu: y, post, pre and the GeGLU epilogue; plain: none."""
    if mode == "plain":
        return {}
    kw = dict(y=vec(K), post=vec(K), pre=vec(K))
    if mode == "residual":
        kw["scale"] = vec(1)
    else:
        kw["epilogue"] = "geglu"
    return kw


def tile_candidates() -> list[W4A16Config]:
    """What `bench_tiles` tries (resolve_config fits block_k to K; > 16 K blocks are skipped): the byte
    loop on small tiles (the one-row table's among them), the word loop on 4-32 rows."""
    out = [W4A16Config(bn, bk, 1, w) for bn, bk, w in ((4, 512, 2), (4, 1024, 4), (8, 512, 4), (8, 1024, 2),
                                                       (16, 1024, 4))]
    return out + [W4A16Config(bn, 1024, 1, w, words=True) for bn, w in ((4, 1), (8, 1), (8, 2), (16, 1), (16, 2),
                                                                        (32, 2))]


def bench_tiles(cases: dict | None = None, candidates=None, group_size: int = 128, dtype=torch.bfloat16,
                timer=None, device: str = "cuda", pdl: bool = True) -> list[dict]:
    """Time every candidate tile of the fused int4 GEMV on each case, weights rotated out of L2, each
    output checked against the twin first. Prints a table and TILES lines for the fastest; returns
    one dict per (case, config). `timer(fn) -> us` defaults to CUDA graphs (tests pass their own)."""
    from .bench_util import WRONG_REL_ERR, copies_past_l2, max_rel_err, timed_candidate, timer_or_graphs
    from .int4_pack import pack_int4, quantize_int4

    dev = torch.device(device)
    timer = timer_or_graphs(timer, "bench_tiles")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, lines = [], []
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}  fused int4 GEMV, group {group_size}, "
          f"{'PDL' if pdl else 'plain launch'} (us; weights rotated out of L2)")
    for name, (N, K, mode) in (cases or E4B_CASES).items():
        w = torch.randn(N, K, device=dev, dtype=dtype, generator=gen) * 0.02
        q, sc, zr = quantize_int4(w, group_size)
        qw = pack_int4(q)
        vec = lambda n: torch.randn(1, n, device=dev, dtype=dtype, generator=gen)  # noqa: E731
        kw = dict(eps=1e-6, pdl=pdl, **case_inputs(mode, K, vec))
        a = vec(K)
        ref = fused_w4a16_ref(a, qw, sc, zr, group_size, **kw)[0]
        nbytes = qw.numel() + 2 * sc.numel() * sc.element_size()
        bufs = [(qw.clone(), sc.clone(), zr.clone()) for _ in range(copies_past_l2(nbytes, dev))]
        best, seen = None, set()
        for cfg in candidates or tile_candidates():
            fit = resolve_config(1, N, K, group_size, cfg)
            if K // fit.block_k > MAX_KB or fit in seen:
                continue
            seen.add(fit)
            call = lambda q_, s_, z_, c=fit: fused_w4a16(a, q_, s_, z_, group_size, config=c, **kw)[0]  # noqa: E731
            run = timed_candidate(call, [(qw, sc, zr)] + bufs, timer, str(fit))
            if run is None:
                continue
            got, us = run
            err = max_rel_err(got, ref)
            ok = err < WRONG_REL_ERR
            rows.append(dict(case=name, N=N, K=K, mode=mode, config=fit, us=us, max_rel_err=err, ok=ok))
            print(f"{name:>16} {N:>6} {K:>6} {mode:>8} | {us:8.2f} | {'ok' if ok else 'WRONG'} {err:.1e} | {fit}")
            if ok and (best is None or us < best[0]):
                best = (us, fit)
        if best:
            key = (N, K, {"plain": 0}.get(mode, 2), 1 if mode == "geglu" else 0)
            c = best[1]
            lines.append(f"    {key}: W4A16Config({c.block_n}, {c.block_k}, 1, {c.num_warps}"
                         f"{', words=True' if c.words else ''}),  # {name}: {best[0]:.2f} us")
        del bufs
    print("\n# TILES entries ((N, K, PRO, EPI): block_n, block_k, split_k, num_warps[, words]):")
    print("\n".join(lines))
    return rows


def _fit_long_k(cfg: W4A16Config, N: int, K: int, group_size: int) -> W4A16Config:
    """A tile whose K blocks are more than MAX_KB, widened: the narrowest power-of-two block that leaves at most
    MAX_KB (resolve_config then fits it to the group size and to K), its warps grown as much, so that a thread holds
    the words it held (E2B's down at 4 x 1,024: 4 warps, 128 registers, no spills; 2 warps spill 1.5 KB)."""
    bk = triton.next_power_of_2(triton.cdiv(K, MAX_KB))
    warps = min(16, cfg.num_warps * max(1, bk // cfg.block_k))
    return resolve_config(1, N, K, group_size, dataclasses.replace(cfg, block_k=bk, num_warps=warps))


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
    run = _Launch(a, y, post, scale, pre, aux, N, K, qweight.device, epilogue, pdl)
    # block_k: a group multiple dividing K
    cfg = resolve_config(1, N, K, group_size, config or TILES.get((N, K, run.flags["PRO"], run.epi)))
    if K // cfg.block_k > MAX_KB and config is None:  # a default tile on a long K (E2B's down, 12,288): wider blocks
        cfg = _fit_long_k(cfg, N, K, group_size)
    if K // cfg.block_k > MAX_KB:
        raise ValueError(f"fused_w4a16 unrolls at most {MAX_KB} K blocks; K={K} needs block_k >= {K // MAX_KB}")
    bn = max(cfg.block_n, 2) if run.epi == 1 else cfg.block_n
    _fused_w4a16_kernel[run.grid(bn)](*run.head, qweight, scales, zeros, *run.tail, N, run.half, eps, offset,
                                      GROUP=group_size, BLOCK_N=bn, BLOCK_K=cfg.block_k,
                                      WORDS=cfg.words, ASM=not _INTERPRET, EXACT=a.dtype == torch.float32,
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
