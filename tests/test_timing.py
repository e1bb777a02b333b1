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
