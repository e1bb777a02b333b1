"""The drafter's centroid-masked head in two launches (kernels/draft_head.py) against its torch
twin under the interpreter: the same token ids on odd shapes (centroids of 24 tokens, hidden 48,
two rows), with exact ties among centroid scores and among candidate scores, in fp32, fp16 and
bf16; the twin against the drafter's own topk path; bad inputs refused."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from conftest import TINY
from fastgemma.kernels.counters import arrival_counters
from fastgemma.kernels.draft_head import _kth_largest, draft_head, draft_head_op, draft_head_ref
from fastgemma.model.drafter import synthetic_drafter


def _head(C=64, TPC=24, H=48, N=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    V = C * TPC
    return (torch.randn(N, H, generator=g).to(dtype), torch.randn(C, H, generator=g).to(dtype),
            torch.randperm(V, generator=g), torch.randn(V, H, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 5])
def test_kernel_equals_twin(dtype, top_k):
    g, wc, order, emb = _head(dtype=dtype, seed=top_k)
    for _ in range(2):  # twice: the row counters reset themselves
        got = draft_head(g, wc, order, emb, top_k)
        assert got.dtype == torch.int64 and got.tolist() == draft_head_ref(g, wc, order, emb, top_k).tolist()
        assert int(arrival_counters(g.device, 1).abs().sum()) == 0


def test_ties_go_to_the_lower_centroid_and_the_earlier_candidate():
    """Duplicated centroid rows (equal scores at the top-k boundary) and duplicated embedding rows
    (equal candidate scores across ranks): both ties broken as the twin breaks them (the lower
    centroid index ranks first, the earlier candidate in rank order wins)."""
    g, wc, order, emb = _head(C=32, TPC=8, H=16, N=1, seed=3)
    s = (wc @ g[0]).argsort(descending=True)
    wc[s[3]] = wc[s[2]]  # ranks 2 and 3 tie: top_k = 3 keeps only the lower centroid index
    table = order.view(32, 8)
    emb[table[s[0], 6]] = 4 * g[0]  # the best candidate score, in rank 0's centroid ...
    emb[table[s[1], 2]] = 4 * g[0]  # ... and, equal, in rank 1's
    hi = int(max(s[2], s[3]))  # of the tied centroids, the higher index ranks 3rd: outside the top 3
    emb[table[hi, 0]] = 5 * g[0]
    for k, want in ((3, int(table[s[0], 6])), (4, int(table[hi, 0]))):
        ref = draft_head_ref(g, wc, order, emb, k)
        assert draft_head(g, wc, order, emb, k).tolist() == ref.tolist() == [want]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_with_many_ties_and_signed_zeros(dtype):
    """Centroid scores from five values (0, -0, +-1, 2: the top_k boundary falls inside a run of
    equal scores at every top_k), C = 48 (not a power of two): the selection, the ranks and the
    pick equal the twin's for top_k = 1, 13 and 48 (every centroid)."""
    g, _, order, emb = _head(C=48, TPC=8, H=16, N=2, dtype=dtype, seed=5)
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0])
    pick = torch.randint(0, 5, (48,), generator=torch.Generator().manual_seed(6))
    # centroid rows e_0 * v: scores g[:, 0] * v; g[:, 0] = 1 makes them exactly the values above
    g[:, 0] = 1.0
    wc = torch.zeros(48, 16, dtype=dtype)
    wc[:, 0] = vals[pick].to(dtype)
    for k in (1, 13, 48):
        assert draft_head(g, wc, order, emb, k).tolist() == draft_head_ref(g, wc, order, emb, k).tolist(), k


def test_twin_equals_the_drafters_own_head():
    d = synthetic_drafter(TINY, dtype=torch.float32, seed=0)
    g = torch.randn(3, 1, d.config.hidden_size, generator=torch.Generator().manual_seed(1))
    want = d.next_token(g)
    me = d.masked_embedding
    args = (me.centroids.weight, me.token_ordering, d.model.embed_tokens.weight, d.top_k)
    assert draft_head_ref(g.reshape(3, -1), *args).tolist() == want.view(-1).tolist()
    assert draft_head_op(g.reshape(3, -1), *args).tolist() == want.view(-1).tolist()
    d.head_fn = draft_head_op  # what fuse=layers sets
    assert torch.equal(d.next_token(g), want)


def test_bad_inputs_are_refused():
    g, wc, order, emb = _head()
    with pytest.raises(ValueError, match="top_k must be in"):
        draft_head(g, wc, order, emb, 65)
    with pytest.raises(ValueError, match="token_ordering must be int64"):
        draft_head(g, wc, order.int(), emb, 4)
    with pytest.raises(ValueError, match="one hidden size and dtype"):
        draft_head(g.half(), wc, order, emb, 4)


@triton.jit
def _kth_probe(x_ptr, o_ptr, K, B: tl.constexpr, BITS: tl.constexpr):
    tl.store(o_ptr, _kth_largest(tl.load(x_ptr + tl.arange(0, B)), K, BITS))


@pytest.mark.parametrize("bits", [16, 32])
def test_kth_largest_is_the_sorted_keys_kth(bits):
    """The selection's threshold on its own: the K-th largest of the keys (with repeats) for every K,
    on keys spanning the whole signed range of their width (bf16 scores: 16 bits; fp32: 32), runs
    of equal keys, and the extremes of the range."""
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    sets = [torch.randint(lo, hi + 1, (64,), generator=g, dtype=torch.int64).to(torch.int32),
            torch.randint(-3, 4, (64,), generator=g, dtype=torch.int32),
            torch.tensor([lo, hi] * 32, dtype=torch.int32)]
    for x in sets:
        want = torch.sort(x, descending=True).values
        for k in (1, 2, 31, 32, 33, 64):
            o = torch.zeros(1, dtype=torch.int32)
            _kth_probe[(1,)](x, o, k, B=64, BITS=bits)
            assert o.item() == want[k - 1].item(), (k, x.tolist())


@pytest.mark.parametrize("splits", [1, 3, 8, 24])
def test_candidate_splits_pick_the_same_ids(splits):
    """Each centroid's candidates over 1..24 select programs (a split of 1 candidate included), ties in
    candidate scores across splits broken as the twin breaks them (the earlier candidate in rank order)."""
    from fastgemma.kernels.draft_head import candidate_splits

    g, wc, order, emb = _head(C=32, TPC=24, H=16, N=2, seed=splits)
    s = (wc @ g[0]).argsort(descending=True)
    table = order.view(32, 24)
    for pos in (20, 3):  # equal best scores in two splits of the first-ranked centroid (row 0's) ...
        emb[table[s[0], pos]] = 4 * g[0]
    emb[table[s[1], 1]] = 4 * g[0]  # ... and in the second-ranked one
    for k in (1, 2, 5):
        got = draft_head(g, wc, order, emb, k, splits=splits)
        assert got.tolist() == draft_head_ref(g, wc, order, emb, k).tolist()
        assert got[0] == table[s[0], 3]
    assert candidate_splits(24) == 4 and candidate_splits(128) == 4 and candidate_splits(6) == 3
    with pytest.raises(ValueError, match="divide"):
        draft_head(g, wc, order, emb, 2, splits=5)
