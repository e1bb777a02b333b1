"""One attention layer's q / k / v after the merged projection, in one launch (the static step's
rows, 1..16 of them; fuse=layers):

    q            <- rope(q_norm(q))                                  -> a new [R, H, D] tensor
    k (stores)   <- rope(k_norm(k))     written into the KV cache at the step's slots
    v (stores)   <- v_norm(v) (Gemma 4; as is without one)   "

One program per row and head of the q | k | v row (q heads, then k heads, then v heads): the D-wide
head vector in registers as its two RoPE halves, the RMSNorm in fp32 rounded to the activation
dtype (RMSNorm's `type_as`), then rotate-half RoPE in fp32 from the rounded values and the row's
cos / sin, rounded once. Compiled, the same work took inductor two kernels on a store layer (q; k
and v with the cache writes) and one on a KV-shared layer, ~2.2-2.7 us each at 8 rows on the H200.
`pdl` (sm90+): programmatic dependent launch, as the verify pass's GEMMs (w4a16._pdl_wait / _trigger).
`qkv_finish` launches; `qkv_finish_op` / `qkv_finish_store_op` are the opaque ops (the second
mutates the cache, as torch's index_put did); `qkv_finish_ref` is the torch twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import _pdl_trigger, _pdl_wait, pdl_args

_INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _qkv_finish_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, idx_ptr, q_ptr, kc_ptr, vc_ptr,
                       T, stride_qkv, stride_cs, stride_ib, stride_it, stride_cb, stride_cs_slot, stride_ch,
                       eps, off, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, V_NORM: tl.constexpr,
                       PDL: tl.constexpr):
    r = tl.program_id(0)  # row b * T + t
    hd = tl.program_id(1)  # q heads 0..H-1, k heads H.., v heads H + HKV..
    HALF: tl.constexpr = D // 2
    DT: tl.constexpr = q_ptr.dtype.element_ty
    j = tl.arange(0, HALF)
    # the head's norm weight (q or k; none for v) before the wait: a parameter, which after the norm's
    # reduction was a dependent round trip to DRAM (the weights leave the L2 between steps)
    w_ptr = qw_ptr
    if hd >= H:
        w_ptr = kw_ptr
    has_w = (j >= 0) & (hd < H + HKV)
    w1 = tl.load(w_ptr + j, mask=has_w, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + j, mask=has_w, other=0.0).to(tl.float32)
    _pdl_wait(PDL)
    _pdl_trigger(PDL)
    src = qkv_ptr + r.to(tl.int64) * stride_qkv + hd * D  # q, k and v heads sit D apart
    x1 = tl.load(src + j).to(tl.float32)
    x2 = tl.load(src + HALF + j).to(tl.float32)
    # the row's cos / sin with x, ahead of the reduction (else a second round trip after it)
    cs = cos_ptr + r.to(tl.int64) * stride_cs
    sn = sin_ptr + r.to(tl.int64) * stride_cs
    c1 = tl.load(cs + j, mask=has_w, other=0.0).to(tl.float32)
    c2 = tl.load(cs + HALF + j, mask=has_w, other=0.0).to(tl.float32)
    s1 = tl.load(sn + j, mask=has_w, other=0.0).to(tl.float32)
    s2 = tl.load(sn + HALF + j, mask=has_w, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    if hd < H + HKV:  # q or k: the norm's weight, then RoPE
        n1 = (x1 * inv * (w1 + off)).to(DT).to(tl.float32)
        n2 = (x2 * inv * (w2 + off)).to(DT).to(tl.float32)
        y1 = n1 * c1 - n2 * s1
        y2 = n2 * c2 + n1 * s2
        if hd < H:
            dst = q_ptr + (r.to(tl.int64) * H + hd) * D
        else:
            b = r // T
            slot = tl.load(idx_ptr + b * stride_ib + (r - b * T) * stride_it).to(tl.int64)
            dst = kc_ptr + b.to(tl.int64) * stride_cb + slot * stride_cs_slot + (hd - H) * stride_ch
        tl.store(dst + j, y1.to(DT))
        tl.store(dst + HALF + j, y2.to(DT))
    else:  # v: the weightless norm (or as is), into the cache
        if V_NORM:
            x1 = x1 * inv
            x2 = x2 * inv
        b = r // T
        slot = tl.load(idx_ptr + b * stride_ib + (r - b * T) * stride_it).to(tl.int64)
        dst = vc_ptr + b.to(tl.int64) * stride_cb + slot * stride_cs_slot + (hd - H - HKV) * stride_ch
        tl.store(dst + j, x1.to(DT))
        tl.store(dst + HALF + j, x2.to(DT))


def _check(qkv, q_w, k_w, cos, sin, heads, k_cache, v_cache, idx):
    if qkv.dim() != 3:
        raise ValueError(f"qkv must be [B, T, N], got {tuple(qkv.shape)}")
    B, T, N = qkv.shape
    D = q_w.shape[0]
    if D % 2 or D & (D - 1) or D < 32:
        raise ValueError(f"head_dim must be a power of two >= 32, got {D}")
    store = k_cache is not None
    if store != (v_cache is not None) or store != (idx is not None) or store != (k_w is not None):
        raise ValueError("a store layer passes k_w, k_cache, v_cache and idx together (a KV-shared layer: none)")
    hkv = k_cache.shape[2] if store else 0
    if N != (heads + 2 * hkv) * D:
        raise ValueError(f"qkv's last dim must be (heads + 2 kv heads) x head_dim = {(heads + 2 * hkv) * D}, got {N}")
    if cos.shape != (B, T, 1, D) or sin.shape != cos.shape:
        raise ValueError(f"cos / sin must be [B, T, 1, D] = {[B, T, 1, D]}, got {tuple(cos.shape)} / "
                         f"{tuple(sin.shape)}")
    if store:
        if k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
            raise ValueError(f"k / v caches must be [B, S, Hkv, D] with B={B}, D={D}, got {tuple(k_cache.shape)} / "
                             f"{tuple(v_cache.shape)}")
        if idx.shape != (B, T):
            raise ValueError(f"idx must be [B, T] = {[B, T]}, got {tuple(idx.shape)}")
        if k_w.shape != (D,):
            raise ValueError(f"k_w must be [{D}], got {tuple(k_w.shape)}")
    return B, T, D, hkv


def qkv_finish(qkv, q_w, k_w, cos, sin, k_cache=None, v_cache=None, idx=None, *, heads: int, eps: float,
               offset: float = 0.0, v_norm: bool = True, pdl: bool = False) -> torch.Tensor:
    """qkv [B, T, (H + 2 Hkv) D] (a KV-shared layer: [B, T, H D]), q_w / k_w [D], cos / sin [B, T, 1, D],
    the layer's caches [B, S, Hkv, D] and idx [B, T] (cache slot of each row) -> q [B, T, H, D]; k and v
    written into the caches. The caches must be contiguous along D; everything in one dtype."""
    B, T, D, hkv = _check(qkv, q_w, k_w, cos, sin, heads, k_cache, v_cache, idx)
    if not (qkv.is_cuda or _INTERPRET):
        raise RuntimeError("qkv_finish runs on CUDA tensors (or with TRITON_INTERPRET=1); use qkv_finish_ref")
    store = k_cache is not None
    if store and (k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1):
        raise ValueError("k / v caches must share strides, contiguous along D")
    q2 = qkv.reshape(B * T, -1)
    q2 = q2 if q2.stride(1) == 1 else q2.contiguous()
    cos2, sin2 = cos.reshape(B * T, D), sin.reshape(B * T, D)  # views of a compiled step's shared rope
    if cos2.stride() != sin2.stride() or cos2.stride(1) != 1:
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    q = torch.empty(B, T, heads, D, device=qkv.device, dtype=qkv.dtype)
    kc = k_cache if store else q
    _qkv_finish_kernel[(B * T, heads + 2 * hkv)](
        q2, q_w, k_w if store else q_w, cos2, sin2, idx if store else q2, q, kc, v_cache if store else q,
        T, q2.stride(0), cos2.stride(0), idx.stride(0) if store else 0, idx.stride(1) if store else 0,
        kc.stride(0), kc.stride(1), kc.stride(2), float(eps), float(offset),
        H=heads, HKV=hkv, D=D, V_NORM=v_norm, num_warps=1 if D <= 256 else 2, **pdl_args(pdl, qkv.device))
    return q


def qkv_finish_ref(qkv, q_w, k_w, cos, sin, k_cache=None, v_cache=None, idx=None, *, heads: int, eps: float,
                   offset: float = 0.0, v_norm: bool = True, pdl: bool = False) -> torch.Tensor:
    """The torch twin: fp32 norms rounded to qkv's dtype, RoPE in fp32 rounded once, the cache rows
    written by index_put."""
    B, T, D, hkv = _check(qkv, q_w, k_w, cos, sin, heads, k_cache, v_cache, idx)
    dt = qkv.dtype
    x = qkv.float().unflatten(-1, (heads + 2 * hkv, D))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(t, w):
        t = (t * (w.float() + offset)).to(dt).float()
        rot = torch.cat((-t[..., D // 2:], t[..., : D // 2]), dim=-1)
        return (t * cos.float() + rot * sin.float()).to(dt)

    q = rope(x[:, :, :heads], q_w)
    if hkv:
        bidx = torch.arange(B, device=qkv.device)[:, None]
        k_cache[bidx, idx] = rope(x[:, :, heads: heads + hkv], k_w)
        v = x[:, :, heads + hkv:] if v_norm else qkv.unflatten(-1, (heads + 2 * hkv, D))[:, :, heads + hkv:]
        v_cache[bidx, idx] = v.to(dt)
    return q


# flexible_layout: inductor hands the ops its own views (the step's one cos / sin buffer, the qkv
# GEMV's output) instead of a copy per layer in the strides traced (compiled with the default
# constraint, 42 copy kernels of the rope per E4B step, run CL); the launcher handles any strides.
@torch.library.custom_op("fastgemma::qkv_finish", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def qkv_finish_op(qkv: torch.Tensor, q_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, eps: float,
                  offset: float, pdl: bool) -> torch.Tensor:
    """A KV-shared layer's q (no cache writes)."""
    return qkv_finish(qkv, q_w, None, cos, sin, heads=heads, eps=eps, offset=offset, pdl=pdl)


@qkv_finish_op.register_fake
def _(qkv, q_w, cos, sin, heads, eps, offset, pdl):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], heads, q_w.shape[0])


@torch.library.custom_op("fastgemma::qkv_finish_store", mutates_args=("k_cache", "v_cache"),
                         tags=(torch.Tag.flexible_layout,))
def qkv_finish_store_op(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor, heads: int, eps: float,
                        offset: float, v_norm: bool, pdl: bool) -> torch.Tensor:
    """A store layer's q; its k and v written into the caches."""
    return qkv_finish(qkv, q_w, k_w, cos, sin, k_cache, v_cache, idx, heads=heads, eps=eps, offset=offset,
                      v_norm=v_norm, pdl=pdl)


@qkv_finish_store_op.register_fake
def _(qkv, q_w, k_w, cos, sin, k_cache, v_cache, idx, heads, eps, offset, v_norm, pdl):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], heads, q_w.shape[0])
