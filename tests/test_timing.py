"""metrics/timing.py on the CPU: step clocks and the setup phases a run logs before its clock."""
import logging

import pytest
import torch

from fastgemma.metrics.timing import StepClock, phase


def test_step_clock_intervals_between_marks():
    clock = StepClock(torch.device("cpu"))
    assert clock.intervals() == []
    for _ in range(3):
        clock.mark()
    gaps = clock.intervals()
    assert len(gaps) == 2 and all(g >= 0 for g in gaps)


def test_phase_logs_start_and_end_and_records_seconds(caplog):
    caplog.set_level(logging.INFO, logger="fastgemma")
    times = {}
    with phase("engine", times, torch.device("cpu")):
        sum(range(1000))
    assert list(times) == ["engine"] and times["engine"] >= 0
    assert [r.getMessage() for r in caplog.records][:1] == ["engine ..."]
    assert caplog.records[1].getMessage() == f"engine: {times['engine']:.1f} s"
    with pytest.raises(RuntimeError, match="capture failed"):
        with phase("prompt graphs", times):
            raise RuntimeError("capture failed")
    assert "prompt graphs" not in times  # a phase that raised records nothing


def test_phase_counts_the_graphs_torch_compile_compiled(caplog):
    """phase(..., compiles=d): the graphs torch.compile compiled inside the phase (a recompile adds
    one), recorded and logged; none: recorded as 0, nothing added to the line."""
    caplog.set_level(logging.INFO, logger="fastgemma")
    times, compiles = {}, {}
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    with phase("two shapes", times, compiles=compiles):
        f(torch.ones(3))
        f(torch.ones(3, 4))  # a new rank: a second graph
    with phase("nothing", times, compiles=compiles):
        f(torch.ones(3))
    assert compiles == {"two shapes": 2, "nothing": 0}
    ends = [r.getMessage() for r in caplog.records if ": " in r.getMessage()]
    assert ends[0].startswith("two shapes: ") and ends[0].endswith(" s (2 graphs compiled)")
    assert ends[1].startswith("nothing: ") and ends[1].endswith(" s")
