"""W4A16: packing, RTN error bound, Triton kernels (CPU interpreter) vs the torch twin on odd shapes.

bf16 runs only through the GEMV kernel here: the interpreter computes tl.dot on bf16 wrongly
(errors ~1e10), so the tl.dot path is checked in fp32 / fp16 and in bf16 on the GPU.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest
import torch

from fastgemma.kernels.int4_pack import (
    GROUP_SIZES, dequantize_int4, pack_int4, pack_scale_zero, quantize_int4, unpack_int4,
)
from fastgemma.kernels.w4a16 import w4a16_matmul, w4a16_torch
from fastgemma.kernels.w4a16_table import CONFIGS, DEQUANT_MIN_M, E4B_SHAPES, W4A16Config, resolve_config, table_config

N, K = 100, 384  # neither a multiple of the N tiles nor of 256; K = 3 x 128
GEMV = W4A16Config(block_n=32, block_k=256, num_warps=4)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative to max |ref|


def _weights(G, n=N, k=K, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    q, s, z = quantize_int4(w, G)
    return w, pack_int4(q), s, z


def _err(y, ref):
    d = (y.float() - ref.float()).abs()
    return d.max().item(), (d.max() / ref.float().abs().max()).item()


def test_pack_roundtrip_exact():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (7, 96), generator=g, dtype=torch.uint8)
    p = pack_int4(q)
    assert p.shape == (7, 48) and p.dtype == torch.uint8
    assert torch.equal(unpack_int4(p), q)
    raw = torch.randint(0, 256, (5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(raw)), raw)
    # byte j = q[2j] (low nibble) | q[2j + 1] << 4
    assert pack_int4(torch.tensor([[0x1, 0x2]], dtype=torch.uint8)).item() == 0x21


@pytest.mark.parametrize("G", GROUP_SIZES)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_quantize_error_bound(G, wdtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 512, generator=g)
    w[3, :G] = 0.25  # a constant group: scale 0, exact
    w[5, 7] = 40.0   # an outlier widens one group
    w = w.to(wdtype)
    q, s, z = quantize_int4(w, G)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert s.shape == z.shape == (512 // G, 64)
    assert s.dtype == (torch.bfloat16 if wdtype == torch.bfloat16 else torch.float32)
    deq = dequantize_int4(pack_int4(q), s, z, G)
    err = (w.float() - deq).abs().reshape(64, -1, G)
    sg = s.t().float().unsqueeze(-1)
    if wdtype == torch.float32:
        bound = sg / 2 * (1 + 1e-5) + 1e-6
    else:  # a clamped group end also carries the bf16 rounding of scale and zero
        bound = sg / 2 + 2.0**-8 * (z.t().float().abs().unsqueeze(-1) + 15 * sg) + 1e-6
    print(f"\nG={G} {wdtype}: max err / scale = {(err / sg.clamp_min(1e-12)).max():.4f}")
    assert (err <= bound).all()
    assert err[3, 0].max() == 0


@pytest.mark.parametrize("G", GROUP_SIZES)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_clip_search_never_raises_a_groups_error_and_clips_outliers(G, wdtype, monkeypatch):
    """clip_search: each group's sum |w - dequant|^2.4 at most min/max's (p = 1 is a candidate), lower
    overall on heavy-tailed weights, an outlier's group clipped (its range narrower than its min/max),
    a constant group still exact; the row chunks (SEARCH_CHUNK) give the same answer as one pass."""
    from fastgemma.kernels import int4_pack

    g = torch.Generator().manual_seed(3)
    chi2 = (torch.randn(3, 64, 512, generator=g) ** 2).sum(0)
    w = torch.randn(64, 512, generator=g) / (chi2 / 3).sqrt() * 0.02  # Student's t (3): heavy tails, as trained weights
    w[3, :G] = 0.25
    w[5, 7] = 1.0
    w = w.to(wdtype)

    def group_err(q, s, z):
        d = (dequantize_int4(pack_int4(q), s, z, G) - w.float()).abs().pow(int4_pack.CLIP_NORM)
        return d.reshape(64, -1, G).sum(-1)

    plain, searched = quantize_int4(w, G), quantize_int4(w, G, clip_search=True)
    e0, e1 = group_err(*plain), group_err(*searched)
    print(f"\nG={G} {wdtype}: searched / min-max error {float(e1.sum() / e0.sum()):.3f}")
    assert (e1 <= e0 * (1 + 1e-5) + 1e-12).all() and e1.sum() < 0.97 * e0.sum()
    assert searched[1][0, 5] < plain[1][0, 5]  # the outlier's group: a finer grid
    assert e1[3, 0] == 0 and searched[1][0, 3] == 0
    monkeypatch.setattr(int4_pack, "SEARCH_CHUNK", 3 * G)  # 3 groups at a time
    for a, b in zip(quantize_int4(w, G, clip_search=True), searched):
        assert torch.equal(a, b)


def test_quantize_rejects_bad_group():
    with pytest.raises(ValueError, match="one of"):
        quantize_int4(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="K=96"):
        quantize_int4(torch.randn(4, 96), 64)


# (M, config): the dispatch path (None) plus overrides for GEMV over rows, split-K, N tails
CASES = [
    (1, GEMV),
    (3, GEMV),  # the GEMV kernel also serves M > 1: one program row per row of x
    (2, W4A16Config(block_n=8, block_k=256, split_k=3, factored=False)),  # the baseline dequantisation
    (1, W4A16Config(block_n=16, block_k=256, num_warps=2, words=True)),  # the word loop, N tail
    (3, W4A16Config(block_n=8, block_k=128, split_k=3, words=True)),  # word loop, rows of x, split-K
    (3, W4A16Config(block_n=64, block_k=128, block_m=16)),
    (8, W4A16Config(block_n=32, block_k=128, split_k=3, block_m=16)),
    (16, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("G", GROUP_SIZES)
@pytest.mark.parametrize("M,config", CASES)
def test_kernel_matches_twin(M, config, G, dtype):
    w, qw, s, z = _weights(G)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    y = w4a16_matmul(x, qw, s, z, G, config)
    ref = w4a16_torch(x, qw, s, z, G)
    exact = x.double() @ dequantize_int4(qw, s, z, G).double().t()
    cfg = resolve_config(M, N, K, G, config)
    assert y.shape == (M, N) and y.dtype == dtype
    abs_e, rel_e = _err(y, ref)
    _, rel_x = _err(y, exact)
    print(f"\nM={M} G={G} {dtype} {cfg}: vs twin max abs {abs_e:.2e} rel {rel_e:.2e}; vs fp64 rel {rel_x:.2e}")
    assert rel_e < TOL[dtype] and rel_x < TOL[dtype]


@pytest.mark.parametrize("config", [GEMV, W4A16Config(block_n=16, block_k=128, split_k=3, num_warps=4),
                                    W4A16Config(block_n=16, block_k=128, factored=False),
                                    W4A16Config(block_n=16, block_k=128, split_k=3, words=True)])
def test_gemv_bf16(config):
    # the production dtype (bf16 x, bf16 scales) through the GEMV kernel, which has no tl.dot
    w, qw, s, z = _weights(64, dtype=torch.bfloat16)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3)).bfloat16()
    y = w4a16_matmul(x, qw, s, z, 64, config)
    exact = x.double() @ dequantize_int4(qw, s, z, 64).double().t()
    abs_e, rel_e = _err(y, exact)
    print(f"\nbf16 GEMV {config}: max abs {abs_e:.2e} rel {rel_e:.2e}")
    assert y.dtype == torch.bfloat16 and rel_e < TOL[torch.bfloat16]


def test_int4_close_to_dense():
    # what int4 RTN costs on Gaussian weights, for scale: ~8-10 % of the output norm at g128
    for G in GROUP_SIZES:
        w, qw, s, z = _weights(G, n=256, k=512)
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
        ref = x @ w.t()
        rel = ((w4a16_torch(x, qw, s, z, G) - ref).norm() / ref.norm()).item()
        print(f"\nG={G}: int4 vs fp32 weights, relative output error {rel:.3f}")
        assert rel < 0.12


def test_resolve_config_fits_every_e4b_shape():
    for N_, K_ in E4B_SHAPES.values():
        for M in (1, 2, 8, 16, 64, 256):
            for G in GROUP_SIZES:
                c = resolve_config(M, N_, K_, G)
                assert c.block_k % G == 0 and K_ % c.block_k == 0
                assert (K_ // c.block_k) % c.split_k == 0
                assert c.block_m == 1 if M == 1 else c.block_m >= 16
    assert all(k[0] in (1, 16, 64, DEQUANT_MIN_M) for k in CONFIGS)
    # an override wins over the table, fitted to the shape (1024 does not divide 2560)
    c = resolve_config(1, 2048, 2560, 128, W4A16Config(block_n=2, block_k=1024, split_k=4))
    assert (c.block_n, c.block_k, c.split_k) == (2, 512, 1)
    with pytest.raises(ValueError, match="block_m"):
        resolve_config(4, 2048, 2560, 128, W4A16Config(block_n=16, block_k=512, block_m=4))


def test_launcher_checks_shapes():
    _, qw, s, z = _weights(128)
    with pytest.raises(ValueError, match="qweight"):
        w4a16_matmul(torch.randn(1, K + 128), qw, s, z, 128)
    with pytest.raises(ValueError, match="scales"):
        w4a16_matmul(torch.randn(1, K), qw, s, z, 64)


def _bf16_pair(a: float, b: float) -> int:
    bits = torch.tensor([a, b], dtype=torch.bfloat16).view(torch.int16)
    return (int(bits[0]) & 0xFFFF) | (int(bits[1]) & 0xFFFF) << 16


def test_bf16_dequant_asm_text():
    """The PTX block of the per-group kernel, run instruction by instruction (tests/ptx_lite.py) on
    every code byte: element i of each output pair is byte i's low / high nibble, q * s + z rounded
    once to bf16 with the element's own scale and zero."""
    from ptx_lite import run

    from fastgemma.kernels.w4a16 import _DEQUANT_BF16

    g = torch.Generator().manual_seed(5)
    s = (torch.rand(4, generator=g) * 0.1 + 1e-3).bfloat16()
    z = (-torch.rand(4, generator=g)).bfloat16()
    for first in range(0, 256, 4):
        b = [(first + 61 * i) % 256 for i in range(4)]  # every byte value appears in some lane
        word = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
        out = run(_DEQUANT_BF16.value, [word, _bf16_pair(s[0], s[1]), _bf16_pair(s[2], s[3]),
                                        _bf16_pair(z[0], z[1]), _bf16_pair(z[2], z[3])], 4)
        got = torch.tensor([(r >> sh) & 0xFFFF for r in out for sh in (0, 16)], dtype=torch.int32)
        got = (got << 16).view(torch.float32)
        q = torch.tensor([x & 0xF for x in b] + [x >> 4 for x in b], dtype=torch.float64)
        sd, zd = s.double().repeat(2), z.double().repeat(2)
        want = (q * sd + zd).to(torch.bfloat16).float()
        assert torch.equal(got, want), (b, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("G", GROUP_SIZES)
@pytest.mark.parametrize("M,config", [(1, W4A16Config(16, 128, 1, 4, 3, 16, per_group=True)),
                                      (5, W4A16Config(32, 128, 3, 4, 3, 16, per_group=True)),
                                      (8, W4A16Config(64, 512, 2, 4, 3, 16, per_group=True))])
def test_per_group_kernel_matches_twin(M, config, G, dtype):
    # N = 100: a tail tile (EVEN_N false) for every block_n; the per-group kernel keeps block_k = G
    w, qw, s, z = _weights(G, dtype=dtype)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    cfg = resolve_config(M, N, K, G, config)
    assert cfg.block_k == G and cfg.per_group
    y = w4a16_matmul(x, qw, s, z, G, config)
    ref = w4a16_torch(x, qw, s, z, G)
    _, rel_e = _err(y, ref)
    assert y.shape == (M, N) and rel_e < TOL[dtype], rel_e
    y64 = w4a16_matmul(x[:, :], qw[:64], s[:, :64].contiguous(), z[:, :64].contiguous(), G,
                       W4A16Config(64, 128, 1, 4, 3, 16, per_group=True))  # EVEN_N: no masks
    _, rel_e = _err(y64, ref[:, :64])
    assert rel_e < TOL[dtype], rel_e


@pytest.mark.parametrize("G", [64, 128])
@pytest.mark.parametrize("epilogue", ["none", "geglu", "gelu_mul"])
@pytest.mark.parametrize("M,config", [(5, W4A16Config(32, 128, 3, 4, 3, 16, per_group=True)),
                                      (8, W4A16Config(16, 128, 1, 1, 3, 16, per_group=True)),
                                      (3, W4A16Config(64, 128, 2, 4, 3, 16, per_group=True)),
                                      (40, W4A16Config(64, 128, 1, 4, 3, 64, per_group=True))])  # prompt chunk
def test_packed_scale_zero_words_give_the_same_bits(M, config, epilogue, G):
    """The per-group kernel on `pack_scale_zero` words equals it on separate scales / zeros bit for
    bit (fp16: the words carry the same 16-bit values), with tails, split-K and every epilogue;
    PACKED_SZ = False ignores the words."""
    from fastgemma.kernels import w4a16 as k4

    n = 96 if epilogue == "geglu" else N  # geglu: gate and up halves of 48 rows (a tail for 32 / 64)
    w, qw, s, z = _weights(G, n=n, dtype=torch.float16)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).half()
    aux = torch.randn(M, n, generator=torch.Generator().manual_seed(7)).half() if epilogue == "gelu_mul" else None
    sz = pack_scale_zero(s, z)
    assert sz.dtype == torch.int32 and sz.shape == s.shape
    assert torch.equal((sz & 0xFFFF).to(torch.int16).view(torch.float16), s)
    assert torch.equal((sz >> 16).to(torch.int16).view(torch.float16), z)
    base = w4a16_matmul(x, qw, s, z, G, config, epilogue=epilogue, aux=aux)
    got = w4a16_matmul(x, qw, s, z, G, config, epilogue=epilogue, aux=aux, sz=sz)
    assert torch.equal(got, base)
    ref = w4a16_torch(x, qw, s, z, G, epilogue=epilogue, aux=aux)
    assert _err(got, ref)[1] < 2 * TOL[torch.float16]
    # words that disagree with the scales show that the kernel read them; PACKED_SZ off ignores them
    wrong = pack_scale_zero(s * 2, z)
    assert not torch.equal(w4a16_matmul(x, qw, s, z, G, config, epilogue=epilogue, aux=aux, sz=wrong), base)
    k4.PACKED_SZ = False
    try:
        assert torch.equal(w4a16_matmul(x, qw, s, z, G, config, epilogue=epilogue, aux=aux, sz=wrong), base)
    finally:
        k4.PACKED_SZ = True


def test_pack_scale_zero_checks():
    s = torch.ones(3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit scales"):
        pack_scale_zero(s.float(), s.float())
    with pytest.raises(ValueError, match="16-bit scales"):
        pack_scale_zero(s, s.half())
    with pytest.raises(ValueError, match="differ in shape"):
        pack_scale_zero(s, s[:2])
    _, qw, sc, z = _weights(128, dtype=torch.float16)
    x = torch.randn(2, K).half()
    with pytest.raises(ValueError, match="sz must be contiguous int32"):
        w4a16_matmul(x, qw, sc, z, 128, sz=pack_scale_zero(sc, z)[:, :50])
    with pytest.raises(ValueError, match="sz must be contiguous int32"):
        w4a16_matmul(x, qw, sc, z, 128, sz=pack_scale_zero(sc, z).float())


def test_per_group_needs_a_dot_tile():
    with pytest.raises(ValueError, match="per_group needs block_m >= 16"):
        resolve_config(1, 2048, 2560, 128, W4A16Config(16, 128, per_group=True))


def test_word_loop_lop3_text_and_pair_values():
    """The word loop's PTX LOP3 (tests/ptx_lite.py) gives the bits of its Triton twin, and for every
    code pair the two halves are what _group_terms assumes: low << 16 = 1 + q_m / 16 exactly; high as
    fp32 = 1 + q_(m+4) / 16 + C + q_m 2^-20, C = 0x3F80 2^-23 (= _PAIR_C)."""
    import struct

    from ptx_lite import run

    from fastgemma.kernels.w4a16 import _LOP3_PAIR, _PAIR_C

    assert _PAIR_C.value == 0x3F80 / 2**23
    f32 = lambda bits: struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]  # noqa: E731
    for word in (0x76543210, 0xFEDCBA98, 0x0F0F0F0F, 0xF0F0F0F0, 0x13579BDF, 0xFFFFFFFF, 0):
        codes = [(word >> (4 * j)) & 0xF for j in range(8)]
        for m in range(4):
            t = (word << 3) & 0xFFFFFFFF if m == 0 else word >> (4 * m - 3)  # the kernel's shifts
            (v,) = run(_LOP3_PAIR.value, [t], 1)
            assert v == (t & 0x00780078) | 0x3F803F80  # the interpreter path's and / or
            assert f32(v << 16) == 1 + codes[m] / 16
            assert f32(v) == 1 + codes[m + 4] / 16 + _PAIR_C.value + codes[m] * 2.0**-20


@pytest.mark.parametrize("M,config", [
    (3, W4A16Config(block_n=8, block_k=128, split_k=3)),  # GEMV, byte loop, rows of x
    (1, W4A16Config(block_n=16, block_k=128, split_k=2, words=True)),  # GEMV, word loop, N tail
    (8, W4A16Config(block_n=32, block_k=128, split_k=3, block_m=16)),  # first tl.dot kernel
    (5, W4A16Config(32, 128, 3, 4, 3, 16, per_group=True)),  # per-group kernel, N tail
])
def test_split_fixup_equals_the_reduce_launch(monkeypatch, M, config):
    """split_k > 1: the last program of each tile sums the K splits' partials (an arrival counter)
    and gives the reduce kernel's output bit for bit; every counter is back to zero afterwards, so
    the next launch (or graph replay) starts clean."""
    from fastgemma.kernels import w4a16 as k4
    from fastgemma.kernels import w4a16_bench
    from fastgemma.kernels.counters import arrival_counters

    w, qw, s, z = _weights(64, dtype=torch.float16)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).half()
    monkeypatch.setattr(k4, "SPLIT_FIXUP", False)
    base = w4a16_matmul(x, qw, s, z, 64, config)
    monkeypatch.setattr(k4, "SPLIT_FIXUP", True)
    for _ in range(2):  # twice: the counters reset themselves
        got = w4a16_matmul(x, qw, s, z, 64, config)
        assert torch.equal(got, base)
        assert int(arrival_counters(x.device, 1).abs().sum()) == 0
    assert _err(got, w4a16_torch(x, qw, s, z, 64))[1] < TOL[torch.float16]
    # bench_shapes' comparison of the two (a stub timer here): equal, and the fixup switched back on
    row = w4a16_bench._time_reduce_launch(x, qw, s, z, [(qw, s, z, pack_scale_zero(s, z))], 64, config,
                                       lambda fn: (fn(), 1.5)[1])
    assert row == dict(reduce_launch_us=1.5, fixup_equal=True) and k4.SPLIT_FIXUP


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", GROUP_SIZES)
def test_dequant_kernel_matches_dequantize_int4(G, dtype):
    """The one-launch dequantization (W4A16Config.dequant) against dequantize_int4, on N and K that
    are no multiple of the tiles (100 rows, 3 x 128 columns): q * s + z in fp32, rounded once, so
    at most one rounding step of the dtype apart (an fma against a multiply then an add)."""
    from fastgemma.kernels.w4a16 import dequantize_int4_triton

    _, qw, s, z = _weights(G, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    ref = dequantize_int4(qw, s, z, G, dtype=dtype)
    for bn, bg in ((64, 4), (16, 1), (128, 2)):
        got = dequantize_int4_triton(qw, s, z, G, dtype, bn, bg)
        assert got.dtype == dtype and got.shape == ref.shape
        d = (got.float() - ref.float()).abs()
        ulp = ref.float().abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -22) + 1e-30
        assert (d <= ulp).all(), d.max().item()


def test_long_chunks_look_up_their_own_entries():
    """Chunks of DEQUANT_MIN_M rows or more take the (DEQUANT_MIN_M, N, K) entry where there is one
    (dequantize once, then cuBLAS), else the prompt-chunk entry; shorter chunks never take it."""
    gate_up, qkv = E4B_SHAPES["gate|up"], E4B_SHAPES["qkv"]
    assert (DEQUANT_MIN_M, *gate_up) in CONFIGS and (DEQUANT_MIN_M, *qkv) not in CONFIGS
    for M in (DEQUANT_MIN_M, 4 * DEQUANT_MIN_M):
        assert table_config(M, *gate_up) is CONFIGS[(DEQUANT_MIN_M, *gate_up)]
        assert resolve_config(M, *gate_up, 128).dequant
        assert table_config(M, *qkv) is CONFIGS[(64, *qkv)]
    for M in (17, DEQUANT_MIN_M - 1):
        assert table_config(M, *gate_up) is CONFIGS[(64, *gate_up)]
        assert not resolve_config(M, *gate_up, 128).dequant
    assert table_config(8, *gate_up) is CONFIGS[(16, *gate_up)]


@pytest.mark.parametrize("M", [17, 40])
@pytest.mark.parametrize("G", GROUP_SIZES)
def test_dequant_path_matches_twin(M, G):
    """w4a16_matmul with a dequant config (prompt chunks): W in x's dtype, then F.linear, as the twin."""
    cfg = resolve_config(M, N, K, G, W4A16Config(32, 512, 1, 4, 1, 64, dequant=True))
    assert cfg.dequant and cfg.block_k % G == 0 and K % cfg.block_k == 0
    _, qw, s, z = _weights(G)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    y = w4a16_matmul(x, qw, s, z, G, cfg)
    abs_err, rel = _err(y, w4a16_torch(x, qw, s, z, G))
    assert rel < TOL[torch.float32], abs_err
    with pytest.raises(ValueError, match="dequant"):
        resolve_config(M, N, K, G, W4A16Config(32, 512, 2, 4, 1, 64, dequant=True))
