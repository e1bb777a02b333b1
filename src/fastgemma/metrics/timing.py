"""Step clocks: CUDA events on a GPU (no host sync inside the timed loop), perf_counter on a CPU."""
from __future__ import annotations

import time

import torch


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
