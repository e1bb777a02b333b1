"""Where decode meets an end-of-sequence id (and, speculative, how far it got), read without draining the queue.

The plain check reads each new token on the host (`int(tok)`): a host sync a token, so the GPU idles while
the copy returns, Python checks the id and the next step's CUDA graph is launched (20 us against a 1.63 ms
step on an H100, run LM). Here each step's token (speculative: its count and the ids it may have written) is
copied on a side stream that waits only for the step that made it (an event on the decode stream), into pinned
host memory (`SideStreamCopies`); the host reads a copy once it has landed and blocks on the oldest copy only
when more than `lag` later steps are pending. The decode stream gets nothing but event records, so it keeps up
to `lag` steps queued, and a request that ends runs at most `lag` steps past its end (the generator drops their
tokens). lag 0 reads every step at once (`ReadAtOnce`, the plain check), as does a CPU (no queue to drain).
"""
from __future__ import annotations

import functools
from collections import deque

import torch

from ..checks import is_int

EOS_LAG = 2  # decode steps queued past the end-of-sequence check (the config's `eos_lag`)


def check_eos_lag(lag) -> int:
    if not is_int(lag, 0, 64):
        raise ValueError(f"eos_lag must be an integer in [0, 64] (decode steps queued past the end-of-sequence "
                         f"check; 0: a host sync a step), got {lag!r}")
    return int(lag)


class ReadAtOnce:
    """The copier's twin: put(*srcs) reads the 1-D tensors at once (a host sync on a GPU) -> ticket; landed is
    always true; read(ticket) -> their values, concatenated, as a CPU int64 tensor."""

    @staticmethod
    def put(*srcs):
        return torch.cat([s.reshape(-1) for s in srcs]).to("cpu", torch.long)

    @staticmethod
    def landed(ticket) -> bool:
        return True

    @staticmethod
    def read(ticket):
        return ticket

    def close(self) -> None:
        pass


class SideStreamCopies:
    """1-D int64 device tensors copied into a pinned host row on a side stream, after the work queued so far on
    the current stream: put(*srcs) -> ticket; landed(ticket) without blocking; read(ticket) waits for that copy
    only -> the row's values (a CPU view, valid until `slots` more puts). At most `slots` tickets unread at once;
    a row holds `width` values; sources must keep their values until their copy lands."""

    def __init__(self, device, slots: int, width: int):
        self.side = torch.cuda.Stream(device)
        self.host = torch.empty(slots, width, dtype=torch.long, pin_memory=True)
        self.n = 0

    def put(self, *srcs):
        made = torch.cuda.Event()
        made.record()  # on the decode stream: after the step that made srcs
        row = self.host[self.n % self.host.shape[0]]
        self.n += 1
        at = 0
        with torch.cuda.stream(self.side):
            self.side.wait_event(made)
            for s in srcs:
                row[at:at + s.numel()].copy_(s, non_blocking=True)
                at += s.numel()
            landed = torch.cuda.Event()
            landed.record(self.side)
        for s in srcs:
            s.record_stream(self.side)  # the allocator must not hand s out again before the copy has read it
        return landed, row[:at]

    @staticmethod
    def landed(ticket) -> bool:
        return ticket[0].query()

    @staticmethod
    def read(ticket):
        ticket[0].synchronize()
        return ticket[1]

    def close(self) -> None:
        self.side.synchronize()


def copies_for(device, lag: int, width: int = 1):
    """The copier of `lag` on `device`: side-stream copies of rows of `width` on CUDA with lag > 0 (one per
    device, lag and width, reused by every request: a stream and a pinned buffer made once), else ReadAtOnce."""
    device = torch.device(device)
    if lag > 0 and device.type == "cuda":
        return _side_copies(device, lag + 2, width)
    return ReadAtOnce()


@functools.lru_cache(maxsize=None)
def _side_copies(device: torch.device, slots: int, width: int) -> SideStreamCopies:
    return SideStreamCopies(device, slots, width)


class EosWatch:
    """push(ids, n) once the work that makes ids [B, 1] (the request's n-th token, from 0) is queued; `end`: the
    index of the first end id seen so far in row 0, or None. A token is seen once its copy has landed: at once
    with lag 0 or on a CPU, else when the host finds it landed or when more than `lag` later tokens are pending.
    ids must keep its value until its copy has landed: a step's own slot of its emitted ids (`emitted_at(i)`),
    not a buffer the next step overwrites. close() reads the copies still in flight."""

    def __init__(self, eos, device, lag: int = EOS_LAG):
        self.eos = frozenset(int(e) for e in eos)
        self.lag = check_eos_lag(lag)
        self.copies = copies_for(device, self.lag)
        self.end = None
        self.pending = deque()  # (n, ticket) of copies not yet read, oldest first

    def push(self, ids: torch.Tensor, n: int) -> None:
        if self.end is not None:
            return
        self.pending.append((n, self.copies.put(ids[0, :1])))
        self._read(lambda m, ticket: n - m >= self.lag or self.copies.landed(ticket))

    def _read(self, ready) -> None:
        """The pending copies in order, while ready(n, ticket) and no end is seen (the oldest waited for)."""
        while self.pending and self.end is None and ready(*self.pending[0]):
            m, ticket = self.pending.popleft()
            if int(self.copies.read(ticket)[0]) in self.eos:
                self.end = m

    def close(self) -> None:
        """Read every copy still pending (`end` is then the first end id of all pushed tokens, or None)."""
        self._read(lambda m, ticket: True)
        self.copies.close()
