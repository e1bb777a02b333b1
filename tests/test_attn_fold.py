"""The attention's combine folded into o (kernels/attn_fold.py, `fuse.attn_fold`). Under TRITON_INTERPRET=1
(mma emulated): the split kernel's partials mode against its own combined output, the o GEMV on the
partials against float64 sums of the combine and the GEMV (several configs, head dims and split counts,
an empty split, a weighing that a wrong one would miss), refusals, and the fused step with the fold."""

import pytest
import torch
import triton

import fastgemma.kernels.attention_tiles as at

import fastgemma.kernels.decode_attention as da
from fastgemma.kernels.attn_fold import combine_parts_ref
from fastgemma.kernels.int4_pack import dequantize_int4, pack_int4, quantize_int4
from fastgemma.kernels.mma_table import MmaConfig
from fastgemma.kernels.mma_w4a16 import MmaWeight

INTERPRET = bool(triton.knobs.runtime.interpret)
pytestmark = pytest.mark.skipif(not INTERPRET, reason="the kernels run under TRITON_INTERPRET=1 on a CPU")


@pytest.mark.parametrize("store", [True, False], ids=["store", "query_only"])
def test_split_kernel_partials_combine_to_its_output(store):
    """One row over a ring shorter than the context, 5 cache splits (+ the own rows' on a store layer): the
    partials (bf16, an empty split's zeros) and lse combine to what the kernel's combine writes."""
    from test_attention_qkv import _case

    Hkv, G, D, S, last, window = 2, 2, 64, 48, [60], 40
    qkv, qw, kw, cos, sin, k, v, idx, q_pos, slot_pos = _case(1, 1, Hkv, G, D, S, last, window, True, torch.bfloat16,
                                                              store)
    if not store:
        k, v = k.nan_to_num(0.5), v.nan_to_num(0.5)
    kw_ = dict(heads=Hkv * G, eps=1e-6, offset=0.0, scale=1.0, num_splits=5)
    k2, v2 = k.clone(), v.clone()
    want = da.decode_attention_qkv(qkv, qw, kw, cos, sin, k2, v2, idx, q_pos, slot_pos, window, **kw_)
    o_part, lse = da.decode_attention_qkv(qkv, qw, kw, cos, sin, k, v, idx, q_pos, slot_pos, window, parts=True, **kw_)
    ns = 5 + store
    assert o_part.shape == (Hkv, ns, G, D) and o_part.dtype == torch.bfloat16 and lse.shape == (Hkv, ns, G)
    assert torch.isfinite(o_part).all()
    assert (lse == float("-inf")).any()  # 40 keys over 5 splits of 32-key blocks: the last splits are empty
    assert (o_part[lse == float("-inf")] == 0).all()
    got = combine_parts_ref(o_part, lse).reshape(want.shape)
    torch.testing.assert_close(got, want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k.nan_to_num(7.0), k2.nan_to_num(7.0))  # the caches as the plain launch left them
    assert at.qkv_splits(k, Hkv * G, D, store, "") == at.qkv_splits(k, Hkv * G, D, store, "") > 1
    with pytest.raises(ValueError, match="one row"):
        q2 = torch.cat([q_pos, q_pos + 1], 1)
        c2, s2 = torch.cat([cos, cos], 1), torch.cat([sin, sin], 1)
        da.decode_attention_qkv(torch.cat([qkv, qkv], 1), qw, kw, c2, s2, k, v, torch.cat([idx, idx + 1], 1), q2,
                                slot_pos, window, parts=True, **kw_)


def test_split_count_is_a_constant_to_torch_compile():
    """The step decides at trace time whether a layer's attention ends in partials (`qkv_splits`): under
    torch.compile that is a constant (no graph break, no traced caches, the launch's own count)."""
    import warnings

    k = torch.zeros(1, 200, 2, 64)

    def f(x, k):
        return x * at.qkv_splits(k, 4, 64, True, "")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2), k)
    assert out.tolist() == [8.0, 8.0]  # 200 slots in blocks of 32: 7 splits, + the own rows' one
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    assert at.qkv_splits(k, 4, 64, False, "32x8s2p3") == 3  # a tiles string's split count, no own split


def _partials(Hkv, NS, PG, PD, seed, empty=()):
    g = torch.Generator().manual_seed(seed)
    o_part = torch.randn(Hkv, NS, PG, PD, generator=g).bfloat16()
    lse = torch.randn(Hkv, NS, PG, generator=g) * 4
    for kv, s in empty:
        lse[kv, s] = float("-inf")
        o_part[kv, s] = 0
    return o_part, lse


@pytest.mark.parametrize("Hkv,NS,PG,PD,G,N,cfg", [
    # 8 splits, one head per warp slice (weights made once per head), programs looping over 4 tiles
    (2, 8, 2, 128, 64, 64, MmaConfig(1, 2, 2, persist=1, fresh=True)),
    # 3 splits, 2 heads in a warp's slice of 256 k, one-tile programs of 2 tiles
    (1, 3, 4, 64, 64, 64, MmaConfig(2, 1, 2, persist=9)),
    # group 128, 4 warps of 128 k: one group per warp slice, its head's weights made for it
    (2, 5, 2, 128, 128, 32, MmaConfig(1, 4, 1, persist=9, fresh=True)),
    # 4 warps of 64 k over heads of 128: two warps per head, the weights made in each
    (1, 2, 2, 128, 64, 32, MmaConfig(2, 4, 1, persist=1)),
])
def test_o_on_the_partials_matches_the_combine_then_o(Hkv, NS, PG, PD, G, N, cfg):
    from fastgemma.kernels.mma_fold import mma_rows

    K = Hkv * PG * PD
    gen = torch.Generator().manual_seed(K + NS)
    q, s, z = quantize_int4((torch.randn(N, K, generator=gen) * 0.05).bfloat16(), G)
    o_part, lse = _partials(Hkv, NS, PG, PD, seed=NS, empty=((0, NS - 1), (Hkv - 1, 1)))
    a = torch.randn(1, N, generator=gen).bfloat16()
    post, pre = (torch.randn(N, generator=gen) * 0.3).bfloat16(), (torch.randn(N, generator=gen) * 0.3).bfloat16()
    y, rows, parts = mma_rows(o_part, MmaWeight.from_codes(q, s, z, G), a, post, pre, config=cfg, lse=lse)
    w64 = dequantize_int4(pack_int4(q), s, z, G, dtype=torch.float64)
    x = combine_parts_ref(o_part.double(), lse.double())
    want = x @ w64.T
    tol = 2 ** -7 * want.abs().max().item()  # the interpreter truncates the bf16 store
    assert (y.double() - want).abs().max().item() <= tol
    # the unweighted mean of the splits (a weighing that ignores lse) is far off: the test sees the weights
    wrong = o_part.double().mean(1).reshape(1, -1) @ w64.T
    assert (wrong - want).abs().max().item() > 20 * tol
    # the producer's store as from a plain row: its rows and each tile's sum of y^2 from this y
    yf, af, p = y.double().reshape(-1), a.double().reshape(-1), pre.double()
    exact = torch.stack([af * p, yf * post.double() * p])
    assert rows.shape == (2, N) and ((rows.double() - exact).abs() <= exact.abs() * 2 ** -7).all()
    tile_rows = 16 * cfg.tiles
    assert torch.allclose(parts[:, 0].double(), yf.pow(2).reshape(-1, tile_rows).sum(1), rtol=1e-5)


def test_refusals():
    from fastgemma.kernels.mma_fold import mma_rows

    q, s, z = quantize_int4(torch.randn(32, 256).bfloat16() * 0.05, 64)
    w = MmaWeight.from_codes(q, s, z, 64)
    a, post, pre = torch.zeros(1, 32).bfloat16(), torch.ones(32).bfloat16(), torch.ones(32).bfloat16()
    cfg = MmaConfig(1, 1, 2, persist=1)
    o_part, lse = _partials(2, 9, 2, 64, seed=1)
    with pytest.raises(ValueError, match="at most 8 splits"):
        mma_rows(o_part, w, a, post, pre, config=cfg, lse=lse)
    o_part, lse = _partials(1, 4, 8, 32, seed=1)
    with pytest.raises(ValueError, match="one head"):
        mma_rows(o_part, w, a, post, pre, config=cfg, lse=lse)
    o_part, lse = _partials(2, 4, 2, 64, seed=1)
    with pytest.raises(ValueError, match="lse must be"):
        mma_rows(o_part, w, a, post, pre, config=cfg, lse=lse[:, :2])
    with pytest.raises(ValueError, match="K=256"):
        mma_rows(o_part[:1], w, a, post, pre, config=cfg, lse=lse[:1])
    with pytest.raises(ValueError, match="persistent"):
        mma_rows(o_part, w, a, post, pre, config=MmaConfig(1, 1), lse=lse)


def test_fused_step_with_the_combine_folded(monkeypatch, wide_tiles):
    """fuse.attn_fold on a 3-layer bf16 model (head dim 64, int4 g64, persistent one-row configs for the
    tiny shapes): its sliding layers (a store layer, a KV-shared one) end their attention in 4 and 3
    splits (their tiles' split count; the ring is shorter, so later splits are empty) and the full store
    layer in 2 (one over the 32-slot cache, one for its own row), and o takes them. The hidden states
    match the step without the fold to bf16 rounding over two positions. Without norm_fold it is
    refused; under batch_invariant it is off."""
    import dataclasses

    import fastgemma.kernels.mma_table as mma_table
    from fastgemma.engine.cache import KVCache
    from fastgemma.model.config import FULL, GEMMA4_TINY, SLIDING
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.fused_layer_ops import _layer_linears
    from fastgemma.transforms.quant import Int4Linear, Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    cfg_model = dataclasses.replace(GEMMA4_TINY, head_dim=64, global_head_dim=64, ple_dim=64, num_layers=3,
                                    num_kv_shared_layers=1, layer_types=(SLIDING, FULL, SLIDING))
    model = synthetic_model(cfg_model, "cpu", torch.bfloat16, seed=5)
    FuseLayers(backend="triton").apply(model)
    Int4Quant(group_size=64, skip=("per_layer_input_gate",), backend="triton").apply(model)
    for i, layer in enumerate(model.layers):
        for name, m in _layer_linears(i, layer).items():
            if isinstance(m, Int4Linear):
                # 4 tiles a program where the shape allows (fewer programs for the interpreter)
                cfg = MmaConfig(2 if name == "gate_up" else 4, 2 if name == "o" else 1, 2, persist=1, fresh=True)
                monkeypatch.setitem(mma_table.MMA_CONFIGS, (m.out_features, m.in_features, False), cfg)
    tiles = "sliding_store:32x4s1p3,sliding_query:32x4s1p3"
    steps = {}
    for af in (False, True):
        t = FuseLayers(backend="triton", int4_mma=True, norm_fold=True, attn_qkv=True, attn_tiles=tiles, attn_fold=af)
        t.apply(model)
        t.validate(model)
        assert t.describe()["attn_fold"] is af
        steps[af] = model.fused_decode
    calls = []
    real = da.decode_attention_qkv
    monkeypatch.setattr(da, "decode_attention_qkv", lambda *a, **k: calls.append(k.get("parts", False)) or real(*a, **k))
    outs = {}
    positions = (7, 3)  # the second step: two live splits (the cache's, its own row's) weighed
    for af, step in steps.items():
        model.fused_decode = step
        cache = KVCache(cfg_model, 1, 32, window=4, device="cpu", dtype=torch.bfloat16)
        outs[af] = [model.step(torch.tensor([[t]]), torch.tensor([[p]]), cache).float() for p, t in enumerate(positions)]
        assert calls.count(True) == (3 * len(positions) if af else 0) and len(calls) == 3 * len(positions)
        calls.clear()
    errs = [((got - want).abs().max() / want.abs().max()).item() for got, want in zip(outs[True], outs[False])]
    print("attn_fold vs the combine launch, max rel err per position:", errs)
    assert max(errs) <= 0.05, errs
    with pytest.raises(ValueError, match="norm_fold"):
        FuseLayers(backend="triton", int4_mma=True, attn_qkv=True, attn_fold=True)
    t = FuseLayers(backend="triton", int4_mma=True, qkv_kernel=True, batch_invariant=True, norm_fold=True,
                   attn_qkv=True, attn_fold=True)
    assert t.describe()["attn_fold"] is False
