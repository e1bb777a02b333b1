"""The smallest dependent phase a decode step is made of, and its torch twin: what one kernel
boundary costs with no weights to stream, and with them.

A phase of P programs reads the whole vector the phase before it wrote (H fp32 values), takes its
dot with the program's own row of H weights (loaded before the wait: weights never depend on the
phase before) and writes that sum to its share of the next vector (H / P values, rounded up). Every
layer op of the step has this dependency: each program needs all of the previous op's output.
`work=False` keeps only the boundary: no loads, no stores.

`stream` adds the weights a real phase reads: an int32 buffer [R, programs, blocks, words] (blocks of
MIN_WORDS..WORDS words); phase i's
program p reads copy i % R of its blocks before its wait (a launch) or before the barrier that opens
the phase (one launch), as the step's GEMVs load their weights, and keeps a bit of each word in a
sink [programs] (so the loads stay). R copies larger than the L2 make every phase read from memory.
Whether a phase then costs its bytes plus its boundary, or the larger of the two, is what says how
much of the boundaries weight streaming can hide.

- `phase_chain(x, w, n, style)`: n phases as n launches, stream ordered (`graph`) or with
  programmatic dependent launch (`pdl`: the next launch starts at once, its programs wait for this
  one's end before they read).
- `phase_persistent(x, w, n)`: n phases in one launch of P resident programs, a grid barrier
  (kernels/draft_loop.py's) between a phase and the next.
Both leave the n-th vector in x's pair buffer; `phase_ref` is their twin.

In those two styles a phase's streamed words are used (summed) before its boundary: a launch lets the
next one start only after its weights have arrived, and a barrier's release waits for them. The
`_ahead` styles leave the words in flight across the boundary and use them after it, as a step whose
weights never depend on the phase before could:
- `pdl_ahead`: each launch issues its loads, lets the next launch start at once, waits, then sums
  them: the launches after it start (where the multiprocessors have room) and stream while it waits;
- `barrier_ahead`: one launch; a program arrives at phase i's barrier right after its stores, issues
  phase i + 1's loads, then waits for the others' arrivals, and sums the words after the wait.
Their program may hold a phase's words in registers (more warps: `ahead_warps`).

`phase_sequence(x, kinds, layers, style)` chains phases of several shapes, a step's layer of them
repeated (each kind its own programs and words, the launches in the order given); `sequence_ref` is
its twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import is_int
from .draft_loop import SPIN_LIMIT, _arrive, _leave, _sync, _wait
from .gemv import _pdl_trigger, _pdl_wait, pdl_args

BASE_STYLES = ("graph", "pdl", "barrier")
STYLES = BASE_STYLES + ("pdl_ahead", "barrier_ahead")
WORDS = 4096  # int32 words of a streamed block: 16 KB, 32 a thread at 4 warps
AHEAD_REGS = 64  # registers a thread may give to an `_ahead` style's words in flight
AHEAD_MAX_BLOCKS = 12  # blocks a program of an `_ahead` style holds at most (96 words a thread at 16 warps)


def ahead_warps(blocks: int, ahead: bool, words: int = WORDS) -> int:
    """Warps of a program that holds `blocks` streamed blocks of `words` across its boundary (4
    otherwise): AHEAD_REGS words a thread, at most 16 warps."""
    if not ahead:
        return 4
    if blocks * words > AHEAD_MAX_BLOCKS * WORDS:
        raise PhaseError(f"an _ahead style holds a phase's words in registers: at most {AHEAD_MAX_BLOCKS} blocks "
                         f"of {WORDS * 4 // 1024} KB a program; got {blocks * words / WORDS:g} (more programs or "
                         f"fewer MB)")
    warps = 4
    while warps < 16 and blocks * words > warps * 32 * AHEAD_REGS:
        warps *= 2
    return warps


@triton.jit
def _dot_store(src, dst, w, pid, H, C, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < H, other=0.0)
    s = tl.sum(x * w, axis=0)
    cols = pid * C + tl.arange(0, BLOCK_C)
    tl.store(dst + cols, tl.zeros([BLOCK_C], tl.float32) + s, mask=(cols < (pid + 1) * C) & (cols < H))


@triton.jit
def _issue(big_ptr, base, NB: tl.constexpr, WB: tl.constexpr):
    """NB blocks of WB words at big_ptr + base, loaded (a tuple: nothing waits for them yet)."""
    offs = tl.arange(0, WB)
    blks = ()
    for j in tl.static_range(NB):
        blks = blks + (tl.load(big_ptr + base + j * WB + offs),)
    return blks


@triton.jit
def _bits(blks, NB: tl.constexpr):
    """The low bits of _issue's blocks, summed."""
    acc = blks[0] & 1
    for j in tl.static_range(1, NB):
        acc += blks[j] & 1
    return tl.sum(acc, axis=0)


@triton.jit
def _stream(big_ptr, base, NB: tl.constexpr, WB: tl.constexpr):
    """The low bits of NB blocks of WB words at big_ptr + base, summed (the loads all issued first)."""
    return _bits(_issue(big_ptr, base, NB, WB), NB)


@triton.jit
def _phase_kernel(src, dst, w_ptr, H, C, big_ptr, sink_ptr, base, WORK: tl.constexpr, PDL: tl.constexpr,
                  AHEAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, NB: tl.constexpr,
                  WB: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if WORK:
        w = tl.load(w_ptr + pid * H + offs, mask=offs < H, other=0.0)
    if NB > 0:  # this phase's weights, before the wait
        blks = _issue(big_ptr, base + pid * (NB * WB), NB, WB)
        if not AHEAD:  # arrived before the next launch may start
            bits = _bits(blks, NB)
    _pdl_trigger(PDL)
    _pdl_wait(PDL)
    if WORK:
        _dot_store(src, dst, w, pid, H, C, BLOCK, BLOCK_C)
    if NB > 0:
        if AHEAD:  # still in flight at the trigger and the wait
            bits = _bits(blks, NB)
        tl.store(sink_ptr + pid, bits)


@triton.jit
def _persistent_kernel(x_ptr, w_ptr, bar_ptr, err_ptr, n, H, C, big_ptr, sink_ptr, copies,
                       WORK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, SPIN: tl.constexpr,
                       NB: tl.constexpr, WB: tl.constexpr, AHEAD: tl.constexpr = False):
    """`barrier`: the next phase's words summed before the barrier that opens it. AHEAD
    (`barrier_ahead`): phase i's words issued after the program's arrival at barrier i - 1 and used
    after the wait for everyone's; the barrier's release never waits for them."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    if WORK:
        w = tl.load(w_ptr + pid * H + offs, mask=offs < H, other=0.0)
    bits = 0
    if AHEAD:
        for i in range(n):
            if NB > 0:
                blks = _issue(big_ptr, ((i % copies) * nprog + pid) * (NB * WB), NB, WB)
            _wait(bar_ptr, err_ptr, i * nprog, SPIN)  # phase i - 1's arrivals
            if NB > 0:
                bits += _bits(blks, NB)
            if WORK:
                _dot_store(x_ptr + (i % 2) * H, x_ptr + ((i + 1) % 2) * H, w, pid, H, C, BLOCK, BLOCK_C)
            _arrive(bar_ptr)
    else:
        if NB > 0:  # phase 0's weights
            bits = _stream(big_ptr, pid * (NB * WB), NB, WB)
        nb = 0
        for i in range(n):
            if WORK:
                _dot_store(x_ptr + (i % 2) * H, x_ptr + ((i + 1) % 2) * H, w, pid, H, C, BLOCK, BLOCK_C)
            if NB > 0:  # the next phase's weights, before the barrier that opens it
                bits += _stream(big_ptr, (((i + 1) % copies) * nprog + pid) * (NB * WB), NB, WB)
            nb = _sync(bar_ptr, err_ptr, nb, nprog, SPIN)
    if NB > 0:
        tl.store(sink_ptr + pid, bits)
    _leave(bar_ptr, nprog)


class PhaseError(ValueError):
    pass


def _check(x: torch.Tensor, w: torch.Tensor, n: int):
    if x.dim() != 2 or x.shape[0] != 2 or x.dtype != torch.float32:
        raise PhaseError(f"x must be the pair of fp32 vectors [2, H] the phases alternate between; got "
                         f"{tuple(x.shape)} {x.dtype}")
    if w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != torch.float32:
        raise PhaseError(f"w must be fp32 [programs, H={x.shape[1]}]; got {tuple(w.shape)} {w.dtype}")
    if not 1 <= w.shape[0] <= x.shape[1]:
        raise PhaseError(f"programs must be in [1, H={x.shape[1]}]; got {w.shape[0]}")
    if not is_int(n, 1):
        raise PhaseError(f"phases must be a positive integer; got {n!r}")


def _meta(x, w):
    H, P = x.shape[1], w.shape[0]
    C = triton.cdiv(H, P)
    return H, P, C, dict(BLOCK=triton.next_power_of_2(H), BLOCK_C=triton.next_power_of_2(C))


MIN_WORDS = 128  # the smallest streamed block (512 bytes): one word a thread at 4 warps


def stream_buffers(copies: int, programs: int, blocks: int, device="cpu", seed: int = 0, words: int = WORDS):
    """(big int32 [copies, programs, blocks, words] of random words, sink int32 [programs]) for `stream`;
    words a power of two in [MIN_WORDS, WORDS]."""
    if copies < 1 or programs < 1 or blocks < 1:
        raise PhaseError(f"copies, programs and blocks must be >= 1; got {copies}, {programs}, {blocks}")
    if not MIN_WORDS <= words <= WORDS or words & (words - 1):
        raise PhaseError(f"a block's words are a power of two in [{MIN_WORDS}, {WORDS}]; got {words}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    big = torch.randint(-2**31, 2**31 - 1, (copies, programs, blocks, words), generator=g, dtype=torch.int32)
    return big.to(device), torch.zeros(programs, dtype=torch.int32, device=device)


def stream_ref(big: torch.Tensor, phases) -> torch.Tensor:
    """The sink after `phases` (the copies' indices the phases read, in order): per program, the sum
    of its words' low bits over those phases."""
    bits = (big & 1).sum(dim=(2, 3))  # [copies, programs]
    return sum(bits[c] for c in phases).to(torch.int32)


def _stream_args(stream, P):
    """-> (big, sink, blocks, copies, words a block)."""
    if stream is None:
        return None, None, 0, 1, WORDS
    big, sink = stream
    wb = big.shape[-1] if big.dim() == 4 else 0
    if (big.dim() != 4 or big.shape[1] != P or not MIN_WORDS <= wb <= WORDS or wb & (wb - 1)
            or big.dtype != torch.int32):
        raise PhaseError(f"stream's buffer must be int32 [copies, programs={P}, blocks, words] (words a power of "
                         f"two in [{MIN_WORDS}, {WORDS}]); got {tuple(big.shape)} {big.dtype}")
    if sink.shape != (P,) or sink.dtype != torch.int32:
        raise PhaseError(f"stream's sink must be int32 [{P}]; got {tuple(sink.shape)} {sink.dtype}")
    return big, sink, big.shape[2], big.shape[0], wb


CHAIN_STYLES = ("graph", "pdl", "pdl_ahead")


def phase_chain(x: torch.Tensor, w: torch.Tensor, n: int, style: str = "graph", work: bool = True, stream=None,
                first: int = 0):
    """n phases of w.shape[0] programs as n launches; phase i reads x[i % 2] and writes x[(i + 1) % 2].
    stream: (big, sink) of `stream_buffers`: phase i (counted from `first`) reads copy i % copies and
    writes its sum to the sink."""
    _check(x, w, n)
    _chain_style(style)
    for i in range(n):
        _launch_phase(x, w, i, style, work, stream, first + i)


def _chain_style(style: str):
    if style not in CHAIN_STYLES:
        raise PhaseError(f"phase_chain's style is one of {', '.join(CHAIN_STYLES)}; got {style!r}")


def _launch_phase(x, w, i: int, style: str, work: bool, stream, copy: int):
    """Phase i of a chain (x[i % 2] -> x[(i + 1) % 2]), its words (if any) from copy `copy` % copies."""
    H, P, C, meta = _meta(x, w)
    big, sink, NB, R, WB = _stream_args(stream, P)
    ahead = style == "pdl_ahead"
    _phase_kernel[(P,)](x[i % 2], x[(i + 1) % 2], w, H, C, big if NB else w, sink if NB else w,
                        (copy % R) * (P * NB * WB), WORK=work, AHEAD=ahead, NB=NB, WB=WB,
                        num_warps=ahead_warps(NB, ahead, WB), **pdl_args(style != "graph", x.device), **meta)


def phase_sequence(x: torch.Tensor, kinds: list, layers: int, style: str = "pdl_ahead", first: int = 0):
    """`layers` layers of len(kinds) launches: a layer runs kinds[0], kinds[1], ... in order, each a
    (w [P, H], stream or None) with its own program count and words. Phase i reads x[i % 2] and writes
    x[(i + 1) % 2]; layer l's phase of a kind reads that kind's copy (first + l) % copies and writes
    its sum to the kind's sink. `sequence_ref` is the twin."""
    if not kinds or not is_int(layers, 1):
        raise PhaseError(f"a sequence needs kinds and layers >= 1; got {len(kinds)} kinds, layers {layers!r}")
    _chain_style(style)
    for w, _ in kinds:
        _check(x, w, 1)
    for layer in range(layers):
        for j, (w, stream) in enumerate(kinds):
            _launch_phase(x, w, layer * len(kinds) + j, style, True, stream, first + layer)


def phase_persistent(x: torch.Tensor, w: torch.Tensor, n: int, bar: torch.Tensor, err: torch.Tensor,
                     work: bool = True, stream=None, ahead: bool = False):
    """n phases in one launch of w.shape[0] programs, which must all be resident at once (at most one
    per multiprocessor is what the caller should ask for). bar: int32 [2] zeros, err: int32 [1]: set
    to 1 if a barrier gave up waiting (programs not all resident). stream: as phase_chain's, the sink
    holding phases 0..n's sum (the weights of a phase n + 1 are read too, before the last barrier);
    ahead (`barrier_ahead`): phases 0..n - 1's, each in flight across the barrier before it."""
    _check(x, w, n)
    H, P, C, meta = _meta(x, w)
    big, sink, NB, R, WB = _stream_args(stream, P)
    if x.device.type == "cuda":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        if P > sms:
            raise PhaseError(f"a grid barrier needs every program resident: at most {sms} programs here; got {P}")
    _persistent_kernel[(P,)](x, w, bar, err, n, H, C, big if NB else w, sink if NB else w, R, WORK=work,
                             SPIN=SPIN_LIMIT, NB=NB, WB=WB, AHEAD=ahead, num_warps=ahead_warps(NB, ahead, WB), **meta)


def ring_weights(programs: int, hidden: int, device="cpu") -> torch.Tensor:
    """w [programs, hidden] with one 1 per row: program p picks the first value of program p + 1's
    share (the last value where that program has none). The values stay the input's (sums of one
    product, exact), and each phase rotates them a program further, so a phase that read a stale
    vector gives another answer than the twin."""
    C = triton.cdiv(hidden, programs)
    w = torch.zeros(programs, hidden, dtype=torch.float32, device=device)
    p = torch.arange(programs, device=device)
    w[p, (((p + 1) % programs) * C).clamp(max=hidden - 1)] = 1.0
    return w


def phase_ref(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """The twin: the vector after n phases from x[0] (fp64 sums, returned in fp32)."""
    _check(x, w, n)
    return sequence_ref(x, [w] * n)


def sequence_ref(x: torch.Tensor, ws: list) -> torch.Tensor:
    """The twin of a sequence: the vector after the phases of ws (each w [P, H], in launch order; a w
    repeated is checked and converted once)."""
    v = x[0].double()
    prepared = {}  # id(w) -> (w in fp64, the program owning each value)
    for w in ws:
        if id(w) not in prepared:
            _check(x, w, 1)
            H, P, C, _ = _meta(x, w)
            prepared[id(w)] = (w.double(), torch.arange(H, device=x.device) // C)
        wd, owner = prepared[id(w)]
        v = (wd @ v)[owner]
    return v.float()
