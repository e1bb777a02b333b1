"""The end-of-sequence check that never drains the decode queue (engine/eos_watch.py): the lag's bound, the end
found, and a generator's tokens and step times against the plain per-token check. The side stream's copies need
CUDA; here a copier whose copies never land on their own stands in (the worst case: every read waits out the lag)."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from fastgemma.engine import eos_watch
from fastgemma.engine.cache import KVCache
from fastgemma.engine.eos_watch import EosWatch, ReadAtOnce, check_eos_lag, copies_for
from fastgemma.engine.generator import Generator
from fastgemma.engine.steps import StaticStep
from fastgemma.weights.synthetic import synthetic_model


class NeverLanded:
    """put(ids) keeps row 0's id; landed() is always False, so a copy is read only past the lag."""

    def __init__(self):
        self.unread = self.most_unread = 0

    def put(self, *srcs):
        self.unread += 1
        self.most_unread = max(self.most_unread, self.unread)
        return torch.cat([s.reshape(-1) for s in srcs]).clone()

    @staticmethod
    def landed(ticket) -> bool:
        return False

    def read(self, ticket) -> int:
        self.unread -= 1
        return ticket

    def close(self) -> None:
        pass


@pytest.fixture
def never_landed(monkeypatch):
    made = []

    def fake(device, lag, width=1):
        made.append(NeverLanded() if lag else ReadAtOnce())
        return made[-1]

    monkeypatch.setattr(eos_watch, "copies_for", fake)
    return made


@pytest.mark.parametrize("lag", [0, 1, 2, 5])
def test_the_end_is_found_lag_tokens_late_at_most(never_landed, lag):
    ids = [9, 8, 7, 3, 6, 3, 5, 4, 2, 1, 0, 11, 12]
    w = EosWatch({3}, "cpu", lag)
    found_at = None
    for n, t in enumerate(ids):
        w.push(torch.tensor([[t], [t]]), n)
        if w.end is not None and found_at is None:
            found_at = n
    assert w.end == 3 and found_at == 3 + lag  # the first end id, seen `lag` tokens after it was pushed
    if lag:
        assert never_landed[-1].most_unread == lag + 1


def test_a_landed_copy_is_read_at_once():
    class Landed(NeverLanded):
        @staticmethod
        def landed(ticket) -> bool:
            return True

    w = EosWatch({3}, "cpu", 0)
    w.copies, w.lag = Landed(), 4
    for n, t in enumerate([5, 3, 7]):
        w.push(torch.tensor([[t]]), n)
        if n == 1:
            assert w.end == 1
    assert w.end == 1 and not w.pending


def test_read_at_once_on_a_cpu_or_at_lag_zero():
    assert isinstance(copies_for("cpu", 4), ReadAtOnce) and isinstance(copies_for("cuda", 0), ReadAtOnce)
    got = ReadAtOnce.put(torch.tensor([3]), torch.tensor([[4, 5]]))
    assert ReadAtOnce.landed(got) and ReadAtOnce.read(got).tolist() == [3, 4, 5]


@pytest.mark.parametrize("bad", [-1, 65, 1.5, "2", None, True])
def test_a_bad_lag_is_refused(bad):
    with pytest.raises(ValueError, match="eos_lag must be an integer in \\[0, 64\\]"):
        check_eos_lag(bad)


@pytest.fixture(scope="module")
def model():
    from fastgemma.kernels.decode_attention import decode_attention_ref

    m = synthetic_model(TINY, "cpu", torch.float32, seed=3)
    m.step_attention = decode_attention_ref
    return m


def _generator(model, lag: int, static: bool = False):
    cache = KVCache(TINY, 1, 64, dtype=torch.float32)
    gen = Generator(model, cache, StaticStep(model, cache) if static else None)  # None: the eager step
    gen.set_eos_lag(lag)
    return gen


def _steps_run(gen) -> int:
    return gen.step.n if isinstance(gen.step, StaticStep) else len(gen.step.emitted)


@pytest.mark.parametrize("lag, end_at, static", [(0, 0, False), (0, 4, False), (1, 4, False), (3, 0, False),
                                                 (3, 4, False), (2, 4, True)])
def test_the_generator_keeps_the_plain_checks_tokens_and_runs_at_most_lag_steps_past_the_end(never_landed, model,
                                                                                              lag, end_at, static):
    gen = _generator(model, lag, static)
    prompt, new = [5, 6, 7], 12
    free = gen.generate(prompt, new).tokens
    eos = free[end_at]
    first = free.index(eos)  # (an id can come again before end_at: the first is the end)
    gen.eos = {eos}
    g = gen.generate(prompt, new, ignore_eos=False)
    assert g.tokens == free[: first + 1]
    assert _steps_run(gen) == min(first + lag, new - 1)  # the steps run: the end's, then `lag` more at most
    assert len(g.step_s) == len(g.tokens_per_step) == first  # the times of kept tokens only
    assert gen.generate(prompt, new, ignore_eos=True).tokens == free


def test_no_end_runs_to_the_limit(never_landed, model):
    gen = _generator(model, 2)
    free = gen.generate([1, 2], 10).tokens
    gen.eos = {10**6}
    g = gen.generate([1, 2], 10, ignore_eos=False)
    assert g.tokens == free and len(g.step_s) == 9 and _steps_run(gen) == 9


def test_the_factory_refuses_a_bad_lag():
    from fastgemma.build import EngineFactory

    with pytest.raises(ValueError, match="eos_lag must be an integer"):
        EngineFactory(TINY, None, None, torch.device("cpu"), torch.float32, eos_lag=-3)
