"""The one-row decode step's inputs in one launch: what every step computes from its token id and position before
its first GEMV, each piece before as a launch of its own on the step's critical path (the compiled step: the
token's embedding, the first layer's input norm, the RoPE cos / sin of each layer kind, the ring slot and its
position mark; ple=table's PLE row gather).

    x    = E[id] * scale                                   (scale: the embedding scale rounded to E's dtype)
    xn   = rmsnorm(x) * (pre + off)                        (pre given: the first q|k|v's prologue)
    ple  = T[id]                                           (T given: ple=table's rows)
    cos_k, sin_k = cos / sin(pos * inv_freq_k), twice over (rotate-half layout), k = sliding, full
    slot = pos % ring;  ring_pos[0, slot] = pos

rounded where the eager ops round (x and xn as kernels/residual_norm.py rounds its norm; cos / sin from fp32 as
`layers.rope_cos_sin`). Program 0 does all but the PLE row, programs 1.. copy that row in chunks. On CUDA cos / sin
are libdevice's (CUDA's cosf / sinf, as torch's kernels); under TRITON_INTERPRET=1 tl.cos / tl.sin (numpy's).
`step_start` launches, `step_start_op` is the opaque op for torch.compile, `step_start_ref` the torch twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .fused_gemv import _rnd

_INTERPRET = bool(triton.knobs.runtime.interpret)
PLE_CHUNK = 4096  # PLE row elements a program copies


@triton.jit
def _cos_sin(f, INTERPRET: tl.constexpr):
    if INTERPRET:
        c, s = tl.cos(f), tl.sin(f)
    else:
        c, s = libdevice.cos(f), libdevice.sin(f)
    return c, s


@triton.jit
def _rope_store(p, freq_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr,
                INTERPRET: tl.constexpr):
    j = tl.arange(0, BLOCK)
    ok = j < HALF
    c, s = _cos_sin(p.to(tl.float32) * tl.load(freq_ptr + j, mask=ok, other=0.0), INTERPRET)
    for h in tl.static_range(2):  # cat((freqs, freqs)): both halves alike
        tl.store(cos_ptr + h * HALF + j, c.to(DT), mask=ok)
        tl.store(sin_ptr + h * HALF + j, s.to(DT), mask=ok)


@triton.jit
def _step_start_kernel(ids_ptr, pos_ptr, emb_ptr, scale, pre_ptr, eps, off, tab_ptr, fs_ptr, ff_ptr, ring_pos_ptr,
                       ring, x_ptr, xn_ptr, ple_ptr, cs_ptr, ss_ptr, cf_ptr, sf_ptr, slot_ptr,
                       H: tl.constexpr, BH: tl.constexpr, NP: tl.constexpr, CHUNK: tl.constexpr,
                       HS: tl.constexpr, BS: tl.constexpr, HF: tl.constexpr, BF: tl.constexpr,
                       HAS_PRE: tl.constexpr, HAS_TABLE: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    tok = tl.load(ids_ptr).to(tl.int64)
    if pid == 0:
        p = tl.load(pos_ptr)
        slot = p % ring
        tl.store(slot_ptr, slot)
        tl.store(ring_pos_ptr + slot, p.to(tl.int32))
        _rope_store(p, fs_ptr, cs_ptr, ss_ptr, HS, BS, DT, INTERPRET)
        _rope_store(p, ff_ptr, cf_ptr, sf_ptr, HF, BF, DT, INTERPRET)
        k = tl.arange(0, BH)
        ok = k < H
        x = _rnd(tl.load(emb_ptr + tok * H + k, mask=ok, other=0.0).to(tl.float32) * scale, DT)
        tl.store(x_ptr + k, x.to(DT), mask=ok)
        if HAS_PRE:
            pre = tl.load(pre_ptr + k, mask=ok, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
            tl.store(xn_ptr + k, _rnd(x * inv * (pre + off), DT).to(DT), mask=ok)
    elif HAS_TABLE:  # (names of their own: a name set in both branches must have one shape, BH's = CHUNK's)
        c = (pid - 1) * CHUNK + tl.arange(0, CHUNK)
        c_ok = c < NP
        tl.store(ple_ptr + c, tl.load(tab_ptr + tok * NP + c, mask=c_ok), mask=c_ok)


def _check(ids, pos, emb, pre, table, inv_freq_sliding, inv_freq_full, ring_pos):
    if ids.shape != (1, 1) or pos.shape != (1, 1):
        raise ValueError(f"step_start takes one row: ids and pos [1, 1], got {tuple(ids.shape)} / {tuple(pos.shape)}")
    H = emb.shape[1]
    if pre is not None and pre.shape != (H,):
        raise ValueError(f"step_start: pre must be [{H}], got {tuple(pre.shape)}")
    if table is not None and (table.dim() != 2 or table.dtype != emb.dtype or not table.is_contiguous()):
        raise ValueError(f"step_start: the PLE table must be a contiguous 2-D {emb.dtype} tensor, got "
                         f"{table.dtype} {tuple(table.shape)}")
    for name, f in (("inv_freq_sliding", inv_freq_sliding), ("inv_freq_full", inv_freq_full)):
        if f.dtype != torch.float32 or f.dim() != 1 or not f.is_contiguous():
            raise ValueError(f"step_start: {name} must be contiguous 1-D fp32, got {f.dtype} {tuple(f.shape)}")
    if ring_pos.dim() != 2 or ring_pos.shape[0] != 1 or ring_pos.dtype != torch.int32 or ring_pos.stride(1) != 1:
        raise ValueError(f"step_start: ring_pos must be int32 [1, ring], got {ring_pos.dtype} {tuple(ring_pos.shape)}")
    if not emb.is_contiguous():
        raise ValueError("step_start: the embedding must be contiguous")


def _outputs(emb, pre, table, inv_freq_sliding, inv_freq_full, ids):
    H, e = emb.shape[1], dict(dtype=emb.dtype, device=emb.device)
    ds, df = 2 * inv_freq_sliding.numel(), 2 * inv_freq_full.numel()
    return (torch.empty(1, 1, H, **e), torch.empty(1, H, **e) if pre is not None else emb.new_empty(0),
            torch.empty(1, 1, table.shape[1], **e) if table is not None else emb.new_empty(0),
            torch.empty(1, 1, 1, ds, **e), torch.empty(1, 1, 1, ds, **e), torch.empty(1, 1, 1, df, **e),
            torch.empty(1, 1, 1, df, **e), torch.empty(1, 1, dtype=torch.long, device=ids.device))


def step_start(ids, pos, emb, scale: float, pre, eps: float, off: float, table, inv_freq_sliding, inv_freq_full,
               ring_pos):
    """ids, pos [1, 1] int64; emb [V, H]; scale: the embedding scale as the model rounds it; pre [H] or None (no xn);
    table [V, L * P] or None (no PLE row); inv_freq_* fp32; ring_pos [1, ring] int32, its slot written in place.
    -> x [1, 1, H], xn [1, H] (empty without pre), ple [1, 1, L * P] (empty without table), cos_s, sin_s
    [1, 1, 1, 2 * len(inv_freq_sliding)], cos_f, sin_f (full), slot [1, 1] int64. No host sync."""
    _check(ids, pos, emb, pre, table, inv_freq_sliding, inv_freq_full, ring_pos)
    if not (emb.is_cuda or _INTERPRET):
        raise RuntimeError("step_start runs on CUDA tensors (or with TRITON_INTERPRET=1); use step_start_ref")
    outs = _outputs(emb, pre, table, inv_freq_sliding, inv_freq_full, ids)
    x, xn, ple, cs, ss, cf, sf, slot = outs
    H, hs, hf = emb.shape[1], inv_freq_sliding.numel(), inv_freq_full.numel()
    NP = table.shape[1] if table is not None else 0
    _step_start_kernel[(1 + triton.cdiv(NP, PLE_CHUNK),)](
        ids, pos, emb, float(scale), pre if pre is not None else emb, float(eps), float(off),
        table if table is not None else emb, inv_freq_sliding, inv_freq_full, ring_pos, ring_pos.shape[1],
        x, xn if pre is not None else x, ple if table is not None else x, cs, ss, cf, sf, slot,
        H=H, BH=triton.next_power_of_2(H), NP=NP, CHUNK=PLE_CHUNK, HS=hs, BS=triton.next_power_of_2(hs), HF=hf,
        BF=triton.next_power_of_2(hf), HAS_PRE=pre is not None, HAS_TABLE=table is not None, INTERPRET=_INTERPRET,
        num_warps=4)
    return outs


def step_start_ref(ids, pos, emb, scale: float, pre, eps: float, off: float, table, inv_freq_sliding, inv_freq_full,
                   ring_pos):
    """The torch twin: the model's own ops (embed, rope_cos_sin, the ring mark) and residual_norm_ref's norm."""
    import torch.nn.functional as F

    from ..model.layers import rope_cos_sin
    from .residual_norm import residual_norm_ref

    _check(ids, pos, emb, pre, table, inv_freq_sliding, inv_freq_full, ring_pos)
    x = F.embedding(ids, emb) * scale
    xn = (residual_norm_ref(x.reshape(1, -1), pre=pre, eps=eps, offset=off)[1] if pre is not None
          else emb.new_empty(0))
    ple = F.embedding(ids, table) if table is not None else emb.new_empty(0)
    slot = pos % ring_pos.shape[1]
    ring_pos[torch.zeros_like(slot), slot] = pos.to(torch.int32)
    cs, ss = rope_cos_sin(pos, inv_freq_sliding, emb.dtype)
    cf, sf = rope_cos_sin(pos, inv_freq_full, emb.dtype)
    return x, xn, ple, cs, ss, cf, sf, slot


@torch.library.custom_op("fastgemma::step_start", mutates_args=("ring_pos",))
def step_start_op(ids: torch.Tensor, pos: torch.Tensor, emb: torch.Tensor, scale: float, pre: torch.Tensor | None,
                  eps: float, off: float, table: torch.Tensor | None, inv_freq_sliding: torch.Tensor,
                  inv_freq_full: torch.Tensor, ring_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor, torch.Tensor, torch.Tensor,
                                                                             torch.Tensor, torch.Tensor, torch.Tensor]:
    return step_start(ids, pos, emb, scale, pre, eps, off, table, inv_freq_sliding, inv_freq_full, ring_pos)


@step_start_op.register_fake
def _(ids, pos, emb, scale, pre, eps, off, table, inv_freq_sliding, inv_freq_full, ring_pos):
    return _outputs(emb, pre, table, inv_freq_sliding, inv_freq_full, ids)
