"""The speculative step's bookkeeping in one launch each (engine/speculative.py's twins).

`accept`: after the verify pass, per batch row: n = the longest prefix of drafts equal to the
target's tokens, the k + 1 target tokens written at the row's count (n + 1 are kept), the count,
the last token, its hidden row, the position, the acceptance counts and the per-step log advanced,
and under replay the emitted tokens checked against the reference. `replay_drafts`: the drafts of
spec=replay from the reference trace (right with the profile's conditional odds, wrong after the
first miss). As torch ops these were ~35 and ~12 small kernels (61 us of a k = 7 step on the H200,
run ID); here each is one program of one warp (the batch rows in a loop, so the shared step counter is
read before it is advanced). Values updated in place are read by every thread before any thread
writes them (a barrier between). The first build (four warps) stored count, pos and the counts as
soon as each was computed, so a warp could read a value another warp had already advanced: a race
the CPU interpreter, which runs a program as one thread, cannot show, and the cause of run IJ's
different acceptance (the fixed kernel draws run IF's again: run IM). int64 throughout, as the engine's
buffers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_kernel(t_ptr, d_ptr, rows_h_ptr, out_ptr, count_ptr, tok_ptr, hid_ptr, pos_ptr, hits_ptr, tries_ptr,
                   n_log_ptr, step_ptr, stat_end_ptr, ref_ptr, ref_end_ptr, mismatch_ptr, B, H, out_stride,
                   log_stride, ref_len, K: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr, REPLAY: tl.constexpr):
    # Every value it updates in place (count, pos, hits, tries, mismatch, the step) is read by all of the
    # program's threads before any of them writes: loads, a barrier, then stores (one warp: the launch's)
    j = tl.arange(0, KP)
    step = tl.load(step_ptr)
    for b in range(B):
        t = tl.load(t_ptr + b * (K + 1) + j, mask=j <= K, other=0)
        d = tl.load(d_ptr + b * K + j, mask=j < K, other=0)
        count = tl.load(count_ptr + b)
        pos = tl.load(pos_ptr + b)
        inside = (pos + K < tl.load(stat_end_ptr + b)).to(tl.int64)
        hp = hits_ptr + b * K + j
        tp = tries_ptr + b * K + j  # draft j was tried when drafts < j were accepted
        hits = tl.load(hp, mask=j < K, other=0)
        tries = tl.load(tp, mask=j < K, other=0)
        # n: the first draft that differs from the target's token before it (K if none)
        n = tl.min(tl.where((d == t) & (j < K), KP, j), axis=0)
        if REPLAY:  # emitted t_j at P + 1 + j should be the reference there
            at = pos + 1 + j
            ref = tl.load(ref_ptr + b * ref_len + tl.minimum(at, ref_len - 1), mask=j <= K, other=0)
            bad = (t != ref) & (j <= n) & (at < tl.load(ref_end_ptr + b))
            mismatch = tl.load(mismatch_ptr + b) + tl.sum(bad.to(tl.int64), axis=0)
        tl.debug_barrier()
        if REPLAY:
            tl.store(mismatch_ptr + b, mismatch)
        tl.store(out_ptr + b * out_stride + count + j, t, mask=j <= K)
        tl.store(count_ptr + b, count + n + 1)
        tl.store(tok_ptr + b, tl.sum(tl.where(j == n, t, 0), axis=0))
        for h0 in range(0, H, BH):
            offs = h0 + tl.arange(0, BH)
            v = tl.load(rows_h_ptr + (b * (K + 1) + n) * H + offs, mask=offs < H)
            tl.store(hid_ptr + b * H + offs, v, mask=offs < H)
        tl.store(pos_ptr + b, pos + n + 1)
        tl.store(hp, hits + (j < n).to(tl.int64) * inside, mask=j < K)
        tl.store(tp, tries + (j <= n).to(tl.int64) * inside, mask=j < K)
        tl.store(n_log_ptr + b * log_stride + step, n.to(tl.int64))
    tl.debug_barrier()
    tl.store(step_ptr, step + 1)


@triton.jit
def _replay_kernel(uniform_ptr, profile_ptr, step_ptr, pos_ptr, ref_ptr, drafts_ptr, B, ref_len, vocab,
                   K: tl.constexpr, KP: tl.constexpr):
    j = tl.arange(0, KP)
    m = j < K
    u = tl.load(uniform_ptr + tl.load(step_ptr) * K + j, mask=m, other=1.0)
    p = tl.load(profile_ptr + j, mask=m, other=0.0)
    f = tl.min(tl.where(u < p, KP, j), axis=0)  # drafts before the first miss are right
    for b in range(B):
        want = tl.load(ref_ptr + b * ref_len + tl.minimum(tl.load(pos_ptr + b) + 1 + j, ref_len - 1), mask=m,
                       other=0)
        tl.store(drafts_ptr + b * K + j, tl.where(j < f, want, (want + 1) % vocab), mask=m)


def _check(name: str, t: torch.Tensor, shape, dtype=torch.long):
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be {tuple(shape)} {dtype}, contiguous, got {tuple(t.shape)} {t.dtype}")


def accept(targets, drafts, rows_h, out, count, tok, hid, pos, hits, tries, n_log, step_i, stat_end,
           ref=None, ref_end=None, mismatch=None) -> None:
    """In place, as engine/speculative.py's `SpecGenerator._accept_torch`: targets [B, k+1], drafts [B, k],
    rows_h [B, k+1, H]; out [B, *], count [B], tok / pos / stat_end [B, 1], hid [B, 1, H], hits / tries
    [B, k], n_log [B, *], step_i [1]; replay: ref [B, *], ref_end [B, 1], mismatch [B] (all three or none)."""
    B, k = drafts.shape
    H = rows_h.shape[2]
    _check("targets", targets, (B, k + 1))
    _check("rows_h", rows_h, (B, k + 1, H), hid.dtype)
    for name, t, shape in (("drafts", drafts, (B, k)), ("count", count, (B,)), ("tok", tok, (B, 1)),
                           ("pos", pos, (B, 1)), ("stat_end", stat_end, (B, 1)), ("hits", hits, (B, k)),
                           ("tries", tries, (B, k)), ("step_i", step_i, (1,)), ("out", out, (B, out.shape[1])),
                           ("n_log", n_log, (B, n_log.shape[1]))):
        _check(name, t, shape)
    _check("hid", hid, (B, 1, H), rows_h.dtype)
    replay = ref is not None
    if replay != (ref_end is not None) or replay != (mismatch is not None):
        raise ValueError("accept: ref, ref_end and mismatch come together (spec=replay) or not at all")
    if replay:
        _check("ref", ref, (B, ref.shape[1]))
        _check("ref_end", ref_end, (B, 1))
        _check("mismatch", mismatch, (B,))
    else:
        ref, ref_end, mismatch = out, count, count  # not read
    _accept_kernel[(1,)](targets, drafts, rows_h, out, count, tok, hid, pos, hits, tries, n_log, step_i, stat_end,
                         ref, ref_end, mismatch, B, H, out.shape[1], n_log.shape[1], ref.shape[1],
                         K=k, KP=triton.next_power_of_2(k + 1), BH=min(1024, triton.next_power_of_2(H)),
                         REPLAY=replay, num_warps=1)


def replay_drafts(uniform, profile, step_i, pos, ref, drafts, vocab: int) -> None:
    """drafts [B, k] <- the reference's tokens where the profile accepts, (token + 1) % vocab from the first
    miss on, as `SpecGenerator._replay_drafts_torch`: uniform [L, k] fp32 (row step_i), profile [k] fp32,
    pos [B, 1] (draft j is the reference at pos + 1 + j, clamped to ref's last column), ref [B, *]."""
    B, k = drafts.shape
    _check("drafts", drafts, (B, k))
    _check("uniform", uniform, (uniform.shape[0], k), torch.float32)
    _check("profile", profile, (k,), torch.float32)
    _check("step_i", step_i, (1,))
    _check("pos", pos, (B, 1))
    _check("ref", ref, (B, ref.shape[1]))
    _replay_kernel[(1,)](uniform, profile, step_i, pos, ref, drafts, B, ref.shape[1], vocab, K=k,
                         KP=triton.next_power_of_2(k), num_warps=1)
