"""Split-KV decode attention: Triton kernel (CPU interpreter) vs torch twin vs a naive float64 loop.

The interpreter computes tl.dot on bf16 operands wrongly (~1e10 errors), so these tests use fp32
and fp16; bf16 is checked on the GPU.
"""
import math

import pytest
import torch

import fastgemma.kernels.attention_tiles as at

import fastgemma.kernels.decode_attention as da  # conftest.py set TRITON_INTERPRET=1 before this import
from conftest import Launches

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}  # (atol, rtol)


def _ring_slots(B, S, last_pos, holes=0, gen=None):
    """slot_pos [B, S] int32 of a ring buffer after writing positions 0..last_pos[b] (slot = pos % S)."""
    sp = torch.full((B, S), -1, dtype=torch.int32)
    for b in range(B):
        for p in range(last_pos[b] + 1):
            sp[b, p % S] = p
        if holes:
            sp[b, torch.randperm(S, generator=gen)[:holes]] = -1
    return sp


def _visible(kpos, qpos, window):
    return (kpos >= 0) & (kpos <= qpos) & ((window == 0) | (kpos > qpos - window))


def _make(B, T, Hkv, G, D, S, last_pos, window, ring, dtype, holes=0, seed=0):
    """Random q/k/v with q_pos rows last_pos[b]-T+1..last_pos[b]; every slot no row sees is NaN."""
    gen = torch.Generator().manual_seed(seed)
    H = Hkv * G
    q = torch.randn(B, T, H, D, generator=gen) * D ** -0.25
    k = torch.randn(B, S, Hkv, D, generator=gen) * D ** -0.25
    v = torch.randn(B, S, Hkv, D, generator=gen)
    q_pos = torch.stack([torch.arange(p - T + 1, p + 1) for p in last_pos])  # int64
    slot_pos = _ring_slots(B, S, last_pos, holes, gen) if ring else None
    kpos = slot_pos.long() if ring else torch.arange(S).expand(B, S)
    seen = _visible(kpos[:, None, :], q_pos[:, :, None], window).any(1)  # [B, S]
    k[~seen] = float("nan")
    v[~seen] = float("nan")
    return q.to(dtype), k.to(dtype), v.to(dtype), q_pos, slot_pos


def _naive(q, k, v, q_pos, slot_pos, window, scale):
    """Per-row loops, float64."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            qp = int(q_pos[b, t])
            keys = []
            for s in range(S):
                kp = s if slot_pos is None else int(slot_pos[b, s])
                if 0 <= kp <= qp and (window == 0 or kp > qp - window):
                    keys.append(s)
            if not keys:
                continue
            for h in range(H):
                kk = k[b, keys, h // G].double()
                sc = (kk @ q[b, t, h].double()) * scale
                p = torch.softmax(sc, dim=0)
                out[b, t, h] = p @ v[b, keys, h // G].double()
    return out


def _report(name, got, ref, dtype):
    atol, rtol = TOL[dtype]
    assert torch.isfinite(got).all(), f"{name}: non-finite output"
    err = (got.double() - ref.double()).abs()
    print(f"{name}: max abs err {err.max().item():.3e} mean {err.mean().item():.3e} (|ref| max "
          f"{ref.abs().max().item():.2f})")
    torch.testing.assert_close(got.double(), ref.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("ring,window,T,G", [
    (False, 0, 1, 4), (False, 7, 3, 1), (True, 12, 3, 4), (True, 12, 1, 1)])
def test_ref_matches_naive(ring, window, T, G):
    B, Hkv, D, S = 2, 2, 16, 16
    last = [29, 9] if ring else [13, 4]
    q, k, v, q_pos, slot_pos = _make(B, T, Hkv, G, D, S, last, window, ring, torch.float32, holes=2 * ring)
    got = da.decode_attention_ref(q, k, v, q_pos, slot_pos, window, scale=0.7)
    ref = _naive(q, k, v, q_pos, slot_pos, window, 0.7)
    _report(f"ref-vs-naive ring={ring} w={window} T={T} G={G}", got, ref, torch.float32)


# name, B, T, Hkv, G, D, S, last positions, window, ring, num_splits, dtype, holes
CASES = [
    # slot_pos=None, live context (<= 76) much shorter than S, NaN past it; splits past the live end
    ("full_short_ctx", 2, 1, 2, 4, 64, 300, [75, 40], 0, False, None, torch.float32, 0),
    ("full_short_ctx_16_splits", 2, 1, 2, 4, 32, 300, [75, 40], 0, False, 16, torch.float16, 0),
    # window shorter than the context: slots below the window are NaN too, S not a block multiple
    ("full_windowed_T8", 2, 8, 2, 4, 32, 257, [200, 130], 48, False, 3, torch.float16, 0),
    ("full_window_longer_than_ctx", 2, 1, 2, 1, 64, 200, [99, 17], 512, False, 2, torch.float32, 0),
    # live range 256 over 2 splits of BLOCK_N=64: 2 blocks per split
    ("full_two_blocks_per_split", 2, 1, 2, 4, 32, 400, [255, 200], 0, False, 2, torch.float32, 0),
    ("full_G1_T8", 2, 8, 2, 1, 64, 150, [120, 60], 0, False, 1, torch.float16, 0),
    # ring buffers: wrapped (unsorted slot_pos), evicted slots NaN
    ("ring_wrapped_T8", 2, 8, 2, 4, 64, 80, [300, 77], 64, True, None, torch.float16, 0),
    ("ring_partial_holes", 2, 1, 2, 4, 64, 80, [30, 5], 64, True, 1, torch.float32, 9),
    ("ring_T16_G4", 1, 16, 2, 4, 32, 48, [100], 32, True, 2, torch.float16, 0),
    ("ring_G1_T1", 2, 1, 2, 1, 32, 70, [181, 3], 64, True, 4, torch.float32, 0),
    # ring much longer than the window: a whole block sees nothing before the visible one
    ("ring_masked_block_first", 2, 1, 2, 4, 32, 160, [300, 250], 16, True, 1, torch.float32, 0),
    # E4B head dims, small S: D=256 (BLOCK_N=64) ring, D=512 (BLOCK_N=32) full
    ("ring_D256", 1, 2, 2, 4, 256, 40, [90], 32, True, None, torch.float16, 0),
    ("full_D512", 1, 2, 2, 4, 512, 100, [70], 0, False, None, torch.float32, 0),
    # G*T = 128 rows: two row tiles
    ("full_G8_T16_two_row_tiles", 1, 16, 1, 8, 32, 90, [60], 0, False, 2, torch.float32, 0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_ref(case):
    name, B, T, Hkv, G, D, S, last, window, ring, ns, dtype, holes = case
    q, k, v, q_pos, slot_pos = _make(B, T, Hkv, G, D, S, last, window, ring, dtype, holes=holes)
    scale = 1.0 if D >= 64 else 1 / math.sqrt(D) * 4
    ref = da.decode_attention_ref(q, k, v, q_pos, slot_pos, window, scale)
    got = da.decode_attention(q, k, v, q_pos, slot_pos, window, scale, num_splits=ns)
    assert got.shape == q.shape and got.dtype == dtype
    _report(name, got, ref, dtype)


def test_strided_views_and_int32_positions():
    """k/v as views into a fused [B, S, 2, Hkv, D] buffer, q a transposed view, int32 q_pos."""
    B, T, Hkv, G, D, S = 2, 4, 2, 4, 64, 130
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(B, S, 2, Hkv, D, generator=gen) * D ** -0.25
    q = (torch.randn(B, Hkv * G, T, D, generator=gen) * D ** -0.25).transpose(1, 2)
    q_pos = torch.tensor([[96, 97, 98, 99], [10, 11, 12, 13]], dtype=torch.int32)
    k, v = kv[:, :, 0], kv[:, :, 1]
    ref = da.decode_attention_ref(q, k, v, q_pos, None, 40)
    got = da.decode_attention(q, k, v, q_pos, None, 40, num_splits=3)
    _report("strided_views_int32_pos", got, ref, torch.float32)


@pytest.mark.parametrize("ns", [1, 3])
def test_row_without_visible_key_is_zero(ns):
    """Empty ring for batch 0 and a row whose window excludes every slot: zeros, not NaN."""
    B, T, Hkv, G, D, S = 2, 2, 2, 4, 32, 40
    q, k, v, _, _ = _make(B, T, Hkv, G, D, S, [20, 20], 0, False, torch.float32)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    slot_pos = _ring_slots(B, S, [-1, 10])  # batch 0: empty; batch 1: positions 0..10
    q_pos = torch.tensor([[5, 6], [39, 40]])  # batch 1: window 29 keeps kpos > 10, 11
    for name, fn in (("ref", da.decode_attention_ref),
                     ("kernel", lambda *a: da.decode_attention(*a, num_splits=ns))):
        out = fn(q, k, v, q_pos, slot_pos, 29)
        assert torch.isfinite(out).all()
        print(f"no_visible_key {name} ns={ns}: max |out| {out.abs().max().item():.1e}")
        assert out.abs().max().item() == 0.0


def test_split_heuristic():
    # E4B decode, B=1, 132 SMs: full layer 32k slots, sliding ring of 512 + 16 slots
    assert at.pick_num_splits(1, 2, 1, 32768, 32, 132) == 64
    assert at.pick_num_splits(1, 2, 1, 528, 64, 132) == 9
    assert at.pick_num_splits(64, 2, 1, 32768, 32, 132) == 2
    assert at.pick_num_splits(1, 2, 1, 10, 64, 132) == 1


def test_pdl_is_a_launch_option():
    """pdl=True changes no bit (the interpreter launches plainly; sm90_compile checks the wait and the
    trigger), through the launcher, the opaque op and the twin, which ignores it."""
    B, T, Hkv, G, D, S = 1, 2, 2, 4, 64, 70
    q, k, v, q_pos, slot_pos = _make(B, T, Hkv, G, D, S, [60], 32, True, torch.float32)
    plain = da.decode_attention(q, k, v, q_pos, slot_pos, 32, num_splits=2)
    assert torch.equal(da.decode_attention(q, k, v, q_pos, slot_pos, 32, num_splits=2, pdl=True), plain)
    assert torch.equal(da.decode_attention_op(q, k, v, q_pos, slot_pos, 32, 1.0, True),
                       da.decode_attention(q, k, v, q_pos, slot_pos, 32))
    assert torch.equal(da.decode_attention_ref(q, k, v, q_pos, slot_pos, 32, 1.0, True),
                       da.decode_attention_ref(q, k, v, q_pos, slot_pos, 32))


MERGE_CASES = [c for c in CASES if c[10] != 1][:6]


@pytest.mark.parametrize("case", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_merge_in_split_matches_combine(case):
    """merge=True: the row tile's last split program merges the partials (no combine launch):
    the twin's output within the dtype's tolerance, the combine kernel's to fp32 rounding, and the
    arrival counters back at zero for the next launch."""
    from fastgemma.kernels.counters import arrival_counters

    name, B, T, Hkv, G, D, S, last, window, ring, ns, dtype, holes = case
    q, k, v, q_pos, slot_pos = _make(B, T, Hkv, G, D, S, last, window, ring, dtype, holes=holes)
    scale = 1.0 if D >= 64 else 1 / math.sqrt(D) * 4
    combined = da.decode_attention(q, k, v, q_pos, slot_pos, window, scale, num_splits=ns)
    merged = da.decode_attention(q, k, v, q_pos, slot_pos, window, scale, num_splits=ns, merge=True)
    _report(name + "_merged", merged, da.decode_attention_ref(q, k, v, q_pos, slot_pos, window, scale), dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(merged.float(), combined.float(), rtol=tol, atol=tol)
    assert int(arrival_counters(q.device, 1).count_nonzero()) == 0


@pytest.mark.parametrize("splits,D,merged", [(7, 256, True), (8, 256, True), (9, 256, False), (4, 512, True),
                                             (5, 512, False)])
def test_merge_only_where_the_partials_are_few(monkeypatch, splits, D, merged):
    """merge=True merges in the split kernel where a tile's partials (splits rounded up to a power of
    two x the tile's rows x head dim) are at most MERGE_MAX_ELEMS values: E4B's sliding layers at one
    row (7 splits of 4 rows, D 256); beyond that (a full layer's 35-65 splits) the combine launches.
    Either way the output is the combine's to fp32 rounding."""
    gen = torch.Generator().manual_seed(splits)
    B, Hkv, G, S = 1, 2, 4, 96
    q = torch.randn(B, 1, Hkv * G, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen) * D ** -0.25
    v = torch.randn(B, S, Hkv, D, generator=gen)
    q_pos = torch.tensor([[90]])
    combined = da.decode_attention(q, k, v, q_pos, None, 0, num_splits=splits)
    launches = Launches(da._combine_kernel)
    monkeypatch.setattr(da, "_combine_kernel", launches)
    got = da.decode_attention(q, k, v, q_pos, None, 0, num_splits=splits, merge=True)
    assert launches.n == (0 if merged else 1)
    torch.testing.assert_close(got, combined, rtol=1e-6, atol=1e-6)
