"""kernels/mma_w4a16.py: the fragment-order packing, the PTX text run warp-wide (tests/ptx_lite.py),
the kernel under the interpreter (its mma blocks emulated) against exact sums on odd shapes, the
fused step with int4_mma against the step without it, bad input, and the sm_90a build: its mma
operands laid out one lane per row with a lane's 4 words in its registers, no spills."""
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastgemma.kernels.int4_pack import dequantize_int4, pack_int4, quantize_int4
from fastgemma.kernels.mma_table import MMA_CONFIGS, MmaConfig, mma_config, table_pairs
from fastgemma.kernels.mma_w4a16 import (
    ONES_ASM, TILE_ASM, MmaWeight, mma_w4a16, mma_w4a16_ref, pack_mma, pack_mma_sz, pair_order, unpack_mma,
)

INTERPRET = bool(os.environ.get("TRITON_INTERPRET"))


def _weights(N, K, G, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    q, s, z = quantize_int4(w, G)
    return q, s, z


def test_pack_round_trip_and_the_fragment_order():
    q = torch.randint(0, 16, (48, 192), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    words = pack_mma(q)
    assert words.shape == (3, 3, 32, 4) and words.dtype == torch.int32
    assert torch.equal(unpack_mma(words), q)
    # lane l = g*4 + tq, word j of block b: nibble p*4 + kh*2 + h is row g + 8h, k = b*64 + tq*16 + j*4 + kh*2 + p
    for tile, b, lane, j in ((0, 0, 0, 0), (2, 1, 13, 3), (1, 2, 31, 2)):
        g, tq = divmod(lane, 4)
        w = int(words[tile, b, lane, j]) & 0xFFFFFFFF
        for m in range(8):
            p, kh, h = m // 4, (m // 2) % 2, m % 2
            assert (w >> 4 * m) & 15 == q[tile * 16 + g + 8 * h, b * 64 + tq * 16 + j * 4 + kh * 2 + p]
    sz = torch.arange(3 * 48, dtype=torch.int32).reshape(3, 48)  # [K/G, N]
    frag = pack_mma_sz(sz)
    assert frag.shape == (3, 3, 8, 2) and frag[2, 1, 5, 1] == sz[1, 2 * 16 + 8 + 5]
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 64 == 0"):
        pack_mma(q[:40])
    # the paired GeGLU layout: tile i holds gate rows 8i..8i+7, then the up rows of the same outputs
    assert pair_order(32).tolist() == [*range(8), *range(16, 24), *range(8, 16), *range(24, 32)]
    paired = unpack_mma(pack_mma(q, pairs=True))
    assert torch.equal(paired[16:24], q[8:16]) and torch.equal(paired[24:32], q[32:40])
    assert torch.equal(pack_mma_sz(sz, pairs=True)[1, 2, 3], pack_mma_sz(sz[:, pair_order(48)])[1, 2, 3])
    assert pack_mma_sz(sz, pairs=True)[1, 2, 3, 1] == sz[2, 24 + 8 + 3]  # tile 1, its row 11: the up row 24 + 11 - 8


def _x_words(x_row):
    """bf16 x [K] -> int32 words of consecutive pairs (what the kernel's 16-byte loads read)."""
    return x_row.contiguous().view(torch.int32)


@pytest.mark.parametrize("ones", [False, True])
def test_the_ptx_blocks_warp_wide(ones):
    """TILE_ASM / ONES_ASM, instruction by instruction on 32 lanes (tests/ptx_lite.py's mma follows the
    PTX ISA's fragment maps): one 16-row tile over a 64-k block of 8 x rows gives sum (128 + q) x
    (or sum x) for each row and x row, in the lanes' accumulator order."""
    from ptx_lite import _f32, _f32_bits, run_warp

    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=gen)
    x = (torch.randn(8, 64, generator=gen)).bfloat16()
    words = pack_mma(q)[0, 0]  # [32, 4]
    c0 = [0.25 * i for i in range(4)]
    lanes = []
    for lane in range(32):
        g, tq = divmod(lane, 4)
        xw = _x_words(x[g])[tq * 8: tq * 8 + 8].tolist()  # x row g, k tq*16 .. tq*16 + 15
        acc = [_f32_bits(v) for v in c0]
        lanes.append((xw + acc) if ones else ([int(w) for w in words[lane].tolist()] + xw + acc))
    out = run_warp((ONES_ASM if ones else TILE_ASM).value, lanes, 4)
    A = torch.ones(16, 64, dtype=torch.float64) if ones else q.double() + 128
    want = A @ x.double().t()  # [16 rows, 8 x rows]
    for lane in range(32):
        g, tq = divmod(lane, 4)
        for c in range(4):
            r, n = g + 8 * (c // 2), tq * 2 + c % 2
            assert abs(_f32(out[lane][c]) - (want[r, n].item() + c0[c])) <= 1e-5 * max(1.0, abs(want[r, n].item()))


def _exact(x, q, s, z, G, epilogue):
    W = dequantize_int4(pack_int4(q), s, z, G, torch.float64)
    y = x.double() @ W.t()
    if epilogue == "geglu":
        gate, up = y.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    return y


@pytest.mark.skipif(not INTERPRET, reason="the kernel runs under TRITON_INTERPRET=1 on a CPU")
@pytest.mark.parametrize("N,K,G,M,epilogue,cfg", [
    (32, 256, 128, 1, "none", MmaConfig(1, 2)),  # two warps split K
    (48, 384, 64, 3, "none", MmaConfig(1, 2, 1)),  # group 64, one group in flight ahead
    (32, 1024, 128, 2, "none", MmaConfig(2, 1, 2)),  # two tiles per program, depth 2 of 8 groups
    (64, 512, 64, 8, "geglu", MmaConfig(2, 2, 3)),  # GeGLU over 8 x rows
    (32, 512, 128, 5, "none", MmaConfig(2, 4)),  # four warps, all groups up front
    (64, 256, 128, 3, "none", MmaConfig(1, 2, iters=3)),  # 3 tiles per program: 2 programs, the last tile masked
    (96, 256, 64, 2, "geglu", MmaConfig(2, 2, iters=2)),  # 3 gate / up pairs over 2 programs
    (32, 1024, 128, 1, "none", MmaConfig(1, 2, splits=4)),  # K over 4 programs per tile, one group per warp
    (64, 512, 128, 8, "none", MmaConfig(2, 2, splits=2)),  # 2 tiles per program, K over 2 programs
    (64, 512, 64, 3, "geglu", MmaConfig(2, 1, splits=2)),  # GeGLU after the partials are added
    (64, 512, 64, 8, "geglu", MmaConfig(1, 2, 3, pairs=True)),  # the paired layout: 8 outputs per program
    (96, 256, 64, 2, "geglu", MmaConfig(2, 2, iters=2, pairs=True)),  # 6 paired tiles, 3 programs of 2
    (64, 512, 64, 3, "geglu", MmaConfig(1, 1, splits=2, pairs=True)),  # paired, after the partials are added
])
def test_kernel_matches_exact_sums(N, K, G, M, epilogue, cfg):
    q, s, z = _weights(N, K, G, seed=N + K + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
    got = mma_w4a16(x, MmaWeight.from_codes(q, s, z, G, pairs=cfg.pairs), epilogue, cfg).double()
    want = _exact(x, q, s, z, G, epilogue)
    assert got.shape == want.shape
    # bf16 output rounding (and, for GeGLU, the gate / up / gelu roundings the eager layer makes)
    tol = (2 ** -7 if epilogue == "none" else 2 ** -5) * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol
    twin = mma_w4a16_ref(x, pack_int4(q), s, z, G, epilogue).double()
    assert (twin - want).abs().max().item() <= tol


@pytest.mark.skipif(not INTERPRET, reason="the kernel runs under TRITON_INTERPRET=1 on a CPU")
def test_split_k_launches_leave_their_counters_at_zero():
    """Each split tile's last program resets its arrival counter: a second launch (another layer of the
    same shape) adds its partials again, bit for bit, and the counters are zero after both."""
    from fastgemma.kernels.counters import arrival_counters

    q, s, z = _weights(48, 512, 64, seed=5)
    w = MmaWeight.from_codes(q, s, z, 64)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    cfg = MmaConfig(1, 2, splits=4)
    first = mma_w4a16(x, w, config=cfg)
    assert torch.equal(mma_w4a16(x, w, config=cfg), first)
    assert not arrival_counters(x.device, 3).any()
    assert (first.double() - _exact(x, q, s, z, 64, "none")).abs().max() <= 2 ** -7 * first.abs().max().item()


def test_bad_input():
    q, s, z = _weights(32, 256, 128)
    w = MmaWeight.from_codes(q, s, z, 128)
    with pytest.raises(ValueError, match="group_size in"):
        MmaWeight.from_codes(q, *_weights(32, 256, 32)[1:], 32)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        MmaWeight.from_codes(q[:24], s[:, :24], z[:, :24], 128)
    with pytest.raises(ValueError, match="bf16 scales"):
        MmaWeight.from_codes(q, s.float(), z.float(), 128)
    with pytest.raises(ValueError, match="1 <= M <= 8"):
        mma_w4a16(torch.zeros(9, 256, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bf16 x"):
        mma_w4a16(torch.zeros(1, 256), w)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        mma_w4a16(torch.zeros(1, 256, dtype=torch.bfloat16), w, "gelu_mul")
    if INTERPRET:
        with pytest.raises(ValueError, match="does not split into 4 warps"):
            mma_w4a16(torch.zeros(1, 256, dtype=torch.bfloat16), w, config=MmaConfig(1, 4))
        with pytest.raises(ValueError, match="iters must be >= 1, and > 1 only with every group in flight"):
            mma_w4a16(torch.zeros(1, 256, dtype=torch.bfloat16), w, config=MmaConfig(1, 1, depth=1, iters=2))
        with pytest.raises(ValueError, match="does not split into 2 warps x 4 splits"):
            mma_w4a16(torch.zeros(1, 256, dtype=torch.bfloat16), w, config=MmaConfig(1, 2, splits=4))
        with pytest.raises(ValueError, match="splits must be >= 1, and > 1 only with iters 1"):
            mma_w4a16(torch.zeros(1, 256, dtype=torch.bfloat16), w, config=MmaConfig(1, 1, iters=2, splits=2))
        with pytest.raises(ValueError, match="geglu needs tiles=2"):
            mma_w4a16(torch.zeros(1, 256, dtype=torch.bfloat16), w, "geglu", MmaConfig(1, 2))
        with pytest.raises(ValueError, match="reads the paired layout, the weight holds the natural one"):
            mma_w4a16(torch.zeros(1, 256, dtype=torch.bfloat16), w, "geglu", MmaConfig(1, 2, pairs=True))
    assert mma_config(2560, 2048, 1) is not None and mma_config(2560, 2048, 9) is None
    assert mma_config(2560, 10240, 1).persist == 1  # down at one row: the persistent kernel (run DO)
    assert mma_config(20480, 2560, 1, "geglu") == mma_config(20480, 2560, 8, "geglu")  # same sums at 1 and 8 rows
    assert mma_config(20480, 2560, 8, "geglu").pairs and table_pairs(20480, 2560)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(ValueError, match="mixes the paired GeGLU layout"):
        mp.setitem(MMA_CONFIGS, (20480, 2560, True), MmaConfig(2, 4, 5, persist=9, fresh=True))
        table_pairs(20480, 2560)


@pytest.mark.skipif(not INTERPRET, reason="the kernel runs under TRITON_INTERPRET=1 on a CPU")
@pytest.mark.parametrize("pairs", [False, True])
def test_fused_steps_with_int4_mma(monkeypatch, wide_tiles, pairs):
    """bf16 tiny model, int4 g64: fuse=layers' one-row step and its 5-row verify pass with int4_mma
    (the table pointed at the tiny shapes: every int4 GEMV / GEMM; the one-row step's prologues then
    run in kernels/residual_norm.py) give the hidden states of the same steps without it, to bf16
    rounding (the verify pass's other tl.dot GEMMs run as their twins: Triton 3.6's interpreter
    multiplies bf16 dot operands' bit patterns, triton-lang/triton#11584); the int4 modules hold the
    fragment-order copy and the byte count leaves it out. pairs: gate|up in the paired layout (one tile a
    program), packed so by FuseLayers from the table."""
    import fastgemma.kernels.mma_table as mma_table
    import fastgemma.kernels.mma_w4a16 as mma_mod
    import fastgemma.kernels.w4a16 as w4a16_mod
    import fastgemma.kernels.w4a16_table as w4a16_table
    from fastgemma.engine.cache import KVCache
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.metrics.memory import weight_bytes_per_step
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.fused_layer_ops import _layer_linears
    from fastgemma.transforms.quant import Int4Linear, Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    import fastgemma.kernels.rows_gemv as rows_mod
    import fastgemma.kernels.skinny_gemm as skinny_mod

    monkeypatch.setattr(w4a16_table, "default_config", lambda M, N, K: w4a16_table._grp(64, 1, 4))
    monkeypatch.setattr(w4a16_mod, "w4a16_epilogue_op", lambda x, qw, s, z, g, epi, aux, sz, pdl: w4a16_mod.w4a16_torch(
        x, qw, s, z, g, epilogue=epi, aux=aux))
    monkeypatch.setattr(skinny_mod, "skinny_matmul_op", lambda x, w, epi, aux, pdl: skinny_mod.skinny_matmul_ref(
        x, w, epilogue=epi, aux=aux))
    # the dense PLE gate too: both steps take the same kernel for it, and its bf16 sums as the interpreter rounds
    # them add noise to what this test compares (the int4 paths)
    monkeypatch.setattr(rows_mod, "rows_gemv_op", lambda x, w, epi, aux, pdl: rows_mod.rows_gemv_ref(x, w, epi, aux))
    model = synthetic_model(GEMMA4_TINY, "cpu", torch.bfloat16, seed=2)
    model.step_attention = decode_attention_ref
    FuseLayers(backend="triton").apply(model)
    Int4Quant(group_size=64, skip=("per_layer_projection", "per_layer_input_gate"), backend="triton").apply(model)
    before = weight_bytes_per_step(model)
    lin = _layer_linears(0, model.layers[0])
    for name, m in lin.items():
        for multi in (False, True):
            if isinstance(m, Int4Linear):  # gate|up (GeGLU) takes its gate and up tiles together, or paired tiles
                cfg = (MmaConfig(1 if pairs else 2, 1, pairs=pairs) if name == "gate_up" else
                       MmaConfig(1, 1, splits=2 if name == "down" else 1))  # down: K split
                monkeypatch.setitem(mma_table.MMA_CONFIGS, (m.out_features, m.in_features, multi), cfg)
    t = FuseLayers(backend="triton", int4_mma=True)
    plain_decode, plain_verify = model.fused_decode, model.fused_verify
    t.apply(model)
    t.validate(model)
    assert t.describe()["int4_mma"] and all(m.mma for m in lin.values() if isinstance(m, Int4Linear))
    assert [m.mma_pairs for m in lin.values() if isinstance(m, Int4Linear)] == [pairs and n == "gate_up" for n, m in
                                                                             lin.items() if isinstance(m, Int4Linear)]
    assert weight_bytes_per_step(model) == before
    calls = []
    real = mma_mod.mma_w4a16
    monkeypatch.setattr(mma_mod, "mma_w4a16",
                        lambda *a, **k: calls.append((a[0].shape[0], a[2], a[3])) or real(*a, **k))
    mma_steps = model.fused_decode, model.fused_verify
    for ids, pos in ((torch.tensor([[7]]), torch.tensor([[0]])),
                     (torch.tensor([[3, 4, 5, 6, 7]]), torch.arange(5)[None])):
        outs = []
        for dec, ver in (mma_steps, (plain_decode, plain_verify)):
            model.fused_decode, model.fused_verify = dec, ver
            cache = KVCache(GEMMA4_TINY, 1, 64, window=4, device="cpu", dtype=torch.bfloat16)
            outs.append(model.step(ids, pos, cache).float())
        got, want = outs
        assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()
    # the one-row step launched it for GEMVs with a prologue too (after kernels/residual_norm.py:
    # q|k|v, and gate|up with its GeGLU epilogue), and the verify pass at 5 rows
    assert {(1, "none"), (1, "geglu"), (5, "none"), (5, "geglu")} <= {c[:2] for c in calls}
    assert any(c[2].splits == 2 for c in calls)
    # fuse.start_kernel: the first q|k|v's norm (its prologue's own launch here) made by kernels/step_start.py
    import fastgemma.kernels.step_start as ss

    pres, real_start = [], ss.step_start
    monkeypatch.setattr(ss, "step_start", lambda *a: pres.append(a[4] is not None) or real_start(*a))
    outs = []
    for dec in (functools.partial(mma_steps[0], start_kernel=True), plain_decode):
        model.fused_decode = dec
        cache = KVCache(GEMMA4_TINY, 1, 64, window=4, device="cpu", dtype=torch.bfloat16)
        outs.append(model.step(torch.tensor([[7]]), torch.tensor([[0]]), cache).float())
    from fastgemma.transforms.fused_layer_ops import _mma_cfg

    # as the step's own call decides whether the tensor-core kernel takes q|k|v (with pairs, the tiny model's q|k|v
    # shares gate|up's shape and so its paired entry, which a launch without GeGLU does not take)
    assert pres == [_mma_cfg(lin["in"], 1, "none", torch.bfloat16) is not None]
    shape = lambda m: (m.out_features, m.in_features)  # noqa: E731
    assert pres == [True] or (pairs and shape(lin["in"]) == shape(lin["gate_up"]))
    assert (outs[0] - outs[1]).abs().max().item() <= 0.03 * outs[1].abs().max().item()


_SM90 = r'''
import re, sys
sys.path.insert(0, "tests")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sm90_compile import build
from fastgemma.kernels.mma_w4a16 import _mma_stream_kernel, _mma_w4a16_kernel


def mma_layouts(fn, sig, ce, aligned, warps):
    # the layouts of every tensor the inline mma reads or makes: blocked ones as sizePerThread +
    # threadsPerWarp, others (a linear layout) by name
    src = ASTSource(fn, dict(sig, **{k: "constexpr" for k in ce}), constexprs=ce,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ttgir"]
    pat = r"(#blocked\d*) = #ttg.blocked<\{sizePerThread = (\[[^]]*\]), threadsPerWarp = (\[[^]]*\])"
    layouts = {m[0]: m[1] + m[2] for m in re.findall(pat, ttgir)}
    used = set()
    for m in re.finditer(r'tt\.elementwise_inline_asm "((?:[^"\\]|\\.)*)"[^\n]*', ttgir):
        if "mma.sync" in m.group(1):
            used |= {layouts.get(x, x) for x in re.findall(r"tensor<[0-9x]+x[a-z0-9]+, (#[a-z]+\d*)>", m.group(0))}
    return sorted(used)


sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
       "M": "i32", "N": "i32", "HALF": "i32", "stride_xm": "i32", "stride_om": "i32", "NPT": "i32"}
aligned = (0, 1, 2, 3, 4, 5, 9, 10)
for name, K, T, W, EPI, D, I, S in [("down", 10240, 1, 4, 0, 64, 1, 1), ("down depth 8", 10240, 1, 4, 0, 8, 1, 1),
                                    ("gate|up geglu", 2560, 2, 4, 1, 64, 1, 1), ("o", 2048, 2, 8, 0, 64, 1, 1),
                                    ("q|k|v 2 tiles per program", 2560, 1, 4, 0, 64, 2, 1),
                                    ("down K over 4 programs", 10240, 1, 4, 0, 64, 1, 4),
                                    ("gate|up a lane row per thread", 2560, 2, 4, 1, 2, 1, 1)]:
    HW = W * T if "per thread" in name else W
    ce = dict(K=K, GROUP=128, T=T, W=W, EPI=EPI, DEPTH=D, ITERS=I, S=S, PDL=True, EMU=False)
    ptx, regs, spills = build(_mma_w4a16_kernel, sig, ce, aligned, HW)
    print(f"mma\t{name}\t{regs}\t{spills}\t{ptx.count('mma.sync')}\t{ptx.count('griddepcontrol.wait')}\t"
          f"{mma_layouts(_mma_w4a16_kernel, sig, ce, aligned, HW)}")
ssig = {k: v for k, v in sig.items() if k not in ("ws_ptr", "cnt_ptr")}
ssig["NITER"] = "i32"
# the table's one-row entries, one tile per program at E4B's shapes (ONE, as launched), and a program with tiles
for name, K, T, W, EPI, D, F, one in [("gate|up", 2560, 2, 4, 1, 5, True, True),
                                      ("down", 10240, 2, 8, 0, 3, False, True),
                                      ("gate|up looping", 2560, 2, 4, 1, 5, True, False)]:
    ce = dict(K=K, GROUP=128, T=T, W=W, EPI=EPI, DEPTH=D, FRESH=F, PDL=True, EMU=False, ONE=one, NS=0)
    ptx, regs, spills = build(_mma_stream_kernel, ssig, ce, (0, 1, 2, 3, 7, 8), W)
    print(f"stream\t{name}\t{spills}\t{mma_layouts(_mma_stream_kernel, ssig, ce, (0, 1, 2, 3, 7, 8), W)}")
# a register cap (MmaConfig.regs, the launch's maxnreg) reaches ptxas: gate|up's entry under 128 and 96
for cap in (128, 96):
    ce = dict(K=2560, GROUP=128, T=2, W=4, EPI=1, DEPTH=2, FRESH=False, PDL=True, EMU=False, ONE=True, NS=0)
    ptx, regs, spills = build(_mma_stream_kernel, ssig, ce, (0, 1, 2, 3, 7, 8), 4, maxnreg=cap)
    print(f"cap\t{cap}\t{regs}\t{spills}")
# the norm fold (kernels/norm_fold.py) on the table's one-row entries: o as the producer (one tile per program),
# gate|up and q|k|v as consumers (80 / 160 partials, the layer scalar), o full and the PLE projection producing
fsig = dict(ssig, **{n: "*bf16" for n in ("f_res", "f_y", "f_post", "f_pre", "f_scale", "f_rows", "f_h")},
            f_parts="*fp32", eps="fp32", off="fp32", lse_ptr="*fp32")
# (+ o on a sliding layer's 8 attention partials, kernels/attn_fold.py: its x loads 16-byte, as o's own)
for name, K, T, W, EPI, D, extra in [("o producer", 2048, 2, 4, 0, 5, dict(FOLD=1, ONE=True)),
                                     ("o producer on partials", 2048, 2, 4, 0, 5,
                                      dict(FOLD=1, ONE=True, NS=8, PG=4, PD=256)),
                                     ("gate|up consumer", 2560, 2, 4, 1, 5,
                                      dict(FOLD=2, NPART=80, NP2=128, HB=64, ONE=True)),
                                     ("q|k|v consumer", 2560, 2, 4, 0, 5,
                                      dict(FOLD=2, NPART=160, NP2=256, HAS_SCALE=True, HB=64, ONE=True))]:
    ce = dict(dict(NS=0), K=K, GROUP=128, T=T, W=W, EPI=EPI, DEPTH=D, FRESH=True, PDL=True, EMU=False, **extra)
    ptx, regs, spills = build(_mma_stream_kernel, fsig, ce, (0, 1, 2, 3, 7, 8), W)
    print(f"fold\t{name}\t{regs}\t{spills}\t{ptx.count('mma.sync')}\t{mma_layouts(_mma_stream_kernel, fsig, ce, (0, 1, 2, 3), W)}\t"
          f"{ptx.count('ld.global.v4')}")
psig = dict(sig, **{n: "*bf16" for n in ("f_res", "f_post", "f_pre", "f_rows")}, f_parts="*fp32", off="fp32")
for name, K, T, W in [("o full producer", 4096, 2, 8), ("PLE projection producer", 256, 1, 1)]:
    ce = dict(K=K, GROUP=128, T=T, W=W, EPI=0, DEPTH=64, ITERS=1, S=1, PDL=True, EMU=False, FOLD=1)
    ptx, regs, spills = build(_mma_w4a16_kernel, psig, ce, (0, 1, 2, 3), W)
    print(f"fold\t{name}\t{regs}\t{spills}\t{ptx.count('mma.sync')}\t{mma_layouts(_mma_w4a16_kernel, psig, ce, (0, 1, 2, 3), W)}\t"
          f"{ptx.count('ld.global.v4')}")
'''


def test_sm90_build_lays_the_mma_operands_out_one_lane_per_row():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _SM90], env=env, capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {f[1]: f[2:] for f in (line.split("\t") for line in r.stdout.splitlines()) if f[0] == "mma"}
    assert len(rows) == 7, r.stdout
    for name, (regs, spills, mmas, waits, layouts) in rows.items():
        # every mma operand: one lane per row (threadsPerWarp [32, 1]), a lane's 4 values in its registers
        assert layouts == "['[1, 4][32, 1]']", (name, layouts)
        assert int(spills) == 0 and int(mmas) > 0 and int(waits) == 1, (name, regs, spills, mmas)
    # the persistent kernel (the table's one-row entries) too
    stream = {f[1]: f[2:] for f in (line.split("\t") for line in r.stdout.splitlines()) if f[0] == "stream"}
    # (down spilled 84 bytes at 255 registers while it held a next tile's words; ONE drops them)
    assert stream == {n: ["0", "['[1, 4][32, 1]']"] for n in ("gate|up", "down", "gate|up looping")}, stream
    caps = [f[1:] for f in (line.split("\t") for line in r.stdout.splitlines()) if f[0] == "cap"]
    assert len(caps) == 2 and all(int(regs) <= int(cap) for cap, regs, _ in caps), caps
    # and the norm fold's producers and consumers: no spills, the same operand layouts
    fold = {f[1]: f[2:] for f in (line.split("\t") for line in r.stdout.splitlines()) if f[0] == "fold"}
    assert len(fold) == 6, r.stdout
    for name, (regs, spills, mmas, layouts, _) in fold.items():
        assert int(spills) == 0 and int(mmas) > 0 and layouts == "['[1, 4][32, 1]']", (name, regs, spills, layouts)
    # the partials' x: 16-byte loads like o's own x (a scalar load per word would be 4x the instructions)
    assert fold["o producer on partials"][4] == fold["o producer"][4], fold


@pytest.mark.skipif(not INTERPRET, reason="the kernels run under TRITON_INTERPRET=1 on a CPU")
def test_bench_mma_checks_every_row_against_the_twin(capsys):
    """bench_mma on tiny cases with a stub timer: every candidate of this kernel and the fused int4
    GEMV it is compared with at one row (plain, and timed-only with the case's prologue) runs and
    matches the twin; without a GPU and without a timer it says what it needs."""
    from fastgemma.kernels.mma_bench import bench_mma, faster_entries, mma_candidates
    from fastgemma.kernels.mma_table import parse_config

    cases = {"r": (64, 256, "residual"), "g": (64, 256, "geglu"), "p": (64, 256, "plain")}
    rows = bench_mma(cases, ms=(1,), device="cpu", timer=lambda fn: (fn(), 2.0)[1])
    by_case = {c: [r for r in rows if r["case"] == c] for c in cases}
    for c, (N, K, mode) in cases.items():
        mma_rows = [r for r in by_case[c] if r["kernel"].startswith("mma")]
        assert len(mma_rows) == len(mma_candidates(K, 128, "geglu" if mode == "geglu" else "none"))
        assert all(r["ok"] and r["us"] == 2.0 for r in by_case[c]), by_case[c]
        assert len(by_case[c]) == len(mma_rows) + 2 + (1 if mode == "plain" else 2)  # + 2 read floors
    assert "int4 GEMV on the tensor cores" in capsys.readouterr().out
    # configs given: those that fit the shape (1x4 does not: 256 k in 4 warps of 128)
    tried = [parse_config(c) for c in ("1x1s2", "2x1", "1x4")]
    rows = bench_mma({"p": cases["p"]}, ms=(1,), device="cpu", timer=lambda fn: (fn(), 2.0)[1], configs=tried)
    assert sum("floor" in r["kernel"] for r in rows) == 2
    assert [r["kernel"] for r in rows if r["kernel"].startswith("mma")] == [
        "mma 1x16 rows, 1 warps, d64, iters 1, splits 2", "mma 2x16 rows, 1 warps, d64, iters 1, splits 1"]
    assert [r["config"] for r in rows if r["kernel"].startswith("mma")] == ["1x1s2", "2x1"]
    # the entries faster than the table's, for bench.stack --mma-table +ENTRIES
    table = {(64, 256, False): parse_config("2x1")}
    timed = [dict(r, us={"1x1s2": 1.5, "2x1": 2.0}.get(r["config"], r["us"])) for r in rows]
    assert faster_entries(timed, table) == "p@1=1x1s2"
    assert faster_entries(timed, table, margin_us=0.6) == ""
    assert faster_entries(timed, {}) == ""  # the table's config not timed: nothing to beat
    assert all(r["ok"] for r in rows)
    # hot: each kernel timed again on one copy of its weights (the timer sees a different callable);
    # those rows never count as a config faster than the table's
    seen = []
    rows = bench_mma({"p": cases["p"]}, ms=(1,), device="cpu", configs=tried[:1], hot=True,
                     timer=lambda fn: (fn(), seen.append(fn), 1.0 if len(seen) % 2 == 0 else 2.0)[2])
    assert [(r["config"], r["hot"], r["us"]) for r in rows if r["config"]] == [("1x1s2", False, 2.0), ("1x1s2", True, 1.0)]
    assert sum(r["hot"] for r in rows) == len(rows) // 2
    assert faster_entries(rows, {(64, 256, False): parse_config("1x1s2")}, margin_us=0.0) == ""
    assert "mma 1x16 rows, 1 warps, d64, iters 1, splits 2, weights in L2 |" in capsys.readouterr().out
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="bench_mma needs a CUDA device"):
            bench_mma(cases, ms=(1,), device="cpu")


def test_table_from_text():
    """bench.stack --mma-table: entries by E4B case name, rows, tiles x warps and depth; 'none' empties
    the table; anything else is refused with the form it expects."""
    from fastgemma.kernels.mma_table import parse_config, parse_table

    assert parse_table("o@1=2x8, down@1=1x4d8,q|k|v@8=2x4,gate|up@1=2x2s4") == {
        (2560, 2048, False): MmaConfig(2, 8), (2560, 10240, False): MmaConfig(1, 4, 8),
        (3072, 2560, True): MmaConfig(2, 4), (20480, 2560, False): MmaConfig(2, 2, splits=4)}
    assert parse_table("none") == {}
    assert parse_table("o_full@1=2x8,PLE_projection@8=1x1") == {(2560, 4096, False): MmaConfig(2, 8),
                                                                 (2560, 256, True): MmaConfig(1, 1)}
    assert parse_table("W_plm@1=1x4i2") == {(10752, 2560, False): MmaConfig(1, 4, iters=2)}  # a name with '_'
    for bad in ("foo@1=1x1", "o@0=1x1", "o@1=2", "o=1x1", "o@1=1x1s"):
        with pytest.raises(ValueError, match="CASE@ROWS=TxW"):
            parse_table(bad)
    assert parse_config("2x4d2i2") == MmaConfig(2, 4, 2, 2) and parse_config(" 1x4s4") == MmaConfig(1, 4, splits=4)
    with pytest.raises(ValueError, match="TxW"):
        parse_config("1x4q")


@pytest.mark.skipif(not INTERPRET, reason="the kernel runs under TRITON_INTERPRET=1 on a CPU")
@pytest.mark.parametrize("N,K,G,M,epilogue,cfg", [
    (64, 256, 128, 1, "none", MmaConfig(1, 1, 2, persist=1)),  # 4 tiles on 2 programs: the stream crosses tiles
    (96, 512, 64, 3, "geglu", MmaConfig(2, 2, 2, persist=1, fresh=True)),  # 3 pairs on 2 programs, one masked
    (80, 512, 128, 8, "none", MmaConfig(1, 2, 1, persist=1)),  # 5 tiles, depth 1
    (160, 256, 64, 2, "none", MmaConfig(2, 1, 4, persist=9, fresh=True)),  # one tile per program
    (64, 512, 128, 4, "geglu", MmaConfig(2, 2, 2, persist=9, fresh=True, hw=4)),  # a lane row per thread
    (96, 512, 64, 3, "geglu", MmaConfig(1, 2, 2, persist=1, fresh=True, pairs=True)),  # 6 paired tiles, 2 programs
])
def test_persistent_kernel_matches_exact_sums(N, K, G, M, epilogue, cfg):
    """The persistent kernel (`persist`, interpreter: 2 multiprocessors) with its loads crossing tile
    boundaries and the last step of a program masked, with and without fresh chains."""
    q, s, z = _weights(N, K, G, seed=N + K + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
    got = mma_w4a16(x, MmaWeight.from_codes(q, s, z, G, pairs=cfg.pairs), epilogue, cfg).double()
    want = _exact(x, q, s, z, G, epilogue)
    tol = (2 ** -7 if epilogue == "none" else 2 ** -5) * want.abs().max().item()
    assert got.shape == want.shape and (got - want).abs().max().item() <= tol


@pytest.mark.skipif(not INTERPRET, reason="the kernels run under TRITON_INTERPRET=1 on a CPU")
@pytest.mark.parametrize("M", [1, 8])
def test_the_paired_layout_rounds_as_the_tile_pair(M):
    """A GeGLU output sums the same words in the same order in either layout (an mma's rows and columns are
    independent), so one tile of the paired layout per program gives the gate / up tile pair's bits."""
    N, K, G = 128, 512, 128
    q, s, z = _weights(N, K, G, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + 1)).bfloat16()
    natural = MmaWeight.from_codes(q, s, z, G)
    paired = MmaWeight.from_codes(q, s, z, G, pairs=True)
    want = mma_w4a16(x, natural, "geglu", MmaConfig(2, 2, 2, persist=9, fresh=True))
    for cfg in (MmaConfig(1, 2, 2, persist=9, fresh=True, pairs=True), MmaConfig(2, 2, 2, persist=1, fresh=True,
                                                                                pairs=True)):
        assert torch.equal(mma_w4a16(x, paired, "geglu", cfg), want), cfg


def test_persistent_config_text_and_refusals():
    from fastgemma.kernels.mma_table import config_problem, format_config, parse_config
    from fastgemma.kernels.mma_w4a16 import config_args

    assert parse_config("2x4d5p9f") == MmaConfig(2, 4, 5, persist=9, fresh=True)
    assert config_args(parse_config("2x4d5p9fn8")) == (2, 4, 5, 1, 1, 9, True, 8, 0, False, False)  # mma_w4a16_op's order
    assert parse_config("1x4d5p9fg") == MmaConfig(1, 4, 5, persist=9, fresh=True, pairs=True)
    assert "pairs" in config_problem(MmaConfig(1, 4, pairs=True), 64, 1024, 128, "none")
    assert "tiles=2" in config_problem(MmaConfig(1, 4), 64, 1024, 128, "geglu")
    assert config_problem(MmaConfig(1, 4, pairs=True), 64, 1024, 128, "geglu") is None
    assert "row tiles" in config_problem(MmaConfig(4, 4, pairs=True), 48, 1024, 128, "geglu")
    assert parse_config("2x4d2p9r128") == MmaConfig(2, 4, 2, persist=9, regs=128)
    assert parse_config("2x4d2p9r128").launch == {"num_warps": 4, "maxnreg": 128}
    assert parse_config("2x4n8").launch == {"num_warps": 8}
    for text in ("2x4d5p9f", "1x1s8", "2x8d3p1", "2x4i2", "2x4d2p9fn8r128", "1x4", "1x4d5p9fg"):
        assert format_config(parse_config(text)) == text
    assert "regs" in config_problem(MmaConfig(2, 4, regs=16), 64, 1024, 128, "none")
    assert "regs" in config_problem(MmaConfig(2, 4, regs=256), 64, 1024, 128, "none")
    assert parse_config("2x4d5p9fn8") == MmaConfig(2, 4, 5, persist=9, fresh=True, hw=8)
    assert parse_config("2x4n8").num_warps == 8 and parse_config("2x4").num_warps == 4
    assert "hw" in config_problem(MmaConfig(2, 4, hw=3), 64, 1024, 128, "none")
    assert "hw" in config_problem(MmaConfig(2, 4, hw=16), 64, 1024, 128, "none")
    assert "persist" in config_problem(MmaConfig(2, 4, persist=1, splits=2), 64, 1024, 128, "none")
    assert "fresh" in config_problem(MmaConfig(2, 4, fresh=True), 64, 1024, 128, "none")


@pytest.mark.skipif(not INTERPRET, reason="the kernel runs under TRITON_INTERPRET=1 on a CPU")
def test_embedding_projection_on_the_tensor_cores(monkeypatch):
    """int4_mma, not batch_invariant: the embedding's PLE context projection (W_plm) takes the tensor-core
    kernel where the table has a one-row entry for its shape (FuseLayers gives it the fragment-order copy),
    its own launch at rows without an entry and where the table has none; the PLE inputs equal the model's
    own embedding to bf16 rounding (its projection as the twin: the interpreter's per-group tl.dot is the
    bug above)."""
    import fastgemma.kernels.mma_table as mma_table
    import fastgemma.kernels.mma_w4a16 as mma_mod
    import fastgemma.kernels.w4a16 as w4a16_mod
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.fused_layer_ops import _embed
    from fastgemma.transforms.quant import Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    def build():
        model = synthetic_model(GEMMA4_TINY, "cpu", torch.bfloat16, seed=5)
        Int4Quant(group_size=64, skip=("per_layer_projection", "per_layer_input_gate"), backend="triton").apply(model)
        FuseLayers(backend="triton", int4_mma=True).apply(model)
        plm = model.per_layer_model_projection
        monkeypatch.setattr(plm, "_matmul", lambda x, qw, s, z, g, cfg, sz=None: w4a16_mod.w4a16_torch(x, qw, s, z, g))
        return model, plm

    key = (GEMMA4_TINY.num_layers * GEMMA4_TINY.ple_dim, GEMMA4_TINY.hidden_size, False)
    calls = []
    real = mma_mod.mma_w4a16
    monkeypatch.setattr(mma_mod, "mma_w4a16", lambda *a, **k: calls.append((a[0].shape[0], a[1].N)) or real(*a, **k))
    monkeypatch.setitem(mma_table.MMA_CONFIGS, key, MmaConfig(1, 1))
    model, plm = build()
    assert plm.mma
    for ids in (torch.tensor([[7]]), torch.tensor([[3, 4, 5, 6, 7]])):
        calls.clear()
        x, ple = _embed(model, ids, False, True, False, True)
        x_ref, ple_ref = model.embed(ids)
        assert torch.equal(x, x_ref)
        assert (ple.float() - ple_ref.float()).abs().max().item() <= 0.02 * ple_ref.float().abs().max().item()
        assert calls == ([(1, plm.out_features)] if ids.shape[1] == 1 else [])  # no 5-row entry: its own launch
    calls.clear()
    monkeypatch.delitem(mma_table.MMA_CONFIGS, key)
    model, plm = build()
    assert not plm.mma
    _, ple = _embed(model, torch.tensor([[7]]), False, True, False, True)
    assert calls == [] and torch.equal(ple, model.embed(torch.tensor([[7]]))[1])
