"""Where greedy decode meets an end-of-sequence id, found without draining the decode queue.

The plain check reads each new token on the host (`int(tok)`): a host sync a token, so the GPU idles while
the copy returns, Python checks the id and the next step's CUDA graph is launched (tens of us against a
~1.6 ms step). `EosWatch` copies each step's token on a side stream that waits only for the step that made
it (an event on the decode stream), into pinned host memory (`SideStreamCopies`), and the host reads a copy
once it has landed; it blocks on the oldest copy only when more than `lag` later tokens are pending. The
decode stream gets nothing but event records, so it keeps up to `lag` steps queued, and a request that ends
runs at most `lag` steps past its end (the generator drops their tokens). lag 0 reads every token at once,
the plain check; on a CPU every token is read at once too (no queue to drain).
"""
from __future__ import annotations

from collections import deque

import torch

from ..checks import is_int

EOS_LAG = 2  # decode steps queued past the EOS check (the config's `eos_lag`)


def check_eos_lag(lag) -> int:
    if not is_int(lag, 0, 64):
        raise ValueError(f"eos_lag must be an integer in [0, 64] (decode steps queued past the end-of-sequence "
                         f"check; 0: a host sync a token), got {lag!r}")
    return int(lag)


class SideStreamCopies:
    """Row 0's id of [B, 1] device tensors copied into pinned host slots on a side stream, each after the work
    queued so far on the current stream: put(ids) -> ticket; landed(ticket) without blocking; read(ticket) waits
    for that copy only. At most `slots` tickets may be unread at once."""

    def __init__(self, device, slots: int):
        self.side = torch.cuda.Stream(device)
        self.host = torch.empty(slots, dtype=torch.long, pin_memory=True)
        self.n = 0

    def put(self, ids: torch.Tensor):
        made = torch.cuda.Event()
        made.record()  # on the decode stream: after the step that made ids
        slot = self.host[self.n % self.host.numel()]
        self.n += 1
        with torch.cuda.stream(self.side):
            self.side.wait_event(made)
            slot.copy_(ids[0, 0], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.side)
        ids.record_stream(self.side)  # the allocator must not hand ids out again before the copy has read it
        return landed, slot

    @staticmethod
    def landed(ticket) -> bool:
        return ticket[0].query()

    @staticmethod
    def read(ticket) -> int:
        ticket[0].synchronize()
        return int(ticket[1])

    def close(self) -> None:
        self.side.synchronize()


def copies_for(device, lag: int):
    """The copier of a watch on `device`: side-stream copies on CUDA with lag > 0, else None (read at once)."""
    return SideStreamCopies(device, lag + 2) if lag > 0 and torch.device(device).type == "cuda" else None


class EosWatch:
    """push(ids, n) once the work that makes ids [B, 1] (the request's n-th token, from 0) is queued; `end`: the
    index of the first end id seen so far in row 0, or None. A token is seen once its copy has landed: at once
    with lag 0 or on a CPU, else when the host finds it landed or when more than `lag` later tokens are pending.
    ids must keep its value until its copy has landed: a step's own slot of its emitted ids (`emitted_at(i)`),
    not a buffer the next step overwrites. close() waits for the copies still in flight."""

    def __init__(self, eos, device, lag: int = EOS_LAG):
        self.eos = frozenset(int(e) for e in eos)
        self.lag = check_eos_lag(lag)
        self.copies = copies_for(device, self.lag)
        self.end = None
        self.pending = deque()  # (n, ticket) of copies not yet read, oldest first

    def push(self, ids: torch.Tensor, n: int) -> None:
        if self.end is not None:
            return
        if self.copies is None:
            if int(ids[0, 0]) in self.eos:
                self.end = n
            return
        self.pending.append((n, self.copies.put(ids)))
        while self.pending and self.end is None:  # the landed copies in order; the oldest waited for past the lag
            m, ticket = self.pending[0]
            if n - m < self.lag and not self.copies.landed(ticket):
                return
            self.pending.popleft()
            if self.copies.read(ticket) in self.eos:
                self.end = m

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()
