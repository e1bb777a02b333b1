"""kernels/decode_attention.py's q/k/v mode (`decode_attention_qkv`: qkv_finish's work inside the split
kernel) under the interpreter against its twin (qkv_finish_ref, then decode_attention_ref): store and
query-only layers, ring buffers (wrapped, a window shorter than the context) and full-layer caches,
1 to 8 rows, 1 to 4 splits and the merge option, head dims 32 and 64, fp32 and fp16, Gemma 3's layers
without a v norm. The cache's rows at the step's own positions hold NaN before the call (a rejected
draft's, or a ring slot just reassigned): the kernel must make them, never read them. Both caches
must end as the twin leaves them."""
import math

import pytest
import torch

import fastgemma.kernels.attention_tiles as at
import fastgemma.kernels.decode_attention as da  # conftest.py set TRITON_INTERPRET=1 before this import
from fastgemma.model.layers import rope_cos_sin, rope_inv_freq

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def _case(B, T, Hkv, G, D, S, last, window, ring, dtype, store, seed=0):
    """qkv rows of positions last[b]-T+1 .. last[b]; caches filled for the positions before, NaN
    where no row may look (invisible slots, and the step's own slots: made by the call)."""
    gen = torch.Generator().manual_seed(seed)
    H = Hkv * G
    hk = Hkv if store else 0
    qkv = (torch.randn(B, T, (H + 2 * hk) * D, generator=gen) * 2).to(dtype)
    qw = (torch.rand(D, generator=gen) + 0.5).to(dtype)
    kw = (torch.rand(D, generator=gen) + 0.5).to(dtype) if store else None
    q_pos = torch.stack([torch.arange(p - T + 1, p + 1) for p in last])
    cos, sin = rope_cos_sin(q_pos, rope_inv_freq(D, 10000.0, 1.0), dtype)
    k = (torch.randn(B, S, Hkv, D, generator=gen) * D ** -0.25).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    if ring:
        slot_pos = torch.full((B, S), -1, dtype=torch.int32)
        for b in range(B):
            for p in range(last[b] + 1):  # the step's own slots already carry their new positions
                slot_pos[b, p % S] = p
        kpos = slot_pos.long()
    else:
        slot_pos = None
        kpos = torch.arange(S).expand(B, S)
    qp = q_pos[:, :, None]
    seen = ((kpos[:, None] >= 0) & (kpos[:, None] <= qp) & ((window == 0) | (kpos[:, None] > qp - window))).any(1)
    own = kpos >= q_pos[:, :1]  # the step's rows (and, full layers, every slot past them)
    k[~seen | own] = float("nan")
    v[~seen | own] = float("nan")
    idx = (q_pos % S) if ring else q_pos
    return qkv, qw, kw, cos, sin, k, v, idx, q_pos, slot_pos


# name, B, T, Hkv, G, D, S, last positions, window, ring, num_splits, dtype
CASES = [
    ("ring_decode", 2, 1, 2, 4, 64, 48, [100, 20], 40, True, None, torch.float32),
    ("ring_verify_wrapped", 1, 8, 2, 4, 32, 40, [77], 32, True, 3, torch.float16),
    ("ring_window_over_ctx", 2, 5, 2, 2, 32, 70, [30, 8], 64, True, 2, torch.float32),
    ("full_decode", 2, 1, 2, 4, 64, 200, [130, 41], 0, False, None, torch.float32),
    ("full_verify_one_split", 1, 8, 2, 4, 32, 100, [60], 0, False, 1, torch.float16),
    ("full_verify_4_splits", 2, 3, 1, 4, 32, 90, [70, 33], 0, False, 4, torch.float32),
]


@pytest.mark.parametrize("store", [True, False], ids=["store", "query_only"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_twin(case, store):
    name, B, T, Hkv, G, D, S, last, window, ring, ns, dtype = case
    qkv, qw, kw, cos, sin, k, v, idx, q_pos, slot_pos = _case(B, T, Hkv, G, D, S, last, window, ring, dtype, store)
    if not store:  # a query-only layer reads a cache its source layer already wrote: no NaN where rows look
        k, v = k.nan_to_num(0.5), v.nan_to_num(0.5)
    scale = 1.0 if D >= 64 else 4 / math.sqrt(D)
    kw_ = dict(heads=Hkv * G, eps=1e-6, offset=0.0, scale=scale)
    k2, v2 = k.clone(), v.clone()
    ref = da.decode_attention_qkv_ref(qkv, qw, kw, cos, sin, k2, v2, idx, q_pos, slot_pos, window, **kw_)
    got = da.decode_attention_qkv(qkv, qw, kw, cos, sin, k, v, idx, q_pos, slot_pos, window, num_splits=ns, **kw_)
    assert got.shape == (B, T, Hkv * G, D) and got.dtype == dtype and torch.isfinite(got).all(), name
    err = (got.double() - ref.double()).abs().max().item()
    print(f"{name} store={store}: max abs err {err:.2e}")
    torch.testing.assert_close(got, ref, **TOL[dtype])
    # the caches: the step's rows as the twin wrote them (store), nothing else touched
    torch.testing.assert_close(k.nan_to_num(7.0), k2.nan_to_num(7.0), **TOL[dtype])
    torch.testing.assert_close(v.nan_to_num(7.0), v2.nan_to_num(7.0), **TOL[dtype])


@pytest.mark.parametrize("v_norm", [True, False])
def test_merge_pdl_and_no_v_norm(v_norm):
    """The merge option (the split tile's last program merges: no combine launch) and the PDL
    option change nothing but rounding order; without a v norm (Gemma 3) the rows go in as they are."""
    qkv, qw, kw, cos, sin, k, v, idx, q_pos, slot_pos = _case(1, 4, 2, 4, 32, 60, [50], 24, True, torch.float32, True,
                                                              seed=3)
    kw_ = dict(heads=8, eps=1e-6, offset=1.0, v_norm=v_norm)
    outs = []
    for opts in (dict(num_splits=3), dict(num_splits=3, merge=True, pdl=True)):
        kc, vc = k.clone(), v.clone()
        outs.append((da.decode_attention_qkv(qkv, qw, kw, cos, sin, kc, vc, idx, q_pos, slot_pos, 24, **kw_, **opts),
                     kc, vc))
    kc, vc = k.clone(), v.clone()
    ref = da.decode_attention_qkv_ref(qkv, qw, kw, cos, sin, kc, vc, idx, q_pos, slot_pos, 24, **kw_)
    for got, kg, vg in outs:
        torch.testing.assert_close(got, ref, **TOL[torch.float32])
        torch.testing.assert_close(vg.nan_to_num(7.0), vc.nan_to_num(7.0), **TOL[torch.float32])
    # the ops (what the fused steps call) give the launcher's output
    kc, vc = k.clone(), v.clone()
    op = da.decode_attention_qkv_store_op(qkv, qw, kw, cos, sin, kc, vc, idx, q_pos, slot_pos, 24, 8, 1e-6, 1.0,
                                          v_norm, 1.0, False, False)
    torch.testing.assert_close(op, ref, **TOL[torch.float32])
    q_only = da.decode_attention_qkv_op(qkv[..., : 8 * 32], qw, cos, sin, kc, vc, q_pos, slot_pos, 24, 8, 1e-6, 1.0,
                                        1.0, False, False)
    assert q_only.shape == (1, 4, 8, 32) and torch.isfinite(q_only).all()
    # their `tiles` (fuse.attn_tiles' per-kind value): the same output on other tiles, and the fakes
    # (what torch.compile traces) take it
    kc, vc = k.clone(), v.clone()
    tiled = da.decode_attention_qkv_store_op(qkv, qw, kw, cos, sin, kc, vc, idx, q_pos, slot_pos, 24, 8, 1e-6, 1.0,
                                             v_norm, 1.0, False, False, "16x2s1")
    torch.testing.assert_close(tiled, ref, **TOL[torch.float32])
    kc, vc = k.clone(), v.clone()  # with the cache's split count too (its own-rows split added)
    split2 = da.decode_attention_qkv_store_op(qkv, qw, kw, cos, sin, kc, vc, idx, q_pos, slot_pos, 24, 8, 1e-6, 1.0,
                                              v_norm, 1.0, False, False, "16x2s1p2")
    torch.testing.assert_close(split2, ref, **TOL[torch.float32])
    assert at._tiles_arg("16x2s1p2") == dict(tiles=(16, 2, 1), num_splits=2, early=None)
    assert at._tiles_arg("") == dict(tiles=None, num_splits=None, early=None)
    assert at._tiles_arg("16x2s1e0") == dict(tiles=(16, 2, 1), num_splits=None, early=False)
    for text in ("32x8s2p3", "32x8s2p3e1", "32x8s2e0", "32x8s2e2"):
        assert at.qkv_tile_text(*at.parse_qkv_tile(f" {text} ")) == text
    torch.testing.assert_close(da.decode_attention_qkv_op(qkv[..., : 8 * 32], qw, cos, sin, kc, vc, q_pos, slot_pos,
                                                          24, 8, 1e-6, 1.0, 1.0, False, False, "32x4s2"),
                               q_only, **TOL[torch.float32])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = da.decode_attention_qkv_store_op(qkv, qw, kw, cos, sin, kc, vc, idx, q_pos, slot_pos, 24, 8, 1e-6, 1.0,
                                                v_norm, 1.0, False, False, "16x2s1")
    assert fake.shape == ref.shape


def test_bad_inputs_are_refused():
    qkv, qw, kw, cos, sin, k, v, idx, q_pos, slot_pos = _case(1, 2, 2, 4, 32, 40, [20], 16, True, torch.float32, True)
    with pytest.raises(ValueError, match="qkv's last dim"):
        da.decode_attention_qkv(qkv[..., :-32], qw, kw, cos, sin, k, v, idx, q_pos, slot_pos, 16, heads=8, eps=1e-6)
    with pytest.raises(ValueError, match="bad position shapes"):
        da.decode_attention_qkv(qkv, qw, kw, cos, sin, k, v, idx, q_pos[:, :1], slot_pos, 16, heads=8, eps=1e-6)
    with pytest.raises(ValueError, match="contiguous along the head dim"):
        da.decode_attention_qkv(qkv, qw, kw, cos, sin, k.transpose(2, 3).contiguous().transpose(2, 3), v, idx,
                                q_pos, slot_pos, 16, heads=8, eps=1e-6)


def test_tiles_override_matches_twin_and_bad_tiles_are_refused():
    """bench.attention --qkv's rows on a CPU (interpreter, fp32, small shapes): the plain path
    (qkv_finish + split + combine) and the q/k/v mode with its default and other tiles all equal the
    twin; tiles the kernel cannot take are refused by name."""
    from fastgemma.bench.attention import main, qkv_paths, qkv_rows

    assert [t for _, t in qkv_paths([(16, 4, 1), at._qkv_tiles(64)], 64)] == [at._qkv_tiles(64), (16, 4, 1)]
    for D, S, ctx, ring, window in [(64, 24, 60, True, 20), (32, 80, 50, False, 0)]:
        rows = qkv_rows(D, S, ctx, ring, window, [(16, 4, 1), (32, 2, 2)], dev="cpu", timer=lambda fn: 0.0,
                        dtype=torch.float32, splits=(None, 3))
        paths = ["qkv_finish + split + combine", f"q/k/v mode {'x'.join(map(str, at._qkv_tiles(D)[:2]))}s2",
                 "q/k/v mode 16x4s1", "q/k/v mode 32x2s2"]
        assert [r[0].split(" (")[0] for r in rows] == paths * 2
        assert [r[1] for r in rows[4:]] == [3, 4, 4, 4]  # the q/k/v mode: one split more, for its own rows
        for path, splits, err, _ in rows:
            print(f"D={D} ring={ring} {path}: splits {splits}, rel err {err:.1e}")
            assert splits >= 1 and err < 1e-5, path
    # a query-only layer (q rows alone, the cache only read), merged: no own-rows split, no combine
    rows = qkv_rows(32, 80, 50, False, 0, [(16, 4, 1)], dev="cpu", timer=lambda fn: 0.0, dtype=torch.float32,
                    splits=(3,), store=False, merge=True)
    assert [r[:2] for r in rows] == [("qkv_finish + split", 3), (rows[1][0], 3), ("q/k/v mode 16x4s1", 3)]
    assert all(r[2] < 1e-5 for r in rows), rows
    assert at._qkv_tiles(512) == (32, 4, 2) and at._qkv_tiles(512, 32) == (16, 8, 2)  # one row / 8 rows
    # one row of a store full layer over a short cache: 16 warps (not a query-only layer, not 8 rows)
    short = at.SHORT_CACHE
    assert at._qkv_tiles(512, 16, short) == (32, 16, 2) and at._qkv_tiles(512, 16, short + 1) == (32, 4, 2)
    assert at._qkv_tiles(512, 16, short, store=False) == (32, 4, 2) and at._qkv_tiles(512, 32, short) == (16, 8, 2)
    assert at._qkv_tiles(256, 16, short) == (32, 8, 2)
    assert qkv_paths([], 512, short)[0] == ("q/k/v mode 32x16s2 (default)", (32, 16, 2))
    assert at.parse_tiles(" 32x8s2 ") == (32, 8, 2)
    for bad in ("24x8s2", "8x8s2", "32x3s2", "32x8s0", "32x8"):
        with pytest.raises(ValueError, match="tiles"):
            at.parse_tiles(bad)
    with pytest.raises(ValueError, match="tiles"):
        at.check_tiles((32, 8))
    with pytest.raises(SystemExit, match="BLOCKNxWARPSsSTAGES"):
        main(["--qkv", "--tiles", "32x8"])
    with pytest.raises(SystemExit, match="--splits"):
        main(["--qkv", "--splits", "auto,0"])
    with pytest.raises(SystemExit, match="--sliding-splits"):
        main(["--qkv", "--sliding-splits", "2,x"])
    with pytest.raises(SystemExit, match="--sliding-splits"):
        main(["--qkv", "--sliding-splits", "0"])
    with pytest.raises(SystemExit, match="--contexts must lie"):
        main(["--qkv", "--contexts", "300,99999"])


@pytest.mark.parametrize("parts", [False, True], ids=["out", "parts"])
@pytest.mark.parametrize("store", [True, False], ids=["store", "query_only"])
def test_first_block_early_equals_late(store, parts, monkeypatch):
    """The split's first K / V block loaded before the PDL wait (into registers: `early_block`'s pick for the
    sliding layers at one row, or the tiles' 'e1'; 'e2': the q rows' cos / sin too) is the same arithmetic as
    the loop's first block: bit-equal outputs and caches with it on and off (the pick through EARLY_BYTES, then
    the ops' tile text), over splits of several blocks (the loop after it runs), empty splits and a ring."""
    # one row: a ring of 100 slots over 16-key blocks (2 splits of 4 blocks), a full cache of 200 slots with
    # 41 positions (later splits empty)
    for S, last, window, ring, ns in [(100, [90], 64, True, 2), (200, [41], 0, False, 4)]:
        case = _case(1, 1, 2, 4, 32, S, last, window, ring, torch.float32, store, seed=5)
        qkv, qw, kw, cos, sin, k, v, idx, q_pos, slot_pos = case
        if not store:
            k, v = k.nan_to_num(0.5), v.nan_to_num(0.5)
        assert at.early_block(2 if store else 1, 16, 16, 32, 4, 2)  # this launch's tile (16x2s1, fp32)
        outs = []
        for budget, tiles in ((0, None), (10 ** 6, None), (None, f"16x2s1p{ns}e0"), (None, f"16x2s1p{ns}e1"),
                              (None, f"16x2s1p{ns}e2")):
            kc, vc = k.clone(), v.clone()
            if tiles is None:  # decode_attention_qkv, early_block's pick
                monkeypatch.setattr(at, "EARLY_BYTES", budget)
                got = da.decode_attention_qkv(qkv, qw, kw, cos, sin, kc, vc, idx, q_pos, slot_pos, window, heads=8,
                                              eps=1e-6, num_splits=ns, tiles=(16, 2, 1), parts=parts)
            else:  # the ops the fused steps call, with fuse.attn_tiles' text
                args = (qkv, qw, kw, cos, sin, kc, vc, idx, q_pos, slot_pos, window, 8, 1e-6, 0.0, True, 1.0, False)
                if not store:
                    args = (qkv, qw, cos, sin, kc, vc, q_pos, slot_pos, window, 8, 1e-6, 0.0, 1.0, False)
                if parts:
                    op = da.decode_attention_qkv_store_parts_op if store else da.decode_attention_qkv_parts_op
                    got = op(*args, tiles)
                else:
                    op = da.decode_attention_qkv_store_op if store else da.decode_attention_qkv_op
                    got = op(*args, False, tiles)
            outs.append((got if parts else (got,), kc, vc))
        (late, kl, vl) = outs[0]
        for other, ko, vo in outs[1:]:
            for a, b in zip(late, other):
                assert torch.equal(a, b), (S, store, parts)
            assert torch.equal(kl.nan_to_num(7.0), ko.nan_to_num(7.0))
            assert torch.equal(vl.nan_to_num(7.0), vo.nan_to_num(7.0))
    # E4B (bf16): the sliding layers at one row take it early; full layers and 8-row tiles do not
    assert at.early_block(2, 16, 32, 256, 2, 8) and at.early_block(1, 16, 32, 256, 2, 8)
    assert not at.early_block(0, 16, 32, 256, 2, 8)  # q as given: q comes first, after the wait
    assert not at.early_block(2, 16, 32, 512, 2, 16) and not at.early_block(1, 16, 32, 512, 2, 4)
    assert not at.early_block(2, 32, 32, 256, 2, 8) and not at.early_block(1, 16, 32, 256, 2, 8, per_position=True)
    with pytest.raises(ValueError, match="EARLY"):
        at.parse_qkv_tile("32x8s2e3")
    assert at.parse_qkv_tiles("sliding_store:32x8s2e0, sliding_query:32x8s2p6e1") == {
        "sliding_store": "32x8s2e0", "sliding_query": "32x8s2p6e1"}
