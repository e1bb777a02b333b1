"""One-row GEMV with the layer's elementwise work folded in: fewer, fatter decode kernels.

A Gemma 4 layer at one row is six GEMVs with norms, residual adds and activations between them;
compiled, each of those is its own small kernel (~2.3 us on the H200 whatever its size). Here the
work before a GEMV runs in its prologue and the work after it in its epilogue:

- prologue `pro=1`: x = rmsnorm(a) * pre                                  (the input norm of layer 0)
- prologue `pro=2`: h = (a + rmsnorm(y) * post) * scale;  x = rmsnorm(h) * pre, or x = h without pre
  (the residual update of the previous sublayer, then this GEMV's input norm); the program that
  owns rows 0.. also writes h, the new residual stream
- epilogue `geglu`: W = [gate; up] (the merged gate|up matrix, as stored); each program takes
  BLOCK_N / 2 gate rows and the matching up rows and writes gelu_tanh(gate) * up
- epilogue `gelu_mul`: gelu_tanh(W x) * aux (the PLE gate times the layer's per-layer input)

Every program recomputes the prologue's two sums of squares over the K-long inputs (a few KB read
from L2) while its weight loads, issued first, are in flight. Values are rounded to the activation
dtype at the same points as the eager layer (norm output, residual add, layer scalar, gate, up,
gelu, product), so the result matches it up to the order of the fp32 sums. With `pdl` (sm90+) the
kernel also lets the next kernel launch at once and waits for the previous one only after its
weight loads are issued (programmatic dependent launch), as `gemv(..., launch="pdl")` does.

`fused_gemv` launches, `fused_gemv_op` is the opaque op for torch.compile, `fused_gemv_ref` the
torch twin (same rounding points). A config with `per_sm` > 0 runs kernels/stream_gemv.py instead:
a few programs a multiprocessor walking the row tiles (E4B's bf16 gate|up on the H200).
"""
from __future__ import annotations

import dataclasses
import functools
import re

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .gemv import _INTERPRET, MAX_KB, GemvConfig, _pdl_trigger, _pdl_wait, _wload_all, pdl_args, resolve_config

EPILOGUES = {"none": 0, "geglu": 1, "gelu_mul": 2}


@triton.jit
def _gelu_tanh(x):
    # 0.5 x (1 + tanh(z)) = x * sigmoid(2 z), z = sqrt(2 / pi) (x + 0.044715 x^3)
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))  # x -> -inf: x / huge -> -0, no inf


@triton.jit
def _rnd(x, DT: tl.constexpr):
    """x rounded to the activation dtype, kept in fp32."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _vload(ptr, kb: tl.constexpr, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr):
    k = kb * BLOCK_K + offs_k
    return tl.load(ptr + k, mask=k < K, other=0.0).to(tl.float32)


@triton.jit
def _pro_params(post_ptr, pre_ptr, scale_ptr, offs_k, K: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
                HAS_SCALE: tl.constexpr, HAS_PRE: tl.constexpr):
    """(posts, pres, scale): the prologue's parameters, post (PRO 2) and pre (PRO 1, or PRO 2 with a pre)
    per K block at offs_k, as stored (() where unused), and the layer scalar (1 without one). No kernel
    writes them, so they are loaded before the PDL wait: loaded after the prologue's reductions they were
    dependent round trips to DRAM (the weights leave the L2 between steps). Held in the x layout they
    cost registers (sm_90a: the bf16 q|k|v tile 8x1024w4 168 -> 244, 2 programs a multiprocessor instead
    of 3); asked into L2 instead (`prefetch.global.L2`, none held) the steps timed no faster (run HL)."""
    posts = ()
    pres = ()
    for kb in tl.static_range((K + BLOCK_K - 1) // BLOCK_K):
        k = kb * BLOCK_K + offs_k
        if PRO == 2:
            posts = posts + (tl.load(post_ptr + k, mask=k < K, other=0.0),)
        if (PRO == 1) or ((PRO == 2) and HAS_PRE):
            pres = pres + (tl.load(pre_ptr + k, mask=k < K, other=0.0),)
    return posts, pres, _layer_scale(scale_ptr, (PRO == 2) and HAS_SCALE)


@triton.jit
def _layer_scale(scale_ptr, HAS_SCALE: tl.constexpr):
    """The layer scalar s (1 without one): a parameter, which no kernel writes, so the kernels load it
    before their PDL wait (after a reduction it was a dependent round trip to DRAM)."""
    s = 1.0
    if HAS_SCALE:
        s = tl.load(scale_ptr).to(tl.float32)
    return s


@triton.jit
def _aux_rows(aux_ptr, rows, n_ok, EPI: tl.constexpr):
    """The gelu_mul epilogue's factors at the program's rows (0 for other epilogues), loaded right after the
    PDL wait rather than behind the GEMV."""
    aux = 0.0
    if EPI == 2:
        aux = tl.load(aux_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)
    return aux


@triton.jit
def _h_block(a_ptr, y_ptr, post, kb: tl.constexpr, offs_k, inv_y, scale, off,
             K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr, DT: tl.constexpr):
    """Block kb of h = (a + rmsnorm(y) * post) * scale (post: the block's values), rounded as the eager
    layer rounds."""
    return _h_values(_vload(a_ptr, kb, offs_k, K, BLOCK_K), _vload(y_ptr, kb, offs_k, K, BLOCK_K),
                     post.to(tl.float32), inv_y, scale, off, HAS_SCALE, DT)


@triton.jit
def _h_values(a, y, post, inv_y, scale, off, HAS_SCALE: tl.constexpr, DT: tl.constexpr):
    """h = (a + y inv_y (post + off)) * scale from fp32 values, rounded as the eager layer rounds."""
    h = _rnd(a + _rnd(y * inv_y * (post + off), DT), DT)
    if HAS_SCALE:
        h = _rnd(h * scale, DT)
    return h


@triton.jit
def _x_block(a_ptr, y_ptr, params, kb: tl.constexpr, offs_k, inv_y, inv_x, off,
             K: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr, HAS_SCALE: tl.constexpr,
             HAS_PRE: tl.constexpr, DT: tl.constexpr):
    """Block kb of the GEMV's input x, from the prologue's inputs (params: `_pro_params` at offs_k)."""
    posts, pres, scale = params
    if PRO == 0:
        x = _vload(a_ptr, kb, offs_k, K, BLOCK_K)
    elif PRO == 1:
        x = _rnd(_vload(a_ptr, kb, offs_k, K, BLOCK_K) * inv_x * (pres[kb].to(tl.float32) + off), DT)
    else:
        x = _h_block(a_ptr, y_ptr, posts[kb], kb, offs_k, inv_y, scale, off, K, BLOCK_K, HAS_SCALE, DT)
        if HAS_PRE:
            x = _rnd(x * inv_x * (pres[kb].to(tl.float32) + off), DT)
    return x


@triton.jit
def _fma_block(acc, w, a_ptr, y_ptr, params, kb: tl.constexpr, offs_k, inv_y, inv_x, off,
               K: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr, HAS_SCALE: tl.constexpr,
               HAS_PRE: tl.constexpr, DT: tl.constexpr):
    x = _x_block(a_ptr, y_ptr, params, kb, offs_k, inv_y, inv_x, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    return acc + w.to(tl.float32) * x[None, :]


@triton.jit
def _prologue_scalars(a_ptr, y_ptr, params, eps, off, K: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRO: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_PRE: tl.constexpr, DT: tl.constexpr):
    """(1 / rms(y), 1 / rms(x source)) for the prologue (zeros where unused); params:
    `_pro_params` at arange(BLOCK_K). y's and a's blocks are loaded together before the first reduction
    and held to the second: one round trip to L2, not one per reduction."""
    NKB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    posts, pres, scale = params
    offs_k = tl.arange(0, BLOCK_K)
    inv_y = 0.0
    inv_x = 0.0
    if PRO == 1:
        ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for kb in tl.static_range(NKB):
            v = _vload(a_ptr, kb, offs_k, K, BLOCK_K)
            ss += v * v
        inv_x = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    if PRO == 2:
        ys = ()  # as stored (fewer registers held than fp32)
        as_ = ()
        for kb in tl.static_range(NKB):
            k = kb * BLOCK_K + offs_k
            ys = ys + (tl.load(y_ptr + k, mask=k < K, other=0.0),)
            if HAS_PRE:
                as_ = as_ + (tl.load(a_ptr + k, mask=k < K, other=0.0),)
        ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for kb in tl.static_range(NKB):
            yv = ys[kb].to(tl.float32)
            ss += yv * yv
        inv_y = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
        if HAS_PRE:
            ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for kb in tl.static_range(NKB):
                h = _h_values(as_[kb].to(tl.float32), ys[kb].to(tl.float32), posts[kb].to(tl.float32), inv_y, scale,
                              off, HAS_SCALE, DT)
                ss += h * h
            inv_x = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    return inv_y, inv_x


@triton.jit
def _h_store(pid, a_ptr, y_ptr, params, h_ptr, inv_y, off, K: tl.constexpr, BLOCK_K: tl.constexpr,
             PRO: tl.constexpr, HAS_SCALE: tl.constexpr, DT: tl.constexpr):
    """PRO 2: the new residual stream h, written by program 0 (params: `_pro_params` at arange(BLOCK_K))."""
    if PRO == 2:
        if pid == 0:
            posts, pres, scale = params
            offs_k = tl.arange(0, BLOCK_K)
            for kb in tl.static_range((K + BLOCK_K - 1) // BLOCK_K):
                k = kb * BLOCK_K + offs_k
                hb = _h_block(a_ptr, y_ptr, posts[kb], kb, offs_k, inv_y, scale, off, K, BLOCK_K, HAS_SCALE, DT)
                tl.store(h_ptr + k, hb.to(DT), mask=k < K)


@triton.jit
def _finish(y, rows, n_ok, pid, aux, out_ptr, HALF, BLOCK_N: tl.constexpr, EPI: tl.constexpr, DT: tl.constexpr):
    """The epilogue's store of y [BLOCK_N] (fp32 sums; aux: `_aux_rows`)."""
    if EPI == 0:
        tl.store(out_ptr + rows, y.to(DT), mask=n_ok)
    elif EPI == 1:
        g, u = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
        act = _rnd(_rnd(_gelu_tanh(_rnd(g, DT)), DT) * _rnd(u, DT), DT)
        i2 = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + i2, act.to(DT), mask=i2 < HALF)
    else:
        act = _rnd(_rnd(_gelu_tanh(_rnd(y, DT)), DT) * aux, DT)
        tl.store(out_ptr + rows, act.to(DT), mask=n_ok)


@triton.jit
def _rows(pid, N, HALF, BLOCK_N: tl.constexpr, EPI: tl.constexpr):
    """The program's weight rows; with the GeGLU epilogue gate row i (even j) then up row HALF + i."""
    j = tl.arange(0, BLOCK_N)
    if EPI == 1:
        i = pid * (BLOCK_N // 2) + j // 2
        rows = i + (j % 2) * HALF
        n_ok = i < HALF
    else:
        rows = pid * BLOCK_N + j
        n_ok = rows < N
    return rows, n_ok


@triton.jit
def _fused_gemv_kernel(a_ptr, y_ptr, post_ptr, scale_ptr, pre_ptr, h_ptr, w_ptr, aux_ptr, out_ptr,
                       N, HALF, stride_wn, eps, off,
                       K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRO: tl.constexpr,
                       HAS_SCALE: tl.constexpr, HAS_PRE: tl.constexpr, EPI: tl.constexpr, PDL: tl.constexpr):
    _pdl_trigger(PDL)
    pid = tl.program_id(0)
    rows, n_ok = _rows(pid, N, HALF, BLOCK_N, EPI)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    NKB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _wload_all(w_ptrs, n_ok, offs_k, K,
                                                                                        BLOCK_K)
    params = _pro_params(post_ptr, pre_ptr, scale_ptr, offs_k, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE)
    _pdl_wait(PDL)  # the previous kernels' outputs are visible from here on
    DT: tl.constexpr = out_ptr.dtype.element_ty
    aux = _aux_rows(aux_ptr, rows, n_ok, EPI)
    inv_y, inv_x = _prologue_scalars(a_ptr, y_ptr, params, eps, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    acc = _fma_block(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), w0, a_ptr, y_ptr, params, 0,
                     offs_k, inv_y, inv_x, off, K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 1:
        acc = _fma_block(acc, w1, a_ptr, y_ptr, params, 1, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 2:
        acc = _fma_block(acc, w2, a_ptr, y_ptr, params, 2, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 3:
        acc = _fma_block(acc, w3, a_ptr, y_ptr, params, 3, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 4:
        acc = _fma_block(acc, w4, a_ptr, y_ptr, params, 4, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 5:
        acc = _fma_block(acc, w5, a_ptr, y_ptr, params, 5, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 6:
        acc = _fma_block(acc, w6, a_ptr, y_ptr, params, 6, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 7:
        acc = _fma_block(acc, w7, a_ptr, y_ptr, params, 7, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 8:
        acc = _fma_block(acc, w8, a_ptr, y_ptr, params, 8, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 9:
        acc = _fma_block(acc, w9, a_ptr, y_ptr, params, 9, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 10:
        acc = _fma_block(acc, w10, a_ptr, y_ptr, params, 10, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 11:
        acc = _fma_block(acc, w11, a_ptr, y_ptr, params, 11, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 12:
        acc = _fma_block(acc, w12, a_ptr, y_ptr, params, 12, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 13:
        acc = _fma_block(acc, w13, a_ptr, y_ptr, params, 13, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 14:
        acc = _fma_block(acc, w14, a_ptr, y_ptr, params, 14, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    if NKB > 15:
        acc = _fma_block(acc, w15, a_ptr, y_ptr, params, 15, offs_k, inv_y, inv_x, off,
                         K, BLOCK_K, PRO, HAS_SCALE, HAS_PRE, DT)
    y = tl.sum(acc, axis=1)
    _h_store(pid, a_ptr, y_ptr, params, h_ptr, inv_y, off, K, BLOCK_K, PRO, HAS_SCALE, DT)
    _finish(y, rows, n_ok, pid, aux, out_ptr, HALF, BLOCK_N, EPI, DT)


# Tiles: the prologue's work grows with the program count (each recomputes its norms), so the
# best tile differs from the plain GEMV's; without a config and outside FUSED_CONFIGS the launch is
# autotuned per (N, K, prologue, epilogue) on the first call (the warm-up, before any capture) over
# these candidates.
TUNE_TILES = [(1, 1024, 4), (2, 1024, 4), (4, 512, 4), (8, 512, 4), (16, 512, 8), (4, 256, 2)]


def _prune(configs, named_args, **kwargs):
    K = kwargs.get("K", named_args.get("K"))
    epi = kwargs.get("EPI", named_args.get("EPI"))
    keep = [c for c in configs
            if triton.cdiv(K, c.kwargs["BLOCK_K"]) <= MAX_KB and c.kwargs["BLOCK_K"] <= triton.next_power_of_2(K)
            and (epi != 1 or c.kwargs["BLOCK_N"] >= 2)]
    return keep or configs[-1:]


_fused_gemv_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in TUNE_TILES],
    key=["N", "K", "PRO", "HAS_SCALE", "HAS_PRE", "EPI", "PDL"],
    prune_configs_by={"early_config_prune": _prune},
)(_fused_gemv_kernel)


# (N, K, prologue, epilogue) -> tiles that replace the autotuner's pick, which is timed per process on the
# kernel alone and differs between processes (the PLE gate took 16 rows per program in run FL, 2 in runs
# FM, FO). Picked in the step on the H200 (bench.stack --fused-table, one process per run; E4B, window 188):
# the bf16 body's step 3.334 ms with the autotuner's picks -> 3.176 ms with these (run FR), most of it from
# the GEMVs with a prologue on 8 x 1024 tiles, the PLE projection's from run FU; the int4 body's PLE gate
# (its one dense GEMV) 1.880 -> 1.859 ms with 1 x 1024 (run FO); three of the drafter's in its draft loop (runs
# HT, HY, HZ). Shapes not here (the drafter's q and o), and every shape on other GPUs than sm_90 (where
# these were not measured), are autotuned.
FUSED_CONFIGS: dict[tuple[int, int, bool, str], GemvConfig] = {
    (3072, 2560, True, "none"): GemvConfig(8, 1024, 4),  # q|k|v
    (6144, 2560, True, "none"): GemvConfig(8, 1024, 4),  # q|k|v full
    (2048, 2560, True, "none"): GemvConfig(8, 1024, 4),  # q (KV-shared)
    (4096, 2560, True, "none"): GemvConfig(8, 1024, 4),  # q full (KV-shared; run FS: 3.184 -> 3.177 ms)
    # gate|up streamed (kernels/stream_gemv.py; runs HB-HE: 3.130 -> 3.068 ms; 8x1024w4, the one-program-per-tile
    # pick of run FQ, before; 8x512w8p1d8 3.124, 8x1024w8p1d4 3.098, 4x512w2p4d8 3.078)
    (20480, 2560, True, "geglu"): GemvConfig(8, 512, 4, per_sm=2, depth=8),
    (256, 2560, True, "gelu_mul"): GemvConfig(1, 1024, 4),  # PLE gate
    (2560, 2048, False, "none"): GemvConfig(2, 1024, 4),  # o
    (2560, 4096, False, "none"): GemvConfig(2, 1024, 4),  # o full
    (2560, 10240, False, "none"): GemvConfig(2, 1024, 4),  # down
    (2560, 256, False, "none"): GemvConfig(8, 256, 4),  # PLE projection (run FU, once: 4x256w2 3.153 -> 3.123 ms)
    # the drafter's down (and its full layer's o) and its pre-projection: the k=7 draft loop 577.4 us on 16x512w8
    # (one process's autotuned pick, run HM), 541.9 on this process's picks (8x512w4 / 2x1024w4), 528.9 on
    # these (run HT, bench.draft_loop --fused-table, one process; the same drafts)
    (256, 2048, False, "none"): GemvConfig(2, 1024, 4),
    (256, 5120, False, "none"): GemvConfig(2, 1024, 4),
    # the drafter's gate|up: the draft loop 498.6 -> 487.0 us against the autotuned 4x256w2 (run HY), 509.5 ->
    # 494.8 (run HZ, the same machine; 4x256w2 given as a table there: 519.8); the same drafts
    (4096, 256, True, "geglu"): GemvConfig(8, 256, 2),
}

# the fused GEMVs of an E4B one-row step and of its drafter's step by name: (N, K, prologue, epilogue)
# (bench.stack, bench.draft_loop and bench.spec --fused-table). The drafter's down is also its full layer's o
# (256 x 2,048), its post-projection the target's PLE projection (2,560 x 256)
FUSED_CASES = {
    "q|k|v": (3072, 2560, True, "none"), "q|k|v full": (6144, 2560, True, "none"), "q": (2048, 2560, True, "none"),
    "q full": (4096, 2560, True, "none"), "o": (2560, 2048, False, "none"), "o full": (2560, 4096, False, "none"),
    "gate|up": (20480, 2560, True, "geglu"), "down": (2560, 10240, False, "none"),
    "PLE gate": (256, 2560, True, "gelu_mul"), "PLE projection": (2560, 256, False, "none"),
    "draft pre-projection": (256, 5120, False, "none"), "draft q": (1024, 256, True, "none"),
    "draft q full": (2048, 256, True, "none"), "draft o": (256, 1024, False, "none"),
    "draft gate|up": (4096, 256, True, "geglu"), "draft down": (256, 2048, False, "none"),
}


def parse_fused_table(spec: str) -> dict[tuple[int, int, bool, str], GemvConfig]:
    """'CASE=NxKwW[pPdD],...' (CASE a name of FUSED_CASES, '_' for its spaces; N rows and K columns per
    block, W warps; pPdD: kernels/stream_gemv.py, P programs a multiprocessor, D blocks in flight a
    program; e.g. 'PLE_gate=2x1024w4', 'gate|up=8x512w8p2d8'), 'none' (an empty table: every shape
    autotuned), or '+' then entries (the shipped table with those changed) -> FUSED_CONFIGS' form.
    Clear errors otherwise."""
    table = {}
    if spec.startswith("+"):
        table, spec = dict(FUSED_CONFIGS), spec[1:]
    for item in [x.strip() for x in spec.split(",") if x.strip()]:
        if item == "none":
            continue
        case, _, tiles = item.replace("_", " ").rpartition("=")
        if case not in FUSED_CASES:
            raise ValueError(f"fused table entry {item!r}: CASE=NxKwW[pPdD] with CASE one of {sorted(FUSED_CASES)}, "
                             "e.g. 'PLE_gate=2x1024w4' or 'gate|up=8x512w8p2d8'")
        key = FUSED_CASES[case]
        try:  # the tiles' form, then the launcher's own check of a config
            table[key] = resolve_config(key[0], key[1], parse_tiles(tiles))
        except ValueError as e:
            raise ValueError(f"fused table entry {item!r}: {e}") from None
    return table


def parse_tiles(text: str) -> GemvConfig:
    """'NxKwW[pPdD]' -> GemvConfig (N rows and K columns a block, W warps; pPdD: streamed, P programs a
    multiprocessor, D blocks in flight a program), unchecked; a clear error for another form."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)(?:p(\d+)d(\d+))?", text)
    if not m:
        raise ValueError(f"tiles {text!r}: NxKwW[pPdD], e.g. '8x1024w4' or '8x512w4p2d8'")
    return GemvConfig(*(int(g) for g in m.groups() if g))


_FORCED = [False]  # a table set by set_fused_table(..., forced=True) applies on any GPU


def set_fused_table(table: dict, forced: bool = True) -> None:
    """Make `table` this process's FUSED_CONFIGS (read when the step is traced), on any GPU while
    `forced` (bench.stack --fused-table; it restores the shipped table with forced=False)."""
    if table is not FUSED_CONFIGS:
        FUSED_CONFIGS.clear()
        FUSED_CONFIGS.update(table)
    _FORCED[0] = forced


@functools.lru_cache(maxsize=None)
def pinned_on(device) -> bool:
    """Whether FUSED_CONFIGS applies on `device`: the compute capability it was measured on (sm_90)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def picks_line(picks: list[dict]) -> str:
    """`tuned_picks`' entries as the benchmarks print them ('' when none): N x K, prologue, epilogue -> tiles."""
    if not picks:
        return ""
    return "fused GEMV tiles the autotuner picked (shapes in no table): " + "; ".join(
        f"{p['N']}x{p['K']} pro {p['pro']} {p['epilogue']} -> {p['block_n']}x{p['block_k']}w{p['num_warps']}"
        for p in picks)


def tuned_picks() -> list[dict]:
    """The autotuner's picks in this process: N, K, prologue mode, epilogue, tiles."""
    names = {v: k for k, v in EPILOGUES.items()}
    out = []
    for key, cfg in getattr(_fused_gemv_tuned, "cache", {}).items():
        n, k, pro, _, _, epi = key[:6]
        out.append(dict(N=n, K=k, pro=pro, epilogue=names.get(epi, epi), block_n=cfg.kwargs["BLOCK_N"],
                        block_k=cfg.kwargs["BLOCK_K"], num_warps=cfg.num_warps))
    return out


def _check_dense(w) -> tuple[int, int]:
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError(f"fused_gemv needs w [N, K] contiguous along K, got {tuple(w.shape)}")
    return w.shape


def _check(a, N, K, y, post, scale, pre, aux, epilogue):
    """The prologue / epilogue inputs of a one-row GEMV with an [N, K] weight (dense or int4)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"fused_gemv epilogue must be one of {sorted(EPILOGUES)}, got {epilogue!r}")
    if a.numel() != K:
        raise ValueError(f"fused_gemv runs one row: a must hold K={K} values, got shape {tuple(a.shape)}")
    for name, t in (("y", y), ("post", post), ("pre", pre)):
        if t is not None and t.numel() != K:
            raise ValueError(f"fused_gemv: {name} must hold K={K} values, got {tuple(t.shape)}")
    if (y is None) != (post is None):
        raise ValueError("fused_gemv: y and post come together (h = a + rmsnorm(y) * post)")
    if scale is not None and (y is None or scale.numel() != 1):
        raise ValueError("fused_gemv: scale is one value and needs y")
    if epilogue == "geglu" and N % 2:
        raise ValueError(f"fused_gemv geglu needs W = [gate; up] with an even row count, got N={N}")
    if epilogue == "gelu_mul" and (aux is None or aux.numel() != N):
        raise ValueError(f"fused_gemv gelu_mul needs aux with N={N} values")


class _Launch:
    """What the dense and int4 fused launchers share for one call: the prologue / epilogue modes,
    the outputs, the pointer arguments before and after the weight's, the constexpr flags, the grid."""

    def __init__(self, a, y, post, scale, pre, aux, N: int, K: int, device, epilogue: str, pdl: bool):
        self.N, self.half, self.epi = N, N // 2, EPILOGUES[epilogue]
        pro = 0 if y is None and pre is None else (1 if y is None else 2)
        self.out = torch.empty(1, self.half if self.epi == 1 else N, device=device, dtype=a.dtype)
        self.h = torch.empty(1, K, device=device, dtype=a.dtype) if pro == 2 else None
        a = a.reshape(-1).contiguous()
        flat = lambda t: a if t is None else t.reshape(-1).contiguous()  # noqa: E731  (a: an unread dummy)
        # (a, y, post, scale, pre, h) come before the weight's pointers, (aux, out) after them
        self.head = (a, flat(y), flat(post), flat(scale), flat(pre), self.out if self.h is None else self.h)
        self.tail = (flat(aux), self.out)
        self.flags = dict(K=K, PRO=pro, HAS_SCALE=scale is not None, HAS_PRE=pre is not None, EPI=self.epi,
                          **pdl_args(pdl, device))

    def grid(self, block_n: int) -> tuple[int]:
        """GeGLU programs take block_n / 2 gate rows and their up rows."""
        return (triton.cdiv(self.half, block_n // 2) if self.epi == 1 else triton.cdiv(self.N, block_n),)


def fused_gemv(a, w, y=None, post=None, scale=None, pre=None, aux=None, *, eps: float, offset: float = 0.0,
               epilogue: str = "none", config: GemvConfig | None = None, pdl: bool = False):
    """-> (out [1, N] or [1, N/2] for geglu, h [1, K] or None). a, y [K] any shape holding K values."""
    N, K = _check_dense(w)
    _check(a, N, K, y, post, scale, pre, aux, epilogue)
    if not (w.is_cuda or _INTERPRET):
        raise RuntimeError("fused_gemv runs on CUDA tensors (or with TRITON_INTERPRET=1); use fused_gemv_ref")
    run = _Launch(a, y, post, scale, pre, aux, N, K, w.device, epilogue, pdl)
    if config is None and (_FORCED[0] or pinned_on(w.device)):
        config = FUSED_CONFIGS.get((N, K, run.flags["PRO"] > 0, epilogue))
    tune = config is None and not _INTERPRET
    if not tune:
        cfg = resolve_config(N, K, config)
        if run.epi == 1 and cfg.block_n < 2:
            cfg = dataclasses.replace(cfg, block_n=2)
        if triton.cdiv(K, cfg.block_k) > MAX_KB:
            raise ValueError(f"fused_gemv holds at most {MAX_KB} K blocks; K={K} needs BLOCK_K >= "
                             f"{triton.cdiv(K, MAX_KB)}")
    args = (*run.head, w, *run.tail, N, run.half, w.stride(0), eps, offset)
    if tune:
        _fused_gemv_tuned[lambda meta: run.grid(meta["BLOCK_N"])](*args, **run.flags)
    elif cfg.per_sm:
        from .stream_gemv import launch_stream

        launch_stream(args, run.flags, run.grid(cfg.block_n)[0], cfg, w.device)
    else:
        _fused_gemv_kernel[run.grid(cfg.block_n)](*args, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                                  num_warps=cfg.num_warps, **run.flags)
    return run.out, run.h


def _rms(v, w, eps, offset):
    """The eager RMSNorm (model.layers.RMSNorm) as a function."""
    vf = v.float()
    out = vf * torch.pow(vf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (out * (w.float() + offset)).to(v.dtype)


def fused_gemv_ref(a, w, y=None, post=None, scale=None, pre=None, aux=None, *, eps: float, offset: float = 0.0,
                   epilogue: str = "none", config=None, pdl: bool = False, linear=None):
    """The torch twin: the eager layer's ops in its order (`linear`: x -> x W^T in place of F.linear(x, w),
    for weights stored otherwise: kernels/fused_w8a16.py's int8 rows)."""
    N, K = _check_dense(w)
    _check(a, N, K, y, post, scale, pre, aux, epilogue)
    a = a.reshape(1, K)
    h = None
    if y is not None:
        h = a + _rms(y.reshape(1, K), post, eps, offset)
        if scale is not None:
            h = h * scale.reshape(1)
        x = _rms(h, pre, eps, offset) if pre is not None else h
    else:
        x = _rms(a, pre, eps, offset) if pre is not None else a
    out = F.linear(x, w) if linear is None else linear(x)
    if epilogue == "geglu":
        g, u = out.chunk(2, dim=-1)
        out = F.gelu(g, approximate="tanh") * u
    elif epilogue == "gelu_mul":
        out = F.gelu(out, approximate="tanh") * aux.reshape(1, N)
    return out, h


@torch.library.custom_op("fastgemma::fused_gemv", mutates_args=())
def fused_gemv_op(a: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None, post: torch.Tensor | None,
                  scale: torch.Tensor | None, pre: torch.Tensor | None, aux: torch.Tensor | None, eps: float,
                  offset: float, epilogue: str, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, h = fused_gemv(a, w, y, post, scale, pre, aux, eps=eps, offset=offset, epilogue=epilogue, pdl=pdl)
    return out, (h if h is not None else out.new_empty(0))


@fused_gemv_op.register_fake
def _(a, w, y, post, scale, pre, aux, eps, offset, epilogue, pdl):
    N, K = w.shape
    out = a.new_empty((1, N // 2 if epilogue == "geglu" else N))
    return out, (a.new_empty((1, K)) if y is not None else a.new_empty(0))
