"""fuse.flag_wait: a kernel waits for the GEMM before it on an arrival flag instead of the GEMM's grid end.

Under programmatic dependent launch a kernel's `griddepcontrol.wait` returns once the whole grid before it
has exited and its memory is flushed. The residual norm after a GEMM launches early (the GEMM lets its
dependents launch at its first instruction), so its programs are resident while the GEMM runs; here
they spin instead on a flag that the GEMM's last program raises after its stores:

- `_raise_flag` (the GEMM, at the end of each program that stores; after a barrier, so every thread's
  stores come first): one arrival (acq_rel at GPU scope); the last of `total` resets the count and
  releases the flag.
- `_wait_flag` (the waiter, where it would call `griddepcontrol.wait`): acquire-loads the flag until it
  is raised. What it reads then comes from the L2 (`.cg`: the GEMM's stores, and the kernels' before it,
  which the GEMM's programs waited for before they stored).
- `_leave_flag` (the waiter, after its reads): one departure; the last of the waiter's `n` programs
  lowers the flag and resets the count for the next GEMM.

Safe from deadlock because the waiter launches only after every program of the GEMM has started (a
dependent launches once each program of the grid before has triggered or exited), so the programs it
waits for already hold their multiprocessors. The words: counters.arrival_flag (one GEMM and its waiter at
a time: the next GEMM's programs touch the flag only after their own PDL wait, which follows the waiter's
end through the kernels between).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _raise_flag(flag_ptr, total):
    """One arrival of the `total` programs that store; the last resets the count and raises the flag."""
    tl.debug_barrier()  # every thread's stores before the arrival
    n = tl.atomic_add(flag_ptr, 1, sem="acq_rel", scope="gpu")
    if n == total - 1:
        tl.atomic_xchg(flag_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flag_ptr + 1, 1, sem="release", scope="gpu")


@triton.jit
def _wait_flag(flag_ptr):
    """Spin until the GEMM before has raised the flag (acquire: its stores are visible from then on)."""
    f = tl.atomic_add(flag_ptr + 1, 0, sem="acquire", scope="gpu")
    while f == 0:
        f = tl.atomic_add(flag_ptr + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _leave_flag(flag_ptr, n):
    """One departure of the waiter's n programs (after their reads); the last lowers the flag."""
    tl.debug_barrier()
    d = tl.atomic_add(flag_ptr + 2, 1, sem="acq_rel", scope="gpu")
    if d == n - 1:
        tl.atomic_xchg(flag_ptr + 2, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flag_ptr + 1, 0, sem="relaxed", scope="gpu")
