"""graphs.advance=kernel: the decode step's bookkeeping in one launch (kernels/step_advance.py) against its twin, the
four torch ops it replaces; a static step's tokens either way; bad buffers and a bad choice refused."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from fastgemma.engine.cache import KVCache
from fastgemma.engine.steps import StaticStep
from fastgemma.kernels.step_advance import advance_fn, step_advance, step_advance_ref
from fastgemma.weights.synthetic import synthetic_model


def _buffers(B, width, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (B, 1), generator=g), torch.randint(0, 1000, (B, 1), generator=g),
            torch.randint(0, 500, (B, 1), generator=g), torch.randint(0, 1000, (B, width), generator=g),
            torch.tensor([count])]


@pytest.mark.parametrize("B", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 6, 15])
def test_kernel_matches_the_four_ops(B, count):
    got, want = _buffers(B, 16, count), _buffers(B, 16, count)
    step_advance(*got)
    step_advance_ref(*want)
    for name, a, b in zip(("nxt", "tok", "pos", "out", "count"), got, want):
        assert torch.equal(a, b), name
    assert torch.equal(got[1], got[0]) and got[4].item() == count + 1 and torch.equal(got[3][:, count:count + 1], got[0])


def test_a_count_past_the_ids_writes_no_id_but_advances():
    bufs = _buffers(2, 8, 8)
    out0 = bufs[3].clone()
    step_advance(*bufs)
    assert torch.equal(bufs[3], out0) and bufs[4].item() == 9 and torch.equal(bufs[1], bufs[0])


def test_bad_buffers_are_refused():
    nxt, tok, pos, out, count = _buffers(2, 8, 0)
    with pytest.raises(ValueError, match="nxt must be int64 \\[2, 1\\]"):
        step_advance(nxt.int(), tok, pos, out, count)
    with pytest.raises(ValueError, match="pos must be int64"):
        step_advance(nxt, tok, pos[:1], out, count)
    with pytest.raises(ValueError, match="out must be int64 \\[2, width\\]"):
        step_advance(nxt, tok, pos, out.t(), count)
    with pytest.raises(ValueError, match="count must be int64 \\[1\\]"):
        step_advance(nxt, tok, pos, out, count.reshape(1, 1))


def test_the_kernel_is_the_cuda_pick():
    assert advance_fn("cuda") is step_advance and advance_fn("cpu") is step_advance_ref
    assert advance_fn("cpu", once=True) is step_advance_ref


def test_checked_once_checks_the_first_call_then_launches_as_the_kernel():
    once, plain = advance_fn("cuda", once=True), _buffers(2, 8, 0)
    with pytest.raises(ValueError, match="count must be int64"):  # the first call checks
        once(*_buffers(2, 8, 0)[:4], torch.zeros(1, 1, dtype=torch.long))
    once = advance_fn("cuda", once=True)
    got = _buffers(2, 8, 0)
    for _ in range(3):  # later calls: the bare launch, the same updates
        once(*got)
        step_advance(*plain)
    for name, a, b in zip(("nxt", "tok", "pos", "out", "count"), got, plain):
        assert torch.equal(a, b), name
    assert got[4].item() == 3


@pytest.mark.parametrize("B", [1, 2])
def test_static_steps_tokens_are_the_same_either_way(B):
    from fastgemma.kernels.decode_attention import decode_attention_ref

    model = synthetic_model(TINY, "cpu", torch.float32, seed=1)
    model.step_attention = decode_attention_ref
    runs = []
    for advance in ("ops", "kernel"):
        cache = KVCache(TINY, B, 64, dtype=torch.float32)
        step = StaticStep(model, cache, advance=advance)
        if advance == "kernel":
            assert step._advance is step_advance_ref  # a CPU step takes the twin ...
            step._advance = step_advance  # ... and the kernel runs under the interpreter here
        step.begin(3)
        tok = torch.tensor([[7], [9]][:B])
        for _ in range(5):
            tok = step(tok)
        runs.append((step.tokens().clone(), step.pos.clone(), step.count.clone()))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert runs[0][1].tolist() == [[8]] * B and runs[0][2].item() == 5


def test_a_bad_choice_is_refused():
    from fastgemma.transforms.graphs import CudaGraph

    model = synthetic_model(TINY, "cpu", torch.float32, seed=1)
    with pytest.raises(ValueError, match="advance must be ops .* or kernel .*, got 'fused'"):
        StaticStep(model, KVCache(TINY, 1, 16, dtype=torch.float32), advance="fused")
    with pytest.raises(ValueError, match="advance must be ops .* or kernel .*, got 'triton'"):
        CudaGraph(advance="triton")
    assert CudaGraph(advance="kernel").describe()["advance"] == "kernel"
