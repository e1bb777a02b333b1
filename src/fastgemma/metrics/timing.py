"""Step clocks: CUDA events on a GPU (no host sync inside the timed loop), perf_counter on a CPU; and
`phase`, the setup a run spends before its clock starts, logged and recorded."""
from __future__ import annotations

import contextlib
import logging
import time

import torch

log = logging.getLogger("fastgemma")


class StepClock:
    """mark() after each unit of work; intervals() -> seconds between consecutive marks."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if len(self.marks) < 2:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's count; a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def phase(name: str, times: dict, device=None, compiles: dict | None = None):
    """Log `name ...` when a setup phase starts (weights, compile and graph capture, warm-up: minutes
    on a GPU with torch.compile) and `name: X.X s` when it ends (after the device's queue drains),
    and record its seconds in times[name]; with `compiles`, also the number of graphs torch.compile
    compiled meanwhile in compiles[name] (logged when there were any). A phase that raises records
    nothing."""
    log.info("%s ...", name)
    t, graphs = time.perf_counter(), compiled_graphs()
    yield
    if device is not None:
        sync(device)
    times[name] = round(time.perf_counter() - t, 3)
    n = compiled_graphs() - graphs
    if compiles is not None:
        compiles[name] = n
    log.info("%s: %.1f s%s", name, times[name], f" ({n} graph{'s' * (n != 1)} compiled)" if n else "")
