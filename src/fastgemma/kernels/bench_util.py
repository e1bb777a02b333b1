"""Timing helpers shared by the kernel micro-benchmarks (CUDA only; not tests)."""
from __future__ import annotations

import math

import torch


def timer(graph: bool = True, rep_ms: int = 20):
    """fn -> median microseconds: inside CUDA graphs (the decode path) or with eager launches."""
    from triton.testing import do_bench, do_bench_cudagraph

    def timed_us(fn):
        if graph:
            return 1e3 * do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
        return 1e3 * do_bench(fn, rep=rep_ms, return_mode="median")
    return timed_us


def timer_or_graphs(given, who: str):
    """A benchmark's `timer` argument (`given`), else CUDA-graph timing (10 ms of replays per call);
    without a CUDA device and without a timer, a clear error naming the benchmark."""
    if given is not None:
        return given
    if not torch.cuda.is_available():
        raise RuntimeError(f"{who} needs a CUDA device (or a timer)")
    return timer(True, 10)


def rotating(bufs, call):
    """A no-argument fn that calls call(*bufs[i]) with i advancing per call: each launch reads
    weights that are not in L2 when len(bufs) copies span more than the L2."""
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % len(bufs)
        return call(*bufs[state["i"]])
    return fn


def copies_past_l2(nbytes: int, device) -> int:
    """How many copies of nbytes make one pass over them at least twice the L2 (1 off CUDA)."""
    if torch.device(device).type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, math.ceil(2 * l2 / max(nbytes, 1)))


def cuda_bench(device: str, who: str, rep_ms: int = 10):
    """A kernel bench's (device, generator seeded 0, CUDA-graph timer); without a CUDA device a clear error naming
    the bench."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{who} needs a CUDA device")
    dev = torch.device(device)
    return dev, torch.Generator(device=dev).manual_seed(0), timer(True, rep_ms)


def rotated_copies(w: torch.Tensor) -> list[tuple[torch.Tensor]]:
    """Copies of w, each a 1-tuple for `rotating`, enough (`copies_past_l2`) that a pass over them leaves the L2."""
    return [(w.clone(),) for _ in range(copies_past_l2(w.numel() * w.element_size(), w.device))]


def timed_candidate(call, bufs, timer, label: str):
    """A candidate's output on bufs[0] and its us per call rotating over bufs, or None (after a
    'skip' line naming it) when it cannot run (out of resources, more K blocks than it holds)."""
    try:
        return call(*bufs[0]), timer(rotating(bufs, call))
    except Exception as e:
        print(f"    skip {label}: {type(e).__name__}: {str(e)[:120]}")
        return None


WRONG_REL_ERR = 2e-2  # a tile candidate whose output is further from the twin than this is wrong


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|, in fp32 (the check every benchmarked tile passes first)."""
    got, ref = got.float(), ref.float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()

