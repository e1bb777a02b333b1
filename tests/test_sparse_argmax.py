"""Fused head GEMV + argmax: Triton kernel (CPU interpreter) vs torch twin on odd shapes, ties,
keepsets, stored logits, bad inputs; the pruned argmax equals the full one wherever the full argmax
is kept; the miss rate; the benchmark helper on a tiny head.

The interpreter computes tl.dot on bf16 wrongly (~1e10 errors), so these run fp32 and fp16; bf16 is
checked on the GPU (bench_head prints `ids ok`).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest
import torch

from fastgemma.kernels.sparse_argmax import (
    HeadArgmaxConfig, head_argmax, head_argmax_op, head_argmax_torch, head_raw_torch, softcap_torch,
)
from fastgemma.metrics.head import prune_miss_rate

N, K, V = 203, 72, 517  # N and K match no tile; K = 2 x 32 + 8 leaves a masked tail
GEMV = HeadArgmaxConfig(block_n=16, block_k=32, block_m=1)
DOT = HeadArgmaxConfig(block_n=32, block_k=32, block_m=16)
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}  # abs, on logits of size ~10


def _case(M, dtype, int8=False, keep=True, seed=0, n=N, k=K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, k, generator=g).to(dtype)
    if int8:
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g) * 0.02 + 0.001
    else:
        w, s = torch.randn(n, k, generator=g).to(dtype), None
    ids = torch.randperm(V, generator=g)[:n].sort().values if keep else None
    return x, w, s, ids


def _cfg(M):
    return GEMV if M == 1 else DOT


@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("int8", [False, True], ids=["dense", "int8"])
def test_kernel_matches_twin(M, dtype, int8):
    x, w, s, keep = _case(M, dtype, int8, seed=M)
    out_k = torch.full((M, V), float("-inf"))
    out_t = out_k.clone()
    ids_k = head_argmax(x, w, keep, scales=s, logits_out=out_k, softcap=30.0, config=_cfg(M))
    ids_t = head_argmax_torch(x, w, keep, scales=s, logits_out=out_t, softcap=30.0)
    assert ids_k.dtype == torch.int64 and ids_k.shape == (M,)
    kept = torch.zeros(V, dtype=torch.bool)
    kept[keep] = True
    assert torch.isinf(out_k[:, ~kept]).all() and (out_k[:, ~kept] < 0).all()
    err = (out_k[:, kept] - out_t[:, kept]).abs()
    print(f"M={M} {dtype} int8={int8}: logits max err {err.max():.2e} mean {err.mean():.2e}")
    assert err.max() < TOL[dtype]
    if dtype == torch.float32:
        assert torch.equal(ids_k, ids_t)
    else:  # fp16: the sum order may move a near-tie across a rounding boundary
        raw = head_raw_torch(x, w, s)
        pos = torch.searchsorted(keep, ids_k)
        assert (raw.gather(1, pos[:, None]).squeeze(1) >= raw.max(-1).values - TOL[dtype]).all()


@pytest.mark.parametrize("k,offset", [(72, 0), (70, 0), (72, 1)], ids=["words", "K%4", "unaligned rows"])
def test_int8_rows_one_row_read_as_words_or_bytes(k, offset):
    """One row of int8 rows: as int32 words (each code exact without I2F) where every row starts 4-byte
    aligned, else element by element; both give the twin's ids and logits (fp32 x: exact products)."""
    g = torch.Generator().manual_seed(k + offset)
    x = torch.randn(1, k, generator=g)
    base = torch.randint(-128, 128, (N, k + offset), generator=g, dtype=torch.int8)
    w = base[:, offset:] if offset else base  # offset 1: rows start 1 byte past an aligned address
    s = torch.rand(N, generator=g) * 0.02 + 0.001
    keep = torch.randperm(V, generator=g)[:N].sort().values
    for cfg in (GEMV, HeadArgmaxConfig(16, 64, 1, 2, 2), None):  # None: the int8 default (512 k)
        out_k = torch.full((1, V), float("-inf"))
        out_t = out_k.clone()
        ids_k = head_argmax(x, w, keep, scales=s, logits_out=out_k, softcap=30.0, config=cfg)
        ids_t = head_argmax_torch(x, w, keep, scales=s, logits_out=out_t, softcap=30.0)
        assert torch.equal(ids_k, ids_t), (k, offset, cfg)
        torch.testing.assert_close(out_k, out_t, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("M", [1, 3])
def test_full_head_without_keepset(M):
    x, w, _, _ = _case(M, torch.float32, keep=False, n=300)
    out_k, out_t = torch.empty(M, 300), torch.empty(M, 300)
    ids_k = head_argmax(x, w, None, logits_out=out_k, softcap=30.0, config=_cfg(M))
    ids_t = head_argmax_torch(x, w, None, logits_out=out_t, softcap=30.0)
    assert torch.equal(ids_k, ids_t)
    ref = softcap_torch(x @ w.T, 30.0)  # Gemma4Model.compute_logits
    torch.testing.assert_close(out_k, ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(ids_k, ref.argmax(-1))


@pytest.mark.parametrize("M", [1, 4])
def test_ties_go_to_the_lowest_id_across_blocks_and_reduce_chunks(M):
    # the same best row copied into several blocks: block_p 2 makes the reduce loop take 4 chunks
    x, w, _, keep = _case(M, torch.float32, n=120, seed=3)
    best = (x[0] @ w.T).argmax()
    for r in (5, 17, 64, 100, 119):
        w[r] = w[best]
    cfg = HeadArgmaxConfig(block_n=16, block_k=32, block_m=1 if M == 1 else 16, block_p=2)
    ids = head_argmax(x, w, keep, config=cfg)
    full = torch.full((M, V), float("-inf"))
    full[:, keep] = x @ w.T
    assert torch.equal(ids, full.argmax(-1))  # the first maximum over the whole vocabulary
    assert torch.equal(ids, head_argmax_torch(x, w, keep))
    assert int(ids[0]) == int(keep[min(5, int(best))])


def test_logits_only_and_the_registered_op():
    x, w, _, keep = _case(2, torch.float32, seed=4)
    out = torch.full((2, V), float("-inf"))
    assert head_argmax(x, w, keep, logits_out=out, softcap=30.0, want_ids=False, config=DOT) is None
    ref = torch.full((2, V), float("-inf"))
    head_argmax_torch(x, w, keep, logits_out=ref, softcap=30.0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    buf = torch.full((2, V), float("-inf"))
    ids = head_argmax_op(x, w, None, keep, buf, 30.0, True)
    assert torch.equal(ids, head_argmax_torch(x, w, keep)) and torch.equal(buf.isinf(), ref.isinf())


def test_strided_rows_of_hidden_states():
    # the sampler passes hidden[:, -1], a view with stride T * hidden
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 4, K, generator=g)
    _, w, _, keep = _case(1, torch.float32, seed=5)
    x = h[:, -1]
    assert not x.is_contiguous()
    assert torch.equal(head_argmax(x, w, keep, config=DOT), head_argmax_torch(x.contiguous(), w, keep))


def test_pruned_argmax_equals_full_argmax_where_kept():
    g = torch.Generator().manual_seed(6)
    M, Vf = 16, 400
    x = torch.randn(M, K, generator=g)
    E = torch.randn(Vf, K, generator=g)
    full_ids = softcap_torch(x @ E.T, 30.0).argmax(-1)
    keep = torch.randperm(Vf, generator=g)[:150].sort().values
    keep = torch.unique(torch.cat([keep, full_ids[:8]]))  # half the positions hit, the rest likely miss
    rows = E[keep]
    for ids in (head_argmax(x, rows, keep, softcap=30.0, config=DOT), head_argmax_torch(x, rows, keep)):
        hit = torch.isin(full_ids, keep)
        assert hit.sum() >= 8 and (~hit).sum() >= 1
        assert torch.equal(ids[hit], full_ids[hit])
        assert torch.isin(ids, keep).all()  # a miss still picks the best kept id
        best_kept = torch.full((M, Vf), float("-inf"))
        best_kept[:, keep] = x @ rows.T
        assert torch.equal(ids, best_kept.argmax(-1))
    rate = prune_miss_rate(full_ids, keep)
    assert rate == pytest.approx(float((~hit).sum()) / M)
    assert prune_miss_rate(full_ids, set(keep.tolist())) == rate
    assert prune_miss_rate(full_ids.tolist(), keep.tolist()) == rate


def test_miss_rate_edges():
    assert prune_miss_rate([1, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert prune_miss_rate(torch.tensor([[5, 6]]), [1]) == 1.0
    with pytest.raises(ValueError, match="no positions"):
        prune_miss_rate([], [1])
    with pytest.raises(ValueError, match="keepset is empty"):
        prune_miss_rate([1], [])


@pytest.mark.parametrize("fn", [head_argmax, head_argmax_torch], ids=["triton", "torch"])
def test_bad_inputs_are_refused(fn):
    x, w, s, keep = _case(2, torch.float32)
    with pytest.raises(ValueError, match="same K"):
        fn(x[:, :-1], w, keep)
    with pytest.raises(ValueError, match="dense rows must have x's dtype"):
        fn(x.half(), w, keep)
    with pytest.raises(ValueError, match="per-row scales"):
        fn(x, w.to(torch.int8), keep)
    with pytest.raises(ValueError, match="keep_ids must be int64"):
        fn(x, w, keep.int())
    with pytest.raises(ValueError, match="keep_ids must be int64"):
        fn(x, w, keep[:-1])
    with pytest.raises(ValueError, match="logits_out must be fp32"):
        fn(x, w, keep, logits_out=torch.empty(3, V))
    with pytest.raises(ValueError, match="N = 203 columns"):
        fn(x, w, None, logits_out=torch.empty(2, V))


# ---- int4 rows: the w4a16 GEMV with the argmax in its store ----------------------------------------
def _int4_case(M, dtype, G, keep=True, seed=0, n=N, k=256):
    from fastgemma.kernels.int4_pack import pack_int4, quantize_int4

    g = torch.Generator().manual_seed(seed)
    q, s, z = quantize_int4(torch.randn(n, k, generator=g), G, scale_dtype=dtype)
    x = torch.randn(M, k, generator=g).to(dtype)
    ids = torch.randperm(V, generator=g)[:n].sort().values if keep else None
    return x, pack_int4(q), s, z, ids


@pytest.mark.parametrize("M,dtype", [(1, torch.float32), (3, torch.float16)])
@pytest.mark.parametrize("G,words", [(32, False), (64, True), (128, False), (128, True)])
def test_int4_rows_pick_in_the_gemv_store(M, dtype, G, words):
    """head_argmax_int4's ids are argmax(w4a16_matmul) over the rows on the same tiles, bit for bit (the same
    sums, rounded to x's dtype as the GEMV's store rounds them), through the keepset; its logits are the
    softcapped GEMV outputs at their ids, -inf elsewhere; the byte and the word loop, odd N (a partial block)."""
    from fastgemma.kernels.sparse_argmax import head_argmax_int4
    from fastgemma.kernels.w4a16 import w4a16_matmul
    from fastgemma.kernels.w4a16_table import W4A16Config

    x, qw, sc, zr, keep = _int4_case(M, dtype, G, seed=G + M)
    cfg = W4A16Config(16 if words else 4, 128, 1, 2, words=words)
    raw = w4a16_matmul(x, qw, sc, zr, G, cfg).float()
    out = torch.full((M, V), float("-inf"))
    ids = head_argmax_int4(x, qw, sc, zr, G, keep, logits_out=out, softcap=30.0, config=cfg)
    assert ids.dtype == torch.int64 and torch.equal(ids, keep[raw.argmax(-1)])
    kept = torch.zeros(V, dtype=torch.bool)
    kept[keep] = True
    assert torch.isinf(out[:, ~kept]).all() and (out[:, ~kept] < 0).all()
    err = (out[:, keep] - softcap_torch(raw, 30.0)).abs().max().item()
    print(f"int4 M={M} {dtype} G={G} words={words}: logits max err {err:.2e} against the GEMV's")
    assert err < 1e-4
    # no keepset: row ids; a split config runs unsplit (the store needs whole sums): the same ids
    x, qw, sc, zr, _ = _int4_case(M, dtype, G, keep=False, seed=G)
    raw = w4a16_matmul(x, qw, sc, zr, G, cfg).float()
    assert torch.equal(head_argmax_int4(x, qw, sc, zr, G, config=cfg), raw.argmax(-1))
    split = W4A16Config(cfg.block_n, 128, 2, 2, words=words)
    assert torch.equal(head_argmax_int4(x, qw, sc, zr, G, config=split), raw.argmax(-1))


def test_int4_rows_logits_only_the_op_and_the_head():
    """want_ids=False stores the logits only; the registered op gives the launcher's ids and logits (and passes
    torch's schema and fake-tensor checks); Int4Rows on the Triton backend picks one row through it and agrees
    with its torch path (fp32: the same ids)."""
    from fastgemma.kernels.sparse_argmax import head_argmax_int4, head_argmax_int4_op
    from fastgemma.transforms.lm_head import Int4Rows

    x, qw, sc, zr, keep = _int4_case(1, torch.float32, 64, seed=9)
    out = torch.full((1, V), float("-inf"))
    assert head_argmax_int4(x, qw, sc, zr, 64, keep, logits_out=out, softcap=30.0, want_ids=False) is None
    buf = torch.full((1, V), float("-inf"))
    ids = head_argmax_int4_op(x, qw, sc, zr, 64, keep, buf, 30.0)
    assert torch.equal(buf, out) and torch.equal(ids, head_argmax_int4(x, qw, sc, zr, 64, keep))
    torch.library.opcheck(head_argmax_int4_op, (x, qw, sc, zr, 64, keep, buf, 30.0),
                          test_utils=("test_schema", "test_faketensor"))  # what torch.compile traces
    g = torch.Generator().manual_seed(10)
    w, h = torch.randn(N, 256, generator=g), torch.randn(2, 256, generator=g)
    heads = {b: Int4Rows(w, V, 30.0, keep, 64, b) for b in ("triton", "torch")}
    for M in (1, 2):  # one row: the GEMV's store; two: the GEMM, then argmax
        got = {b: (hd.pick(h[:M], torch.full((M, V), float("-inf"))), hd.pick(h[:M])) for b, hd in heads.items()}
        assert torch.equal(got["triton"][0], got["torch"][0]) and torch.equal(got["triton"][1], got["torch"][0])
    with pytest.raises(ValueError, match="batch-invariant"):
        heads["triton"].pick(h[:1], row_invariant=True)


def test_int4_rows_bad_inputs_are_refused():
    from fastgemma.kernels.sparse_argmax import head_argmax_int4
    from fastgemma.kernels.w4a16_table import W4A16Config

    x, qw, sc, zr, keep = _int4_case(2, torch.float32, 64)
    with pytest.raises(ValueError, match="uint8 \\[N, K/2\\]"):
        head_argmax_int4(x[:, :-2], qw, sc, zr, 64, keep)
    with pytest.raises(ValueError, match="uint8"):
        head_argmax_int4(x, qw.view(torch.int8), sc, zr, 64, keep)
    with pytest.raises(ValueError, match="scales / zeros must be \\[K/G, N\\]"):
        head_argmax_int4(x, qw, sc, zr, 32, keep)
    with pytest.raises(ValueError, match="x's dtype"):
        head_argmax_int4(x, qw, sc.half(), zr.half(), 64, keep)
    with pytest.raises(ValueError, match="keep_ids must be int64"):
        head_argmax_int4(x, qw, sc, zr, 64, keep[:-1])
    with pytest.raises(ValueError, match="one-row GEMV"):
        head_argmax_int4(x, qw, sc, zr, 64, keep, config=W4A16Config(32, 128, 1, 4, 3, 16, per_group=True))


def test_bench_head_runs_on_a_tiny_head(capsys):
    from fastgemma.bench.head import bench_head

    rows = bench_head(ms=(1,), rows=(40,), dtype=torch.float32, device="cpu", vocab=200, hidden=64,
                      group_size=32, timer=lambda fn: (fn(), 1.0)[1])
    assert {r["dtype"] for r in rows} == {"fp32", "int8", "int4"}
    assert all(r["ids_ok"] in (True, None) for r in rows)
    int8 = {(r["head"], r["path"]) for r in rows if r["dtype"] == "int8"}
    assert {("full", "fused ids, int8 elements"), ("pruned 40", "fused ids, int8 elements")} <= int8
    int4 = {(r["head"], r["path"]) for r in rows if r["dtype"] == "int4"}
    for head in ("full", "pruned 40"):  # the GEMV's argmax store beside the GEMV, then torch's argmax
        assert {(head, "int4 GEMV, then argmax"), (head, "fused (ids only)"), (head, "fused (+logits)")} <= int4
    assert "fused (ids only)" in capsys.readouterr().out
