"""kernels/spec_accept.py against its twins (SpecGenerator's torch bookkeeping) under TRITON_INTERPRET=1:
random verify results with every accepted count 0..k, batches of 1 and 3, steps drafting past the
request's end, replay's reference clamped at its last column; and a whole spec=replay request equal
with either bookkeeping."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from fastgemma.engine.cache import KVCache
from fastgemma.engine.speculative import Replay, SpecGenerator
from fastgemma.kernels.spec_accept import accept, replay_drafts
import test_speculative

model, drafter = test_speculative.model, test_speculative.drafter  # the tiny target and drafter fixtures

STATE = ("tok", "pos", "hid", "out", "count", "n_log", "step_i", "hits", "tries", "drafts")


def _generator(model, drafter, batch, k, replay, fused):
    cache = KVCache(TINY, batch, 40, dtype=torch.float32)
    return SpecGenerator(model, cache, drafter, k, replay=Replay("frontier", seed=k) if replay else None,
                         fused_bookkeeping=fused)


def _randomize(g, seed):
    """A mid-request state: drafts agreeing with the targets for a random prefix of each row."""
    gen = torch.Generator().manual_seed(seed)
    B, k, V = g.drafts.shape[0], g.k, TINY.vocab_size
    g.targets.copy_(torch.randint(0, V, g.targets.shape, generator=gen))
    n = torch.randint(0, k + 1, (B,), generator=gen)
    n[0] = seed % (k + 1)  # every accepted count over the seeds
    d = (g.targets[:, :k] + 1) % V
    for b in range(B):  # draft n differs from its target; the ones after it are random (only the prefix counts)
        nb = int(n[b])
        d[b, :nb] = g.targets[b, :nb]
        if nb + 1 < k:
            d[b, nb + 1:] = torch.randint(0, V, (k - nb - 1,), generator=gen)
    g.drafts.copy_(d)
    g.rows_h.copy_(torch.randn(g.rows_h.shape, generator=gen))
    g.pos.copy_(torch.randint(5, 30, (B, 1), generator=gen))
    g.count.copy_(torch.randint(0, 8, (B,), generator=gen))
    g.step_i.fill_(seed % 5)
    g.hits.copy_(torch.randint(0, 4, g.hits.shape, generator=gen))
    g.tries.copy_(g.hits + torch.randint(0, 4, g.hits.shape, generator=gen))
    g.stat_end.copy_(g.pos + k + torch.randint(-1, 3, (B, 1), generator=gen))  # some steps past the end
    if g.replay is not None:
        g.ref.copy_(torch.randint(0, V, g.ref.shape, generator=gen))
        for b in range(B):  # most emitted tokens equal to the reference, some not
            at = int(g.pos[b]) + 1
            g.ref[b, at:at + k + 1] = torch.where(torch.rand(k + 1, generator=gen) < 0.6, g.targets[b],
                                                  g.ref[b, at:at + k + 1])
        g.ref_end.copy_(g.pos + torch.randint(0, k + 3, (B, 1), generator=gen))
        g.mismatch.copy_(torch.randint(0, 3, g.mismatch.shape, generator=gen))
        g.uniform.copy_(torch.rand(g.uniform.shape, generator=gen))


def _state(g):
    out = {n: getattr(g, n).clone() for n in STATE}
    if g.replay is not None:
        out["mismatch"] = g.mismatch.clone()
    return out


@pytest.mark.parametrize("batch,k,replay", [(1, 7, True), (1, 1, False), (3, 4, True), (3, 8, False), (1, 15, True)])
def test_accept_kernel_equals_the_torch_bookkeeping(model, drafter, batch, k, replay):
    gf = _generator(model, drafter, batch, k, replay, True)
    gt = _generator(model, drafter, batch, k, replay, False)
    for seed in range(k + 2):
        for g in (gf, gt):
            _randomize(g, seed)
        gf._accept()
        gt._accept()
        a, b = _state(gf), _state(gt)
        for name in a:
            assert torch.equal(a[name], b[name]), (seed, name, a[name], b[name])


@pytest.mark.parametrize("batch,k", [(1, 7), (3, 3), (1, 1), (2, 15)])
def test_replay_kernel_equals_the_torch_drafts(model, drafter, batch, k):
    gf = _generator(model, drafter, batch, k, True, True)
    gt = _generator(model, drafter, batch, k, True, False)
    for seed in range(4):
        for g in (gf, gt):
            _randomize(g, seed)
            g.pos[0, 0] = g.ref.shape[1] - 2  # drafts past the reference's last column read it (clamped)
        gf._set_replay_drafts()
        gt._set_replay_drafts()
        assert torch.equal(gf.drafts, gt.drafts), seed
        # the drafts right before the first rejected draw, wrong from it on
        u, p = gt.uniform[int(gt.step_i)], gt.profile
        first = int((u < p).long().cumprod(0).sum())
        idx = (gt.pos[0] + 1 + torch.arange(k)).clamp(max=gt.ref.shape[1] - 1)
        want = gt.ref[0, idx]
        assert torch.equal(gt.drafts[0, :first], want[:first]) and bool((gt.drafts[0, first:] != want[first:]).all())


def test_a_replay_request_is_the_same_with_either_bookkeeping(model, drafter):
    prompt, new = list(range(3, 15)), 16
    gens = [_generator(model, drafter, 1, 3, True, fused) for fused in (True, False)]
    out = []
    for g in gens:
        g.prime(prompt, new)
        out.append(g.generate(prompt, new))
    a, b = out
    assert a.tokens == b.tokens and a.accepted == b.accepted and a.tokens_per_step == b.tokens_per_step
    assert a.accept_hits == b.accept_hits and a.accept_tries == b.accept_tries
    assert a.replay_mismatch == b.replay_mismatch == 0


def test_bad_buffers_are_refused():
    B, k, H = 1, 3, 8
    z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt)  # noqa: E731
    args = dict(targets=z(B, k + 1), drafts=z(B, k), rows_h=z(B, k + 1, H, dt=torch.float32), out=z(B, 20),
                count=z(B), tok=z(B, 1), hid=z(B, 1, H, dt=torch.float32), pos=z(B, 1), hits=z(B, k),
                tries=z(B, k), n_log=z(B, 20), step_i=z(1), stat_end=z(B, 1))
    with pytest.raises(ValueError, match="targets"):
        accept(**dict(args, targets=z(B, k)))
    with pytest.raises(ValueError, match="rows_h must be .* torch.bfloat16"):  # hid and rows_h differ
        accept(**dict(args, hid=z(B, 1, H, dt=torch.bfloat16)))
    with pytest.raises(ValueError, match="together"):
        accept(**args, ref=z(B, 20))
    with pytest.raises(ValueError, match="profile"):
        replay_drafts(z(4, k, dt=torch.float32), z(k + 1, dt=torch.float32), z(1), z(B, 1), z(B, 20), z(B, k), 10)


def test_both_kernels_launch_one_warp(monkeypatch):
    """A program's threads must all read what accept updates in place before any writes it (its barrier);
    one warp keeps that cheap, and replay's drafts need no more."""
    from fastgemma.kernels import spec_accept

    seen = []

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((self.name, grid, kw["num_warps"]))

    monkeypatch.setattr(spec_accept, "_accept_kernel", Spy("accept"))
    monkeypatch.setattr(spec_accept, "_replay_kernel", Spy("replay"))
    B, k, H = 2, 3, 8
    z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt)  # noqa: E731
    accept(z(B, k + 1), z(B, k), z(B, k + 1, H, dt=torch.float32), z(B, 20), z(B), z(B, 1),
           z(B, 1, H, dt=torch.float32), z(B, 1), z(B, k), z(B, k), z(B, 20), z(1), z(B, 1))
    replay_drafts(z(4, k, dt=torch.float32), z(k, dt=torch.float32), z(1), z(B, 1), z(B, 20), z(B, k), 10)
    assert seen == [("accept", (1,), 1), ("replay", (1,), 1)]
