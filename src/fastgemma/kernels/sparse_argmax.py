"""LM-head GEMV fused with the greedy argmax (dense or a pruned keepset of rows): Triton + torch twin.

x [M, K] (M = 1 decode, up to 16 for a speculative verify) times head rows W [N, K] -> token ids
[M] int64. W is dense (bf16 / fp16 / fp32, the dtype of x) or int8 with a per-row scale [N];
`keep_ids` [N] int64 maps row n to its vocabulary id (None: row n is id n, the full head).
Optionally the same launch stores the softcapped logits at logits_out[m, keep_ids[n]] (fp32 [M, V]);
positions outside the keepset are never written, so a buffer filled with -inf once stays -inf.

Numerics mirror the plain head (`Gemma4Model.compute_logits`): the fp32 sum is rounded to x's dtype
(F.linear's output dtype; round_to_input=False keeps fp32), int8 rows are scaled after that rounding
and rounded again. The argmax is taken before the softcap (tanh is monotonic). Ties go to the lowest
row, so with keep_ids ascending the pick equals argmax(compute_logits) over the kept ids.
Trap: on the GPU the kernel's fp32 sum order differs from cuBLAS's, so logits that straddle a bf16
rounding boundary can still flip a near-tie; greedy identity in bf16 is a rate, as everywhere.

Two launches, grid from shapes only (no host sync, CUDA-graph safe):
1. `_head_block_kernel`: one program = BLOCK_N rows x BLOCK_M rows of x, the whole K; M = 1 uses
   CUDA-core dot products ([BLOCK_N, BLOCK_K] fp32 accumulator; int8 rows read as int32 words, each
   code made exact without I2F: `_int8_byte`), M > 1 tl.dot with BLOCK_M = 16
   (each weight tile read once for all rows). Writes its block's max and row index per x row:
   partials [M, P] fp32 + int32, P = cdiv(N, BLOCK_N) (E4B full head, BLOCK_N 16: 16,384 x 8 bytes).
2. `_argmax_reduce_kernel`: one program per x row scans the P partials (max, lowest index) and
   writes keep_ids[index].
Bytes per token: N * K * 2 (bf16; 12,288 x 2560 = 62.9 MB, full 1.34 GB) or N * (K + 4) (int8), plus
4 * N written when logits are stored.

int4 rows (`head_argmax_int4`): kernels/w4a16.py's one-row GEMV with `_block_pick` in its store instead
of step 1 (the GEMV's own tiles and sums; 12,288 rows: 15.7 MB + 0.5 MB of scales / zeros at group 128),
then step 2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_INTERPRET = bool(triton.knobs.runtime.interpret)  # read where @triton.jit reads it: at import
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _softcap(z, cap):
    # cap * tanh(z / cap) from exp (no libdevice, so the CPU interpreter runs it too); stable for any |z|
    u = z / cap
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(u < 0, -t, t)


@triton.jit
def _int8_byte(v, J: tl.constexpr):
    # byte J of int32 words v as the int8 it holds, exactly and without I2F (a quarter-rate pipe): the byte
    # with its sign bit flipped is s + 128, OR-ed into the mantissa of 2^23; minus 2^23 + 128 leaves s
    t = v >> (8 * J) if J > 0 else v
    return ((t & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _head_block_kernel(
    x_ptr, w_ptr, s_ptr, keep_ptr, pmax_ptr, pidx_ptr, logit_ptr,
    M, N, stride_xm, stride_wn, stride_lm, softcap,
    K: tl.constexpr, NUM_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_KEEP: tl.constexpr, STORE_LOGITS: tl.constexpr, WANT_IDS: tl.constexpr,
    SOFTCAP: tl.constexpr, ROUND: tl.constexpr, IEEE: tl.constexpr, WORDS8: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    xdt = x_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    # int64 row offsets: the full head is 262,144 x 2560 elements (fits int32, but a wider head would not)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]

    if BLOCK_M == 1 and WORDS8:  # int8 rows read as int32 words (16-byte vectors), 4 codes each
        WK: tl.constexpr = BLOCK_K // 4
        offs_w = tl.arange(0, WK)
        v_ptrs = (w_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None].to(tl.int64) * (stride_wn // 4)
                  + offs_w[None, :])
        xw_ptrs = x_ptr + pid_m * stride_xm + offs_w * 4  # x of each word's code 0
        acc4 = tl.zeros((BLOCK_N, WK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w_ok = (k0 // 4 + offs_w) < K // 4
            v = tl.load(v_ptrs, mask=n_ok[:, None] & w_ok[None, :], other=0)
            x0 = tl.load(xw_ptrs, mask=w_ok, other=0.0).to(tl.float32)
            x1 = tl.load(xw_ptrs + 1, mask=w_ok, other=0.0).to(tl.float32)
            x2 = tl.load(xw_ptrs + 2, mask=w_ok, other=0.0).to(tl.float32)
            x3 = tl.load(xw_ptrs + 3, mask=w_ok, other=0.0).to(tl.float32)
            acc4 += _int8_byte(v, 0) * x0[None, :]
            acc4 += _int8_byte(v, 1) * x1[None, :]
            acc4 += _int8_byte(v, 2) * x2[None, :]
            acc4 += _int8_byte(v, 3) * x3[None, :]
            v_ptrs += WK
            xw_ptrs += BLOCK_K
        acc = tl.reshape(tl.sum(acc4, axis=1), (1, BLOCK_N))  # [BLOCK_M = 1, BLOCK_N]
    elif BLOCK_M == 1:
        # x as [1, BLOCK_K]: it sets the product's layout, so the weight tile passes through shared memory an
        # iteration (sm_90a: 8 barriers, 4 ldmatrix). x read in w's shape instead (no barrier, each thread its
        # own x from L1) was slower: the full head 310 -> 346 us, 12,288 rows 22.0 -> 22.5 (run KD)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.float32)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [1, BLOCK_K]
            acc2 += w * x
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.reshape(tl.sum(acc2, axis=1), (1, BLOCK_N))  # [BLOCK_M = 1, BLOCK_N]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            # int8 codes are exact in bf16 / fp16 / fp32
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0).to(xdt)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if IEEE else "tf32")
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

    if HAS_SCALE:
        if ROUND:
            acc = acc.to(xdt).to(tl.float32)
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND:
        acc = acc.to(xdt).to(tl.float32)
    _block_pick(acc, offs_m, m_ok, offs_n, n_ok, pid_n * BLOCK_N, pmax_ptr + pid_n, pidx_ptr + pid_n, keep_ptr,
                logit_ptr, stride_lm, softcap, NUM_P, HAS_KEEP, STORE_LOGITS, WANT_IDS, SOFTCAP)


@triton.jit
def _block_pick(acc, offs_m, m_ok, offs_n, n_ok, n0, pmax_ptr, pidx_ptr, keep_ptr, logit_ptr, stride_lm, softcap,
                NUM_P: tl.constexpr, HAS_KEEP: tl.constexpr, STORE_LOGITS: tl.constexpr, WANT_IDS: tl.constexpr,
                SOFTCAP: tl.constexpr):
    """A block's pre-softcap logits acc [BLOCK_M, BLOCK_N] fp32 (rows offs_n, the first n0) -> its max and
    lowest row index per x row at pmax_ptr / pidx_ptr + m * NUM_P (this block's partial), and the softcapped
    logits at logit_ptr[m, keep_ids[n]] (STORE_LOGITS). Shared by the dense / int8 kernel above and the int4
    GEMV's argmax store (kernels/w4a16.py)."""
    acc = tl.where(n_ok[None, :], acc, float("-inf"))
    if WANT_IDS:
        bmax = tl.max(acc, axis=1)                       # [BLOCK_M]
        barg = tl.argmax(acc, axis=1, tie_break_left=True)
        tl.store(pmax_ptr + offs_m * NUM_P, bmax, mask=m_ok)
        tl.store(pidx_ptr + offs_m * NUM_P, n0 + barg, mask=m_ok)
    if STORE_LOGITS:
        y = acc
        if SOFTCAP:
            y = _softcap(acc, softcap)
        if HAS_KEEP:
            cols = tl.load(keep_ptr + offs_n, mask=n_ok, other=0)
        else:
            cols = offs_n.to(tl.int64)
        l_ptrs = logit_ptr + offs_m[:, None].to(tl.int64) * stride_lm + cols[None, :]
        tl.store(l_ptrs, y, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _argmax_reduce_kernel(pmax_ptr, pidx_ptr, keep_ptr, out_ptr,
                          NUM_P: tl.constexpr, BLOCK_P: tl.constexpr, HAS_KEEP: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    best_v = tl.full((BLOCK_P,), float("-inf"), tl.float32)
    best_i = tl.zeros((BLOCK_P,), dtype=tl.int32)
    for p0 in range(0, NUM_P, BLOCK_P):
        ok = (p0 + offs) < NUM_P
        v = tl.load(pmax_ptr + m * NUM_P + p0 + offs, mask=ok, other=float("-inf"))
        i = tl.load(pidx_ptr + m * NUM_P + p0 + offs, mask=ok, other=0)
        take = v > best_v  # strict: per lane the earlier block (lower rows) keeps a tie
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, i, best_i)
    vmax = tl.max(best_v, axis=0)
    # across lanes the lowest row index among the maxima (not the lowest lane); all -inf -> row 0
    idx = tl.min(tl.where(best_v == vmax, best_i, 2147483647), axis=0)
    if HAS_KEEP:
        tok = tl.load(keep_ptr + idx)
    else:
        tok = idx.to(tl.int64)
    tl.store(out_ptr + m, tok)


# ---------------------------------------------------------------------------------------------
# dispatch


@dataclass(frozen=True)
class HeadArgmaxConfig:
    """Tiles of one launch. block_m == 1 -> CUDA-core GEMV (grid over x rows); block_m >= 16 -> tl.dot."""
    block_n: int = 16
    block_k: int = 256
    block_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    block_p: int = 1024


# M = 1: 16 rows x 256 k of bf16 per iteration = 8 KB, four 16-byte vectors per thread at 4 warps;
# M > 1: 64 rows x 128 k per tl.dot step. Starting points, not yet timed on the H200 (bench_head sweeps).
GEMV_CONFIG = HeadArgmaxConfig(16, 256, 1, 4, 3)
DOT_CONFIG = HeadArgmaxConfig(64, 128, 16, 4, 3)
# int8 rows at M = 1, read as int32 words: 32 rows x 256 k = 8 KB per iteration as for bf16 (sm_90a: 56
# registers, four 16-byte loads and no barrier an iteration, where 16 x 512 moved x through shared memory
# behind 8 barriers; run KD, ids only: the full head 173.0 -> 161.5 us, 12,288 rows 13.8 -> 15.0). Read per
# element with GEMV_CONFIG, the code took 4-byte loads, a layout change through shared memory and an I2F per
# weight, and the full head's 672 MB took 312 us (2.2 TB/s, run GV)
INT8_GEMV_CONFIG = HeadArgmaxConfig(32, 256, 1, 4, 3)
# int8 rows at one row as int32 words where they are 4-byte aligned (True), or element by element (False: the
# baseline of bench.head's int8 rows). Read at launch
INT8_WORDS = True
# fuse.batch_invariant: one config at every M (1..16 rows in one tile), so a row's logits are the same
# bits at one row and in a verify pass (the tl.dot's columns are independent)
ROW_INVARIANT_CONFIG = DOT_CONFIG


def default_config(M: int, int8: bool = False) -> HeadArgmaxConfig:
    return (INT8_GEMV_CONFIG if int8 else GEMV_CONFIG) if M == 1 else DOT_CONFIG


def _check(x, w, scales, keep_ids, logits_out):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [N, K] with the same K, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be fp32 / fp16 / bf16, got {x.dtype}")
    N = w.shape[0]
    if w.dtype == torch.int8:
        if scales is None or tuple(scales.shape) != (N,):
            raise ValueError(f"int8 rows need per-row scales [N] = [{N}], got "
                             f"{None if scales is None else tuple(scales.shape)}")
    elif w.dtype != x.dtype:
        raise ValueError(f"dense rows must have x's dtype {x.dtype}, got {w.dtype}")
    elif scales is not None:
        raise ValueError("scales are for int8 rows only")
    _check_out(x, N, keep_ids, logits_out)


def _check_out(x, N: int, keep_ids, logits_out):
    """keep_ids [N] int64 and logits_out fp32 [M, V] (V = N without a keepset) as the kernels write them."""
    if keep_ids is not None and (keep_ids.dtype != torch.int64 or tuple(keep_ids.shape) != (N,)):
        raise ValueError(f"keep_ids must be int64 [N] = [{N}], got {keep_ids.dtype} {tuple(keep_ids.shape)}")
    if logits_out is not None:
        if logits_out.dtype != torch.float32 or logits_out.dim() != 2 or logits_out.shape[0] != x.shape[0]:
            raise ValueError(f"logits_out must be fp32 [M, V] with M = {x.shape[0]}, got "
                             f"{logits_out.dtype} {tuple(logits_out.shape)}")
        if keep_ids is None and logits_out.shape[1] != N:
            raise ValueError(f"full head: logits_out must have N = {N} columns, got {logits_out.shape[1]}")
        if logits_out.stride(1) != 1:
            raise ValueError("logits_out must be contiguous along the vocabulary")


def head_argmax(x, w, keep_ids=None, *, scales=None, logits_out=None, softcap: float | None = None,
                round_to_input: bool = True, want_ids: bool = True, config: HeadArgmaxConfig | None = None):
    """Triton: x [M, K] @ W[N, K]^T -> ids [M] int64 (vocabulary ids via keep_ids), and, when
    logits_out [M, V] fp32 is given, the softcapped logits stored at their ids. want_ids=False skips
    the argmax (a logits-only head) and returns None. No host sync."""
    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError("head_argmax runs on CUDA tensors (or with TRITON_INTERPRET=1); "
                           "use head_argmax_torch on the CPU")
    _check(x, w, scales, keep_ids, logits_out)
    M, K = x.shape
    N = w.shape[0]
    cfg = config or default_config(M, w.dtype == torch.int8)
    if cfg.block_m != 1 and (cfg.block_m < 16 or cfg.block_n < 16 or cfg.block_k < 16):
        raise ValueError(f"tl.dot tiles must be >= 16, got {cfg}")
    if w.stride(1) != 1:
        w = w.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    P = triton.cdiv(N, cfg.block_n)
    dev = x.device
    if want_ids:
        pmax = torch.empty(M, P, device=dev, dtype=torch.float32)
        pidx = torch.empty(M, P, device=dev, dtype=torch.int32)
    else:
        pmax = pidx = x  # unused pointers
    store = logits_out is not None
    # int8 rows as int32 words where every row starts 4-byte aligned
    words8 = (INT8_WORDS and w.dtype == torch.int8 and cfg.block_m == 1 and K % 4 == 0 and w.stride(0) % 4 == 0
              and w.data_ptr() % 4 == 0 and cfg.block_k % 4 == 0)
    grid = (P, triton.cdiv(M, cfg.block_m))
    _head_block_kernel[grid](
        x, w, scales if scales is not None else x, keep_ids if keep_ids is not None else x,
        pmax, pidx, logits_out if store else x,
        M, N, x.stride(0), w.stride(0), logits_out.stride(0) if store else 0, float(softcap or 1.0),
        K=K, NUM_P=P, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_SCALE=scales is not None, HAS_KEEP=keep_ids is not None, STORE_LOGITS=store, WANT_IDS=want_ids,
        SOFTCAP=bool(softcap), ROUND=bool(round_to_input), IEEE=x.dtype == torch.float32, WORDS8=words8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _reduce_ids(pmax, pidx, keep_ids, cfg.block_p) if want_ids else None


def _reduce_ids(pmax, pidx, keep_ids, block_p: int) -> torch.Tensor:
    """The blocks' partials [M, P] -> ids [M] int64 (`_argmax_reduce_kernel`, one program a row)."""
    M, P = pmax.shape
    ids = torch.empty(M, device=pmax.device, dtype=torch.int64)
    _argmax_reduce_kernel[(M,)](pmax, pidx, keep_ids if keep_ids is not None else ids, ids,
                                NUM_P=P, BLOCK_P=min(block_p, triton.next_power_of_2(P)),
                                HAS_KEEP=keep_ids is not None, num_warps=4)
    return ids


def head_argmax_int4(x, qweight, scales, zeros, group_size: int, keep_ids=None, *, logits_out=None,
                     softcap: float | None = None, want_ids: bool = True, config=None):
    """int4 rows (kernels/int4_pack.py: qweight uint8 [N, K/2], scales / zeros [K/G, N] in x's dtype) in two
    launches: kernels/w4a16.py's CUDA-core GEMV (`_gemv_kernel`, the one-row tiles of w4a16_table at these
    shapes, or `config`; K not split), whose store keeps each block's max and lowest row per x row instead of
    its outputs (and writes the softcapped logits at their ids when logits_out is given), then
    `_argmax_reduce_kernel`. The logits are the GEMV's outputs, rounded to x's dtype as `w4a16_matmul` rounds
    them, so the ids are argmax(w4a16_matmul(x, ...)) over the rows, mapped through keep_ids. Each x row is
    its own program: a row's pick does not depend on the rows beside it. -> ids [M] int64 (None with
    want_ids=False). No host sync."""
    import dataclasses

    from . import w4a16
    from .w4a16_table import resolve_config

    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError("head_argmax_int4 runs on CUDA tensors (or with TRITON_INTERPRET=1); "
                           "use w4a16_torch and argmax on the CPU")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be fp32 / fp16 / bf16, got {x.dtype}")
    M, N, K = w4a16.check_int4_operands(x, qweight, scales, zeros, group_size)
    if scales.dtype != x.dtype or zeros.dtype != x.dtype:
        raise ValueError(f"scales / zeros must have x's dtype {x.dtype}, got {scales.dtype} / {zeros.dtype}")
    _check_out(x, N, keep_ids, logits_out)
    cfg = resolve_config(1, N, K, group_size, config)
    if cfg.block_m != 1:
        raise ValueError(f"head_argmax_int4 runs the one-row GEMV: block_m 1, got {cfg}")
    if cfg.split_k != 1:  # the argmax store needs a block's whole sums
        cfg = resolve_config(1, N, K, group_size, dataclasses.replace(cfg, split_k=1))
    if x.stride(1) != 1:
        x = x.contiguous()
    P = triton.cdiv(N, cfg.block_n)
    dev = x.device
    pmax = torch.empty(M, P, device=dev, dtype=torch.float32)
    pidx = torch.empty(M, P, device=dev, dtype=torch.int32)
    store = logits_out is not None
    keep = keep_ids if keep_ids is not None else pidx  # unused pointer without a keepset
    w4a16._gemv_kernel[(P, 1, M)](
        x, qweight, scales, zeros, pmax, pmax, pmax, M, N, x.stride(0), qweight.stride(0), 0,
        K_SPLIT=K, SPLIT=1, FIXUP=False, GROUP=group_size, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        FACTORED=cfg.factored, WORDS=cfg.words and cfg.factored, ASM=not _INTERPRET, EXACT=x.dtype == torch.float32,
        ARGMAX=True, pmax_ptr=pmax, pidx_ptr=pidx, keep_ptr=keep, logit_ptr=logits_out if store else pmax,
        stride_lm=logits_out.stride(0) if store else 0, softcap=float(softcap or 1.0), NUM_P=P,
        HAS_KEEP=keep_ids is not None, STORE_LOGITS=store, WANT_IDS=want_ids, SOFTCAP=bool(softcap),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _reduce_ids(pmax, pidx, keep_ids, GEMV_CONFIG.block_p) if want_ids else None


# ---------------------------------------------------------------------------------------------
# torch twin


def head_raw_torch(x, w, scales=None, round_to_input: bool = True) -> torch.Tensor:
    """Pre-softcap logits fp32 [M, N], with the kernel's roundings (F.linear's output dtype)."""
    if w.dtype == torch.int8:
        y = F.linear(x, w.to(x.dtype)) if round_to_input else F.linear(x.float(), w.float())
        y = y.float() * scales.float()
    else:
        y = F.linear(x, w) if round_to_input else F.linear(x.float(), w.float())
    return y.to(x.dtype).float() if round_to_input else y.float()


def softcap_torch(y: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return torch.tanh(y / softcap) * softcap if softcap else y


def head_argmax_torch(x, w, keep_ids=None, *, scales=None, logits_out=None, softcap: float | None = None,
                      round_to_input: bool = True, want_ids: bool = True, config=None):
    """Torch twin of `head_argmax` (same arguments; `config` ignored)."""
    _check(x, w, scales, keep_ids, logits_out)
    raw = head_raw_torch(x, w, scales, round_to_input)  # [M, N]
    if logits_out is not None:
        y = softcap_torch(raw, softcap)
        if keep_ids is None:
            logits_out.copy_(y)
        else:
            logits_out.index_copy_(1, keep_ids, y)
    if not want_ids:
        return None
    idx = raw.argmax(-1)  # first maximum: the lowest row
    return keep_ids[idx] if keep_ids is not None else idx


# Registered as an opaque op so torch.compile traces around the launcher; logits_out is written in place.
@torch.library.custom_op("fastgemma::head_argmax", mutates_args=("logits_out",))
def head_argmax_op(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, keep_ids: torch.Tensor | None,
                   logits_out: torch.Tensor, softcap: float, round_to_input: bool,
                   row_invariant: bool = False) -> torch.Tensor:
    return head_argmax(x, w, keep_ids, scales=scales, logits_out=logits_out, softcap=softcap or None,
                       round_to_input=round_to_input, config=ROW_INVARIANT_CONFIG if row_invariant else None)


@head_argmax_op.register_fake
def _(x, w, scales, keep_ids, logits_out, softcap, round_to_input, row_invariant=False):
    return x.new_empty(x.shape[0], dtype=torch.int64)


# The int4 rows' pick as an opaque op (the decode path: ids and the logits at their ids).
@torch.library.custom_op("fastgemma::head_argmax_int4", mutates_args=("logits_out",))
def head_argmax_int4_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int, keep_ids: torch.Tensor | None, logits_out: torch.Tensor,
                        softcap: float) -> torch.Tensor:
    return head_argmax_int4(x, qweight, scales, zeros, group_size, keep_ids, logits_out=logits_out,
                            softcap=softcap or None)


@head_argmax_int4_op.register_fake
def _(x, qweight, scales, zeros, group_size, keep_ids, logits_out, softcap):
    return x.new_empty(x.shape[0], dtype=torch.int64)
