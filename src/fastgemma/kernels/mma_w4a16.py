"""W4A16 GEMV / skinny GEMM for 1..8 rows on the tensor cores: int4 codes in the mma fragment order.

The one-row int4 GEMVs on CUDA cores (kernels/w4a16.py, kernels/fused_w4a16.py) spend 5.7-18
instructions per weight (Nsight Compute, run CE) and reach 10-33% of the H200's bandwidth. Here a
warp feeds 16 weight rows x 16 k to one `mma.sync.m16n8k16` (bf16, fp32 accumulate) as the A
operand and up to 8 activation rows as B: per 8 weights a lane does 3 shifts and 4 LOP3 (each LOP3
makes two bf16 values 128 + q from two nibbles: `(w >> 4j) & 0x000F000F | 0x43004300`) and one
mma, about one instruction per weight. The activation rows are the B columns, so the same kernel
serves the AR step (1 row) and the verify pass (k + 1 <= 8 rows).

The mma's k slots need not be consecutive k: any order shared by A and B gives the same sum. Per
64-k block, lane l = g*4 + tq takes k = tq*16 + j*4 + kh*2 + p into slot kh*8 + tq*2 + p of k step
j, so its B registers for the block's 4 steps are 16 consecutive x (two 16-byte loads of the row
g) and its A values for them are one 16-byte load of 4 words (`pack_mma`; nibble m = p*4 + kh*2 +
h of word j holds row g + 8h; a warp reads 512 contiguous bytes). Per group of G k (64 or 128):
P = sum (128 + q) x by the tile's mmas, sum x by one more mma per k step with A = 1, then
out += s P + (z - 128 s) sum x, the factored form of sum (q s + z) x, in fp32.

A program holds T tiles of 16 rows; its W warps split K (each K / W, a multiple of G) and their
partials are summed at the end. The first `depth` groups of weight words are loaded before the PDL
wait, each later one `depth` groups ahead of its use. Epilogues: none, or GeGLU (T = 2: a gate tile
and its up tile; gelu_tanh(gate) * up, rounded as the eager layer rounds).

Under TRITON_INTERPRET=1 the two mma blocks run as Triton tensor code with the same fragment maps
(`_mma_emulated`), so the kernel's indexing is tested on the CPU; tests/ptx_lite.py runs the PTX
text itself, warp-wide. `mma_w4a16` launches, `mma_w4a16_op` is the opaque op, `mma_w4a16_ref` the
twin (dequantize to the activation dtype, F.linear, the epilogue).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .attn_fold import _col_sum, _part_group_ptrs, _part_weights, _part_x_ptrs
from .counters import arrival_counters
from .fused_gemv import _gelu_tanh, _layer_scale, _rnd
from .gemv import _INTERPRET, _pdl_trigger, _pdl_wait, pdl_args
from .int4_pack import dequantize_int4, pack_scale_zero
from .mma_table import MAX_ROWS, MmaConfig, config_problem, default_mma_config, format_config, mma_config
from .norm_fold import (_fold_parts, _fold_res, _fold_scalars, _fold_store, _fold_weights, _h_inputs, _h_post,
                        _h_store, _norm_combine)

MMA_GROUPS = (64, 128)  # a group spans whole 64-k word blocks
EPILOGUES = {"none": 0, "geglu": 1}

_MAGIC = "0x43004300"  # two bf16 128.0s; a nibble in the low 4 mantissa bits makes 128 + q
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def _tile_asm() -> str:
    """Four k steps of one tile: words $4..$7, B registers $8..$15 (two per step, as a lane loads
    them), accumulator in $16..$19, out $0..$3."""
    lines = ["{", ".reg .b32 a0, a1, a2, a3, t;"]
    for j in range(4):
        w, c = f"${4 + j}", ("{$16, $17, $18, $19}" if j == 0 else "{$0, $1, $2, $3}")
        lines.append(f"lop3.b32 a0, {w}, 0x000F000F, {_MAGIC}, 0xEA;")
        for r in (1, 2, 3):
            lines.append(f"shr.b32 t, {w}, {4 * r};")
            lines.append(f"lop3.b32 a{r}, t, 0x000F000F, {_MAGIC}, 0xEA;")
        lines.append(f"{_MMA} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{${8 + 2 * j}, ${9 + 2 * j}}}, {c};")
    return "\n".join(lines + ["}"])


def _ones_asm() -> str:
    """Four k steps of sum x: A = 1.0 everywhere; B $4..$11 (two per step), accumulator $12..$15."""
    lines = ["{", ".reg .b32 one;", "mov.b32 one, 0x3F803F80;"]
    for j in range(4):
        c = "{$12, $13, $14, $15}" if j == 0 else "{$0, $1, $2, $3}"
        lines.append(f"{_MMA} {{$0, $1, $2, $3}}, {{one, one, one, one}}, {{${4 + 2 * j}, ${5 + 2 * j}}}, {c};")
    return "\n".join(lines + ["}"])


TILE_ASM = tl.constexpr(_tile_asm())
ONES_ASM = tl.constexpr(_ones_asm())


# ---------------------------------------------------------------------------------------------
# packing (torch)


def check_mma_shape(N: int, K: int, group_size: int) -> None:
    if group_size not in MMA_GROUPS:
        raise ValueError(f"mma_w4a16 needs group_size in {MMA_GROUPS}, got {group_size}")
    if N % 16 or K % group_size:
        raise ValueError(f"mma_w4a16 needs N % 16 == 0 and K % group_size == 0, got N={N}, K={K}, "
                         f"group_size={group_size}")


def pair_order(N: int, device=None) -> torch.Tensor:
    """The rows of a GeGLU weight [gate (N/2 rows); up (N/2 rows)] in the paired layout: tile i holds gate
    rows 8i .. 8i + 7 as its rows 0-7 and the up rows of the same outputs as its rows 8-15, so one mma's
    accumulator holds an output's gate and up in one lane (MmaConfig.pairs)."""
    if N % 16:
        raise ValueError(f"the paired GeGLU layout needs N % 16 == 0, got N={N}")
    i = torch.arange(N // 2, device=device).reshape(-1, 1, 8)
    return torch.cat([i, i + N // 2], dim=1).reshape(-1)


def pack_mma(q: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """Codes q [N, K] (0..15) -> int32 words [N/16, K/64, 32, 4] in the mma fragment order (pairs: the
    rows in `pair_order` first)."""
    N, K = q.shape
    if N % 16 or K % 64:
        raise ValueError(f"pack_mma needs N % 16 == 0 and K % 64 == 0, got {tuple(q.shape)}")
    if pairs:
        q = q[pair_order(N, q.device)]
    # row = tile*16 + h*8 + g; k = block*64 + tq*16 + j*4 + kh*2 + p; lane = g*4 + tq; nibble p*4 + kh*2 + h
    v = q.to(torch.int32).reshape(N // 16, 2, 8, K // 64, 4, 4, 2, 2)  # tile, h, g, block, tq, j, kh, p
    v = v.permute(0, 3, 2, 4, 5, 7, 6, 1).reshape(N // 16, K // 64, 32, 4, 8)  # tile, block, lane, j, m
    return (v << (4 * torch.arange(8, dtype=torch.int32, device=q.device))).sum(-1, dtype=torch.int32)


def unpack_mma(words: torch.Tensor) -> torch.Tensor:
    """pack_mma's inverse: words [N/16, K/64, 32, 4] -> codes [N, K] uint8."""
    NT, KB = words.shape[:2]
    v = (words[..., None] >> (4 * torch.arange(8, dtype=torch.int32, device=words.device))) & 0xF
    v = v.reshape(NT, KB, 8, 4, 4, 2, 2, 2).permute(0, 7, 2, 1, 3, 4, 6, 5)  # tile, h, g, block, tq, j, kh, p
    return v.reshape(NT * 16, KB * 64).to(torch.uint8)


def pack_mma_sz(sz: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """Packed scale / zero words [K/G, N] (w4a16.pack_scale_zero) -> [N/16, K/G, 8, 2]: a lane g*4 + tq
    reads the words of its two rows g and g + 8 with one 8-byte load (pairs: as `pack_mma`'s)."""
    NG, N = sz.shape
    if pairs:
        sz = sz[:, pair_order(N, sz.device)]
    return sz.reshape(NG, N // 16, 2, 8).permute(1, 0, 3, 2).contiguous()


@dataclass
class MmaWeight:
    """One int4 linear in the fragment order: words [N/16, K/64, 32, 4] and scale / zero words
    [N/16, K/G, 8, 2] (bf16 pairs, `pack_mma_sz`); pairs: its rows in the paired GeGLU layout."""
    words: torch.Tensor
    sz: torch.Tensor
    N: int
    K: int
    group_size: int
    pairs: bool = False

    @classmethod
    def from_codes(cls, q, scales, zeros, group_size: int, pairs: bool = False) -> "MmaWeight":
        """pairs: a GeGLU weight in the paired layout (`pair_order`), for configs with `pairs`."""
        N, K = q.shape
        check_mma_shape(N, K, group_size)
        if scales.dtype != torch.bfloat16:
            raise ValueError(f"mma_w4a16 reads bf16 scales / zeros, got {scales.dtype}")
        return cls(pack_mma(q, pairs), pack_mma_sz(pack_scale_zero(scales, zeros), pairs), N, K, group_size, pairs)


# ---------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _bf16_pairs(v):
    """int32 words -> (low half, high half) as fp32 values of the two bf16s."""
    return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _mma_emulated(w, xa, xb, c, ONES: tl.constexpr):
    """The interpreter's twin of TILE_ASM / ONES_ASM over whole [R, 4] tensors (row r = warp slot
    r // 32, lane r % 32): lanes are an axis, so the warp-wide fragment maps become reshapes
    (A[g + 8h, kh*8 + tq*2 + p] of step j is nibble p*4 + kh*2 + h of lane g*4 + tq's word j;
    B[kh*8 + tq*2 + p, g] of step j is half p of the lane's x word 2j + kh: xa holds words 0-3, xb 4-7)."""
    S: tl.constexpr = w.shape[0] // 32
    xw = tl.join(xa, xb)  # [R, 4 (i: jl*2 + kh), 2 (j // 2)]
    lo, hi = _bf16_pairs(xw)
    xv = tl.reshape(tl.join(lo, hi), (S, 8, 4, 2, 2, 2, 2))  # S, g, tq, jl, kh, jh, p
    B = tl.reshape(tl.permute(xv, (0, 5, 3, 4, 2, 6, 1)), (S, 4, 1, 16, 8))  # [S, j, 1 (row), k, n]
    if ONES:
        A = tl.full((S, 4, 16, 16, 1), 1.0, tl.float32)
    else:
        nib = tl.join(tl.join(tl.join(w & 15, (w >> 4) & 15), tl.join((w >> 8) & 15, (w >> 12) & 15)),
                      tl.join(tl.join((w >> 16) & 15, (w >> 20) & 15), tl.join((w >> 24) & 15, (w >> 28) & 15)))
        # join nests the new axis innermost: nibble m = 4 m2 + 2 m1 + m0 sits at [.., m0, m1, m2]
        nib = tl.reshape(nib, (S, 8, 4, 4, 2, 2, 2))  # S, g, tq, j, m0=h, m1=kh, m2=p
        A = tl.permute(nib, (0, 3, 4, 1, 5, 2, 6))  # S, j, h, g, kh, tq, p
        A = tl.reshape(A, (S, 4, 16, 16, 1)).to(tl.float32) + 128.0  # [S, j, row, k, 1]
    D = tl.sum(tl.sum(A * B, axis=3), axis=1)  # [S, 16 rows, 8 cols]
    D = tl.permute(tl.reshape(D, (S, 2, 8, 4, 2)), (0, 2, 3, 1, 4))  # S, g, tq, h, p2
    return c + tl.reshape(D, (S * 32, 4))  # lane g*4 + tq, element h*2 + p2


@triton.jit
def _tile_mma(w, xa, xb, c, EMU: tl.constexpr):
    if EMU:
        return _mma_emulated(w, xa, xb, c, False)
    return tl.inline_asm_elementwise(TILE_ASM, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r,r,r,f,f,f,f",
                                     [w, xa, xb, c], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _ones_mma(xa, xb, c, EMU: tl.constexpr):
    if EMU:
        return _mma_emulated(xa, xa, xb, c, True)
    return tl.inline_asm_elementwise(ONES_ASM, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,f,f,f,f",
                                     [xa, xb, c], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _group_loads(w_ptrs, sz_ptrs, g, ok, BG: tl.constexpr, R: tl.constexpr):
    """Group g's BG word blocks [R, 4], then its scale / zero words spread to [R, 4] (element c:
    row g + 8 (c // 2) of the lane's pair); nothing read where not ok (a tile past the last)."""
    grp = ()
    for i in tl.static_range(BG):
        grp = grp + (tl.load(w_ptrs + (g * BG + i) * 128, mask=ok, other=0),)
    v = tl.load(sz_ptrs + g * 16, mask=ok, other=0)
    return grp + (tl.reshape(tl.join(v, v), (R, 4)),)


@triton.jit
def _tile_ptrs(it, sp, w_ptr, sz_ptr, HALF, r, oj, K: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr,
               W: tl.constexpr, S: tl.constexpr, EPI: tl.constexpr):
    """Program tile `it`'s word and scale / zero pointers in K split `sp` of S. [R, 4] tensors: row r
    is lane r % 32 of (K slice, tile) (r // 32) // T, (r // 32) % T; a lane's 4 words are one 16-byte
    load, so the words' layout puts lanes on rows and the 4 in one thread."""
    lane = r % 32
    ow = sp * W + (r // 32) // T  # the warp's K slice of W * S
    ot = (r // 32) % T
    if EPI == 1:  # the gate tile and its up tile
        tile = it + ot * (HALF // 16)
    else:
        tile = it * T + ot
    w_ptrs = w_ptr + ((tile * (K // 64) + ow * (K // (W * S) // 64)) * 32 + lane) * 4 + oj
    # a lane's scale / zero words for rows g and g + 8: [R, 2], spread to its 4 accumulator elements
    NG: tl.constexpr = K // (W * S) // GROUP
    sz_ptrs = sz_ptr + ((tile * (K // GROUP) + ow * NG) * 8 + lane // 4) * 2 + tl.arange(0, 2)[None, :]
    return w_ptrs, sz_ptrs


@triton.jit
def _first_loads(w_ptrs, sz_ptrs, ok, NG: tl.constexpr, DEPTH: tl.constexpr, BG: tl.constexpr, R: tl.constexpr):
    """words[g] for the first DEPTH groups (the others empty, loaded in `_tile_y`)."""
    words = ()  # words[g]: group g's word blocks and scale / zero words (the interpreter cannot index by a sum)
    for g in tl.static_range(NG):
        grp = ()
        if g < DEPTH:
            grp = _group_loads(w_ptrs, sz_ptrs, g, ok, BG, R)
        words = words + (grp,)
    return words


@triton.jit
def _group_acc(acc, grp, xg, BG: tl.constexpr, R: tl.constexpr, FRESH: tl.constexpr, EMU: tl.constexpr,
               wsel, WEIGH: tl.constexpr):
    """acc + a group's sums from its words `grp` (BG word blocks, then the scale / zero words) and its x
    words from xg (the group's first block): P = sum (128 + q) x and sum x by the mmas, then s P +
    (z - 128 s) sum x (WEIGH: times wsel, kernels/attn_fold.py's weights). FRESH: each 64-k block's mmas
    start from zero and are added after (chains of 4 dependent mmas instead of one through the group)."""
    p = tl.zeros((R, 4), dtype=tl.float32)
    xs = tl.zeros((R, 4), dtype=tl.float32)
    for i in tl.static_range(BG):
        xa = tl.load(xg + i * 32)
        xb = tl.load(xg + i * 32 + 4)
        if FRESH:
            xs += _ones_mma(xa, xb, tl.zeros((R, 4), dtype=tl.float32), EMU)
            p += _tile_mma(grp[i], xa, xb, tl.zeros((R, 4), dtype=tl.float32), EMU)
        else:
            xs = _ones_mma(xa, xb, xs, EMU)
            p = _tile_mma(grp[i], xa, xb, p, EMU)
    s, z = _bf16_pairs(grp[BG])
    if WEIGH:
        return acc + wsel * (s * p + (z - 128.0 * s) * xs)
    return acc + (s * p + (z - 128.0 * s) * xs)


@triton.jit
def _x_ptrs(x_ptr, r, oj, sp, M, stride_xm, K: tl.constexpr, T: tl.constexpr, W: tl.constexpr, S: tl.constexpr):
    """The B operand's x words [R, 4]: lane g*4 + tq takes 16 consecutive x of row g per 64-k block of
    its warp's K slice in split sp (rows past M read row M - 1; their columns are not stored): words
    tq*8 + 0..3 (xa) and + 4..7 (xb)."""
    lane = r % 32
    return (x_ptr.to(tl.pointer_type(tl.int32)) + tl.minimum(lane // 4, M - 1) * (stride_xm // 2)
            + (sp * W + (r // 32) // T) * (K // (W * S) // 2) + (lane % 4) * 8 + oj)


@triton.jit
def _tile_y(words, w_ptrs, sz_ptrs, x_ptrs, NG: tl.constexpr, DEPTH: tl.constexpr, BG: tl.constexpr,
            R: tl.constexpr, W: tl.constexpr, T: tl.constexpr, EMU: tl.constexpr):
    """One program tile's sums [T*32, 4] (the warps' K slices added), loading each group's words
    DEPTH groups ahead of its use."""
    acc = tl.zeros((R, 4), dtype=tl.float32)
    for g in tl.static_range(NG):
        if g + DEPTH < NG:  # the loads DEPTH groups ahead
            grp = _group_loads(w_ptrs, sz_ptrs, g + DEPTH, True, BG, R)
            ahead = ()
            for k in tl.static_range(NG):
                if k == g + DEPTH:
                    ahead = ahead + (grp,)
                else:
                    ahead = ahead + (words[k],)
            words = ahead
        acc = _group_acc(acc, words[g], x_ptrs + g * BG * 32, BG, R, False, EMU, 1.0, False)
    return tl.sum(tl.reshape(acc, (W, T * 32, 4)), axis=0)


@triton.jit
def _tile_store(y, it, ok, out_ptr, M, stride_om, T: tl.constexpr, EPI: tl.constexpr):
    """Program tile `it`'s outputs (GeGLU: gelu_tanh(gate) * up, rounded as the eager layer rounds; EPI 2:
    each tile's rows 0-7 the gate and 8-15 the up of 8 outputs, a lane's elements 0, 1 and 2, 3)."""
    DT: tl.constexpr = out_ptr.dtype.element_ty
    if EPI == 2:
        gate, up = tl.split(tl.permute(tl.reshape(y, (T * 32, 2, 2)), (0, 2, 1)))  # [T*32, 2] each
        rt = tl.arange(0, T * 32)[:, None]
        c2 = tl.arange(0, 2)[None, :]
        m = (rt % 32 % 4) * 2 + c2
        rows = (it * T + rt // 32) * 8 + rt % 32 // 4
        out = _rnd(_gelu_tanh(_rnd(gate, DT)), DT) * _rnd(up, DT)
        tl.store(out_ptr + m * stride_om + rows, out.to(DT), mask=(m < M) & ok)
    elif EPI == 1:
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, 32, 4)), (1, 2, 0)))  # [32, 4] each
        l2 = tl.arange(0, 32)[:, None]
        c2 = tl.arange(0, 4)[None, :]
        m = (l2 % 4) * 2 + c2 % 2  # the B column = the x row
        rows = it * 16 + l2 // 4 + 8 * (c2 // 2)
        out = _rnd(_gelu_tanh(_rnd(gate, DT)), DT) * _rnd(up, DT)
        tl.store(out_ptr + m * stride_om + rows, out.to(DT), mask=(m < M) & ok)
    else:
        rt = tl.arange(0, T * 32)[:, None]
        c2 = tl.arange(0, 4)[None, :]
        m = (rt % 32 % 4) * 2 + c2 % 2
        rows = (it * T + rt // 32) * 16 + rt % 32 // 4 + 8 * (c2 // 2)
        tl.store(out_ptr + m * stride_om + rows, y.to(DT), mask=(m < M) & ok)


@triton.jit
def _split_fixup(y, it, sp, ws_ptr, cnt_ptr, out_ptr, M, stride_om, T: tl.constexpr, S: tl.constexpr,
                 EPI: tl.constexpr):
    """K split sp's sums y of program tile `it` -> ws [tiles, S, T*32, 4] fp32; the tile's last program
    to arrive (its counter, acq_rel at GPU scope, after a barrier so every thread's part is written)
    adds the S partials in split order, so the sum does not depend on which program came last,
    stores it through the epilogue and zeroes the counter for the next launch."""
    rt = tl.arange(0, T * 32)[:, None]
    c2 = tl.arange(0, 4)[None, :]
    ws_ptrs = ws_ptr + it * (S * T * 128) + rt * 4 + c2
    tl.store(ws_ptrs + sp * (T * 128), y)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + it, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        tot = tl.zeros_like(y)
        for s in tl.static_range(S):  # .cg: from L2, where the other programs' partials are
            tot += tl.load(ws_ptrs + s * (T * 128), cache_modifier=".cg")
        _tile_store(tot, it, True, out_ptr, M, stride_om, T, EPI)
        tl.store(cnt_ptr + it, 0)


@triton.jit
def _mma_w4a16_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, HALF, stride_xm, stride_om, NPT,
                      f_res, f_post, f_pre, f_rows, f_parts, off,
                      K: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, W: tl.constexpr, EPI: tl.constexpr,
                      DEPTH: tl.constexpr, ITERS: tl.constexpr, S: tl.constexpr, PDL: tl.constexpr,
                      EMU: tl.constexpr, FOLD: tl.constexpr = 0):
    """Program p takes program tiles p, p + P, ... (ITERS of them, P programs; NPT tiles in all), the
    next one's words loaded before the current one is summed (ITERS > 1 loads whole tiles). S > 1
    (ITERS 1): programs p*S .. p*S + S - 1 each take 1/S of tile p's K, `_split_fixup` adds them.
    FOLD 1 (S 1, one row): the producer's store of kernels/norm_fold.py (the f_ arguments)."""
    _pdl_trigger(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if S > 1:
        it0 = pid // S
        sp = pid % S
    else:
        it0 = pid
        sp = 0
    BG: tl.constexpr = GROUP // 64  # word blocks per group
    NG: tl.constexpr = K // (W * S) // GROUP  # groups per warp slice
    R: tl.constexpr = W * T * 32
    r = tl.arange(0, R)[:, None]
    oj = tl.arange(0, 4)[None, :]  # a lane's word j; as an accumulator index, element c
    w_ptrs, sz_ptrs = _tile_ptrs(it0, sp, w_ptr, sz_ptr, HALF, r, oj, K, GROUP, T, W, S, EPI)
    words = _first_loads(w_ptrs, sz_ptrs, True, NG, DEPTH, BG, R)
    _pdl_wait(PDL)
    x_ptrs = _x_ptrs(x_ptr, r, oj, sp, M, stride_xm, K, T, W, S)
    for j in tl.static_range(ITERS):
        it = it0 + j * nprog
        if j + 1 < ITERS:  # the next tile's words, in flight while this one is summed
            nw_ptrs, nsz_ptrs = _tile_ptrs(it + nprog, sp, w_ptr, sz_ptr, HALF, r, oj, K, GROUP, T, W, S, EPI)
            nxt = _first_loads(nw_ptrs, nsz_ptrs, it + nprog < NPT, NG, NG, BG, R)
        if FOLD == 1:
            fpw, fp = _fold_weights(it, it < NPT, f_post, f_pre, T)
            fa = _fold_res(it, it < NPT, f_res, T)
        y = _tile_y(words, w_ptrs, sz_ptrs, x_ptrs, NG, DEPTH, BG, R, W, T, EMU)
        if FOLD == 1:
            _fold_store(y, it, it < NPT, out_ptr, fa, fpw, fp, f_rows, f_parts, N, off, T)
        elif S > 1:
            _split_fixup(y, it, sp, ws_ptr, cnt_ptr, out_ptr, M, stride_om, T, S, EPI)
        else:
            _tile_store(y, it, it < NPT, out_ptr, M, stride_om, T, EPI)
        if j + 1 < ITERS:
            words, w_ptrs, sz_ptrs = nxt, nw_ptrs, nsz_ptrs


@triton.jit
def _mma_stream_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, M, N, HALF, stride_xm, stride_om, NPT, NITER,
                       f_res, f_y, f_post, f_pre, f_scale, f_rows, f_parts, f_h, eps, off, lse_ptr,
                       K: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, W: tl.constexpr, EPI: tl.constexpr,
                       DEPTH: tl.constexpr, FRESH: tl.constexpr, PDL: tl.constexpr, EMU: tl.constexpr,
                       FOLD: tl.constexpr = 0, NPART: tl.constexpr = 1, NP2: tl.constexpr = 1,
                       HAS_SCALE: tl.constexpr = False, HB: tl.constexpr = 128, ONE: tl.constexpr = False,
                       NS: tl.constexpr = 0, PG: tl.constexpr = 1, PD: tl.constexpr = 1):
    """Persistent: program p sums program tiles p, p + P, ... (P programs, a few per SM; NITER each, the
    ones past the last tile masked) as one stream of weight groups per warp, DEPTH groups in flight
    at every step, across tile boundaries: the source loads the next tile's first groups while the
    current tile's last ones are summed. (In the sm_90a code ptxas places those loads after the
    tile's last mma, so each tile still waits a round trip: docs/results.md, runs GC-GF; at E4B's
    shapes the table's entries have one tile per program.) FRESH: see `_group_acc`. FOLD
    (kernels/norm_fold.py, one output row, the f_ arguments): 1 the producer's store; 2 the consumer:
    x holds the two rows, the producer's NPART partials are read after the wait and added in tile
    order, the store combines the two columns, programs < K / HB write h. ONE
    (NITER 1: one tile per program): no loads of a next tile (fewer registers held into the store).
    NS > 0 (one output row): x is an attention's NS split partials [Hkv, NS, PG, PD] (bf16) with their
    lse at lse_ptr, the combine folded in (kernels/attn_fold.py)."""
    _pdl_trigger(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    BG: tl.constexpr = GROUP // 64
    R: tl.constexpr = W * T * 32
    r = tl.arange(0, R)[:, None]
    oj = tl.arange(0, 4)[None, :]
    w_ptrs, sz_ptrs = _tile_ptrs(pid, 0, w_ptr, sz_ptr, HALF, r, oj, K, GROUP, T, W, 1, EPI)
    buf = ()  # the DEPTH groups in flight, oldest first
    for d in tl.static_range(DEPTH):
        buf = buf + (_group_loads(w_ptrs, sz_ptrs, d, True, BG, R),)
    fin = (0.0, 0.0, 0.0)  # FOLD 1, ONE: the producer tile's a, post, pre; FOLD 2: h's a, y, post; loaded early
    fs = 1.0  # FOLD 2: the layer scalar
    if (FOLD == 1) and ONE:
        fpw, fp = _fold_weights(pid, pid < NPT, f_post, f_pre, T)
    if FOLD == 2:  # parameters: before the wait
        fpost = _h_post(f_post, pid, K, HB)
        fs = _layer_scale(f_scale, HAS_SCALE)
    _pdl_wait(PDL)
    pv = 0.0
    if FOLD == 2:
        pv = _fold_parts(f_parts, NPART, NP2)
        fin = _h_inputs(f_res, f_y, pid, K, HB) + (fpost,)
    if (FOLD == 1) and ONE:
        fin = (_fold_res(pid, pid < NPT, f_res, T), fpw, fp)
    if NS > 0:
        x_ptrs = _part_x_ptrs(x_ptr, r, oj, NS, PG, PD)
    else:
        x_ptrs = _x_ptrs(x_ptr, r, oj, 0, M, stride_xm, K, T, W, 1)
    if ONE:
        _stream_tile(0, pid, nprog, buf, w_ptrs, sz_ptrs, x_ptrs, pv, fin, fs, w_ptr, sz_ptr, out_ptr, M, N, HALF,
                     stride_om, NPT, f_res, f_y, f_post, f_pre, f_scale, f_rows, f_parts, f_h, eps, off, lse_ptr, r,
                     oj, K, GROUP, T, W, EPI, DEPTH, FRESH, EMU, FOLD, HAS_SCALE, HB, ONE, NS, PG, PD)
    else:
        for j in range(0, NITER):
            buf, w_ptrs, sz_ptrs = _stream_tile(j, pid, nprog, buf, w_ptrs, sz_ptrs, x_ptrs, pv, fin, fs, w_ptr, sz_ptr,
                                                out_ptr, M, N, HALF, stride_om, NPT, f_res, f_y, f_post, f_pre,
                                                f_scale, f_rows, f_parts, f_h, eps, off, lse_ptr, r, oj, K, GROUP, T,
                                                W, EPI, DEPTH, FRESH, EMU, FOLD, HAS_SCALE, HB, ONE, NS, PG, PD)


@triton.jit
def _stream_tile(j, pid, nprog, buf, w_ptrs, sz_ptrs, x_ptrs, pv, fin, fs, w_ptr, sz_ptr, out_ptr, M, N, HALF,
                 stride_om, NPT, f_res, f_y, f_post, f_pre, f_scale, f_rows, f_parts, f_h, eps, off, lse_ptr, r, oj,
                 K: tl.constexpr, GROUP: tl.constexpr, T: tl.constexpr, W: tl.constexpr, EPI: tl.constexpr,
                 DEPTH: tl.constexpr, FRESH: tl.constexpr, EMU: tl.constexpr, FOLD: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HB: tl.constexpr, ONE: tl.constexpr, NS: tl.constexpr, PG: tl.constexpr,
                 PD: tl.constexpr):
    """`_mma_stream_kernel`'s step j: program tile pid + j * nprog from the groups in flight `buf`,
    the next tile's first ones loaded as this one's are used (none with ONE) -> (buf, the next tile's
    word and scale / zero pointers)."""
    BG: tl.constexpr = GROUP // 64
    NG: tl.constexpr = K // W // GROUP
    R: tl.constexpr = W * T * 32
    it = pid + j * nprog
    nw_ptrs, nsz_ptrs = _tile_ptrs(it + nprog, 0, w_ptr, sz_ptr, HALF, r, oj, K, GROUP, T, W, 1, EPI)
    more = it + nprog < NPT
    acc = tl.zeros((R, 4), dtype=tl.float32)
    for g in tl.static_range(NG):
        cur = buf[0]
        nbuf = ()
        for d in tl.static_range(1, len(buf)):
            nbuf = nbuf + (buf[d],)
        if g + DEPTH < NG:  # (none past the last tile: a program's last NITER step may have none)
            buf = nbuf + (_group_loads(w_ptrs, sz_ptrs, g + DEPTH, it < NPT, BG, R),)
        elif ONE:
            buf = nbuf
        else:  # the next tile's group g + DEPTH - NG (none after the last tile)
            buf = nbuf + (_group_loads(nw_ptrs, nsz_ptrs, g + DEPTH - NG, more, BG, R),)
        if NS > 0:  # the splits' sums weighed by their head's combine weights (recomputed per head)
            if ((K // W) % PD != 0) or ((g * GROUP) % PD == 0):
                wsel = _part_weights(lse_ptr, r, oj, g, NS, K, GROUP, T, W, PG, PD)
            acc = _group_acc(acc, cur, _part_group_ptrs(x_ptrs, r, g, NS, K, GROUP, T, W, PG, PD), BG, R, FRESH, EMU,
                             wsel, True)
        else:
            acc = _group_acc(acc, cur, x_ptrs + g * BG * 32, BG, R, FRESH, EMU, 1.0, False)
    y = tl.sum(tl.reshape(acc, (W, T * 32, 4)), axis=0)
    if NS > 0:
        y = _col_sum(y, T)
    if FOLD == 1:
        if ONE:  # loaded before the main loop (before the PDL wait for the weights)
            fa, fpw, fp = fin
        else:
            fpw, fp = _fold_weights(it, it < NPT, f_post, f_pre, T)
            fa = _fold_res(it, it < NPT, f_res, T)
        _fold_store(y, it, it < NPT, out_ptr, fa, fpw, fp, f_rows, f_parts, N, off, T)
    elif FOLD == 2:
        r1, r2s = _fold_scalars(pv, fs, eps, K)
        _tile_store(_norm_combine(y, r1, r2s, T * 32), it, it < NPT, out_ptr, 1, stride_om, T, EPI)
        if (j == 0) & (pid * HB < K):
            _h_store((fin[0], fin[1]), fin[2], r1, fs, f_h, off, pid, K, HB, HAS_SCALE)
    else:
        _tile_store(y, it, it < NPT, out_ptr, M, stride_om, T, EPI)
    return buf, nw_ptrs, nsz_ptrs


# ---------------------------------------------------------------------------------------------
# launch, twin, op


def layout_problem(weight: MmaWeight, cfg: MmaConfig) -> str | None:
    """Why cfg cannot read weight's words (the paired GeGLU layout on one side only), or None."""
    if weight.pairs != cfg.pairs:
        return (f"the config {format_config(cfg)} reads the {'paired' if cfg.pairs else 'natural'} layout, the "
                f"weight holds the {'paired' if weight.pairs else 'natural'} one (MmaWeight.from_codes(pairs=))")
    return None


def kernel_epilogue(epilogue: str, cfg: MmaConfig) -> int:
    """The kernels' EPI for `epilogue` under cfg: 0 none, 1 GeGLU on a gate tile and its up tile, 2 GeGLU
    on paired tiles (cfg.pairs)."""
    return 2 if cfg.pairs and epilogue == "geglu" else EPILOGUES[epilogue]


def program_tiles(N: int, cfg: MmaConfig, epi: int) -> int:
    """The launch's program tiles: a gate / up tile pair each (EPI 1), else `tiles` 16-row tiles each."""
    return (N // 2) // 16 if epi == 1 else N // 16 // cfg.tiles


def _check_x(x: torch.Tensor, K: int) -> None:
    if x.dim() != 2 or x.shape[1] != K or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"mma_w4a16 takes x [M, K={K}] with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        raise ValueError("mma_w4a16 needs a bf16 x, contiguous along K, rows 4-byte aligned")


def mma_w4a16(x: torch.Tensor, weight: MmaWeight, epilogue: str = "none", config: MmaConfig | None = None,
              pdl: bool = False) -> torch.Tensor:
    """x [M, K] bf16 (M <= 8) @ W^T -> [M, N] (geglu: [M, N/2]) bf16; with cfg.pairs the weight's words
    are in the paired layout (`MmaWeight.from_codes(..., pairs=True)`), the output in the natural order."""
    N, K, G = weight.N, weight.K, weight.group_size
    _check_x(x, K)
    if epilogue not in EPILOGUES:
        raise ValueError(f"mma_w4a16 epilogue must be one of {sorted(EPILOGUES)}, got {epilogue!r}")
    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError("mma_w4a16 runs on CUDA tensors (or with TRITON_INTERPRET=1); use mma_w4a16_ref")
    cfg = config or mma_config(N, K, x.shape[0], epilogue) or default_mma_config(N, K, G, epilogue)
    problem = config_problem(cfg, N, K, G, epilogue) or layout_problem(weight, cfg)
    if problem:
        raise ValueError(f"mma_w4a16: {problem}")
    if cfg.cuda:
        from .cuda_gemm import cuda_gemm

        return cuda_gemm(x, weight.words, weight.sz, N, cfg.warps, cfg.depth, cfg.splits, epilogue, pdl)
    epi = kernel_epilogue(epilogue, cfg)
    M, S = x.shape[0], cfg.splits
    out = torch.empty(M, N // 2 if epi else N, device=x.device, dtype=x.dtype)
    n_tiles = program_tiles(N, cfg, epi)
    if S > 1:  # partials [tiles, S, T*32, 4] fp32 and one arrival counter per program tile
        ws = torch.empty(n_tiles * S * cfg.tiles * 128, device=x.device, dtype=torch.float32)
        cnt = arrival_counters(x.device, n_tiles, "mma_w4a16 split-K")
    else:
        ws = cnt = out
    if cfg.persist:
        grid = (persistent_programs(n_tiles, cfg.persist, x.device),)
        niter = triton.cdiv(n_tiles, grid[0])
        _mma_stream_kernel[grid](x, weight.words, weight.sz, out, M, N, N // 2, x.stride(0), out.stride(0), n_tiles,
                                 niter, *([x] * 8), 0.0, 0.0, x,
                                 K=K, GROUP=G, T=cfg.tiles, W=cfg.warps, EPI=epi,
                                 DEPTH=min(cfg.depth, K // cfg.warps // G), FRESH=cfg.fresh, EMU=_INTERPRET,
                                 ONE=niter == 1, **cfg.launch, **pdl_args(pdl, x.device))
        return out
    grid = (triton.cdiv(n_tiles, cfg.iters) * S,)
    _mma_w4a16_kernel[grid](x, weight.words, weight.sz, out, ws, cnt, M, N, N // 2, x.stride(0), out.stride(0),
                            n_tiles, *([x] * 5), 0.0, K=K, GROUP=G, T=cfg.tiles, W=cfg.warps, EPI=epi, DEPTH=cfg.depth,
                            ITERS=cfg.iters, S=S, EMU=_INTERPRET, **cfg.launch, **pdl_args(pdl, x.device))
    return out


def persistent_programs(n_tiles: int, per_sm: int, device) -> int:
    """The persistent kernel's grid: the fewest programs that take no more tiles each than per_sm
    programs on every multiprocessor would (equal streams, no program with one tile more than
    needed). Without a GPU (the interpreter) 2 multiprocessors, so the tests' programs loop."""
    from .gemv import sm_count

    n_sm = sm_count(device) if device.type == "cuda" else 2
    per_program = triton.cdiv(n_tiles, min(n_tiles, per_sm * n_sm))
    return triton.cdiv(n_tiles, per_program)


def mma_w4a16_ref(x, qweight, scales, zeros, group_size: int, epilogue: str = "none") -> torch.Tensor:
    """Twin from the standard packing: W dequantized to x's dtype, F.linear, the epilogue rounded as
    the kernel rounds (gate and up to x's dtype, gelu, then the product)."""
    y = F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, dtype=x.dtype))
    if epilogue == "geglu":
        gate, up = y.float().chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh").to(x.dtype).float() * up).to(x.dtype)
    return y


@torch.library.custom_op("fastgemma::mma_w4a16", mutates_args=())
def mma_w4a16_op(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int, group_size: int, epilogue: str,
                 tiles: int, warps: int, depth: int, iters: int, splits: int, persist: int, fresh: bool, hw: int,
                 regs: int, pairs: bool, cuda: bool, pdl: bool) -> torch.Tensor:
    weight = MmaWeight(words, sz, N, x.shape[1], group_size, pairs)
    return mma_w4a16(x, weight, epilogue,
                     MmaConfig(tiles, warps, depth, iters, splits, persist, fresh, hw, regs, pairs, cuda), pdl)


def config_args(cfg: MmaConfig) -> tuple:
    """cfg's fields in `mma_w4a16_op`'s order (its tiles .. cuda arguments)."""
    return (cfg.tiles, cfg.warps, cfg.depth, cfg.iters, cfg.splits, cfg.persist, cfg.fresh, cfg.hw, cfg.regs, cfg.pairs,
            cfg.cuda)


@mma_w4a16_op.register_fake
def _(x, words, sz, N, group_size, epilogue, tiles, warps, depth, iters, splits, persist, fresh, hw, regs, pairs,
      cuda, pdl):
    return x.new_empty((x.shape[0], N // 2 if epilogue == "geglu" else N))

