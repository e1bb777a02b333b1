"""One layer's launches as the fused steps (transforms/fused_steps.py) make them: the linears a step reads in a
layer, a linear through the tensor-core kernel (`_mma_call`) or the fused GEMVs with their prologues
(`_caller`), the norm fold's producer / consumer pair (`_Fold`), the residual update + norm of the wider
steps, the attention with its q/k/v work (`_qkv_attend`, `_attend_qkv`) and the embedding's PLE path."""
from __future__ import annotations

import torch
from torch import nn

from .fuse import split_qkv


def _layer_linears(i: int, layer) -> dict:
    """The linears the fused step reads in layer i, by role, each checked: dense bias-free
    nn.Linear (incl. GemvLinear), Int4Linear or Int8Linear."""
    from .gemv import GemvLinear
    from .quant import Int4Linear
    from .quant_int8 import Int8Linear

    at, m = layer.self_attn, layer.mlp
    named = {"in": ("self_attn.qkv_proj", at.qkv_proj) if layer.spec.stores_kv else ("self_attn.q_proj", at.q_proj),
             "o": ("self_attn.o_proj", at.o_proj), "gate_up": ("mlp.gate_up_proj", m.gate_up_proj),
             "down": ("mlp.down_proj", m.down_proj)}
    if layer.ple:
        named["ple_gate"] = ("per_layer_input_gate", layer.per_layer_input_gate)
        named["ple_proj"] = ("per_layer_projection", layer.per_layer_projection)
    for name, mod in named.values():
        if type(mod) not in (nn.Linear, GemvLinear, Int4Linear, Int8Linear) or mod.bias is not None:
            raise ValueError(f"fuse=layers runs bias-free dense, int4 or int8 linears through its fused GEMVs; "
                             f"layers.{i}.{name} is {type(mod).__name__}: use fuse=merged")
    return {role: mod for role, (_, mod) in named.items()}


def _mma_cfg(mod, M: int, epilogue: str, dtype, invariant: bool = False):
    """The tensor-core kernel's config for M rows through `mod`, or None: it takes an Int4Linear that
    holds its fragment-order copy (int4_mma), bf16 rows, an epilogue it has, a shape in its table.
    invariant: one config at every row count (mma_table.mma_config's; up to the kernel's 8, more is
    refused), so a row sums in the same order whatever rows sit beside it (the mma's columns are
    independent)."""
    from ..kernels.mma_table import MAX_ROWS, mma_config
    from ..kernels.mma_w4a16 import EPILOGUES
    from .quant import Int4Linear

    if not (isinstance(mod, Int4Linear) and mod.mma and epilogue in EPILOGUES and dtype == torch.bfloat16):
        return None
    if invariant and M > MAX_ROWS:
        raise ValueError(f"fuse.batch_invariant runs the int4 GEMMs on the tensor-core kernel, at most {MAX_ROWS} rows "
                         f"(speculative depth <= {MAX_ROWS - 1}); got {M} rows")
    cfg = mma_config(mod.out_features, mod.in_features, M, epilogue, invariant)
    if cfg is not None and cfg.pairs != mod.mma_pairs:
        raise ValueError(f"the tensor-core kernel's config {cfg} for the int4 {mod.out_features} x {mod.in_features} "
                         f"wants the {'paired' if cfg.pairs else 'natural'} GeGLU layout; the linear holds the other "
                         "(its copy is made by FuseLayers from the table at build time: set the table first)")
    return cfg


def _no_invariant_config(mod, epilogue: str) -> ValueError:
    return ValueError(f"fuse.batch_invariant: the tensor-core kernel does not take the int4 {mod.out_features} x "
                      f"{mod.in_features} with epilogue {epilogue} (int4_mma on, the shape in "
                      "kernels/mma_table.MMA_CONFIGS or INVARIANT_CONFIGS)")


def _mma_call(mod, x, epilogue: str, pdl: bool, cfg=None, invariant: bool = False):
    """x [M, K] through kernels/mma_w4a16.py with `cfg` (None: `_mma_cfg`'s); None where it has none."""
    from ..kernels.mma_w4a16 import config_args, mma_w4a16_op

    cfg = cfg or _mma_cfg(mod, x.shape[0], epilogue, x.dtype, invariant)
    if cfg is None:
        return None
    return mma_w4a16_op(x, mod.mma_words, mod.mma_sz, mod.out_features, mod.group_size, epilogue, *config_args(cfg),
                        pdl)


def _early_norm(cfg) -> bool:
    """Whether the residual norm before a GEMM on `cfg` lets it launch at once: the CUDA kernel's, whose ring of
    weight copies fills before its PDL wait (the verify pass's gate|up: 607 -> 520 us on its critical path, the k=7 step
    -0.7 to -0.9%, runs MG, MH; every norm so: the GEMMs before them slower by as much, no gain, runs MD, MF)."""
    return cfg is not None and cfg.cuda


def _residual_norm(a, y, post, scale, pre, eps: float, off: float, triton_ops: bool, pdl: bool, early: bool = False):
    """kernels/residual_norm.py's rows (triton_ops) or its twin -> (h, x); early: the kernel lets the next one launch
    before its own wait (`_early_norm`)."""
    from ..kernels.residual_norm import residual_norm_op, residual_norm_ref

    if triton_ops:
        return residual_norm_op(a, y, post, scale, pre, eps, off, pdl, early)
    return residual_norm_ref(a, y, post, scale, pre, eps=eps, offset=off)


def _final_norm(res, y, norm, scale, final, eps: float, off: float, kernel: bool, triton_ops: bool, pdl: bool):
    """The last layer's residual update and the model's final norm: final((res + norm(y)) * scale), in
    kernels/residual_norm.py's kernel (its twin without triton_ops) where `kernel`, else through the modules (a
    compiled step: inductor's ops) -> the normed row."""
    if kernel:
        return _residual_norm(res.reshape(1, -1), y.reshape(1, -1), norm.weight, scale, final.weight, eps, off,
                              triton_ops, pdl)[1]
    return final((res + norm(y)) * scale)


def _caller(gemv, gemv4, pdl: bool, eps: float, off: float, mma: bool = False, invariant: bool = False,
            triton_ops: bool = True):
    """call(a, linear, y, post, scale, pre, aux, epilogue) -> (out, h) through the dense or int4 op;
    mma: through kernels/mma_w4a16.py where `_mma_cfg` takes the linear at one row, a GEMV with a
    prologue (residual update and / or norm) after that prologue as its own launch
    (kernels/residual_norm.py, the verify pass's kernel: the same rounding). invariant
    (fuse.batch_invariant): every linear as the wider steps run it, the prologue on its own, then
    int4 on the tensor-core kernel (no other int4 path is taken) and dense as `_dense_rows` runs it, the
    epilogue in its store; triton_ops=False: their twins (the torch backend). An Int8Linear takes
    kernels/fused_w8a16.py's GEMV (no tensor-core or invariant form: FuseLayers refuses batch_invariant with it)."""
    from ..kernels.fused_w8a16 import fused_w8a16_op, fused_w8a16_ref
    from .quant import Int4Linear
    from .quant_int8 import Int8Linear

    def call(a, mod, y=None, post=None, scale=None, pre=None, aux=None, epilogue="none"):
        if isinstance(mod, Int8Linear):
            if triton_ops:
                return fused_w8a16_op(a, mod.qweight, mod.scales, y, post, scale, pre, aux, eps, off, epilogue, pdl)
            return fused_w8a16_ref(a, mod.qweight, mod.scales, y, post, scale, pre, aux, eps=eps, offset=off,
                                   epilogue=epilogue)
        cfg = _mma_cfg(mod, 1, epilogue, a.dtype, invariant) if mma and aux is None else None
        dense = invariant and not isinstance(mod, Int4Linear)
        if invariant and isinstance(mod, Int4Linear) and cfg is None and triton_ops:
            raise _no_invariant_config(mod, epilogue)
        if cfg is not None or dense:
            a2, h = a.reshape(1, -1), None
            if y is not None or pre is not None:
                h, x = _residual_norm(a2, y.reshape(1, -1) if y is not None else None, post, scale, pre, eps, off,
                                      triton_ops, pdl, _early_norm(cfg))
                a2 = x if pre is not None else h
                h = h if y is not None else None
            if cfg is not None:
                return _mma_call(mod, a2, epilogue, pdl, cfg), h
            return _dense_rows(a2, mod.weight, epilogue, aux.reshape(1, -1) if aux is not None else None, pdl,
                               triton_ops), h
        if isinstance(mod, Int4Linear):
            return gemv4(a, mod.qweight, mod.scales, mod.zeros, mod.group_size, y, post, scale, pre, aux, eps, off,
                         epilogue, pdl)
        return gemv(a, mod.weight, y, post, scale, pre, aux, eps, off, epilogue, pdl)

    return call


def _dense_rows(x2, w, epilogue: str, aux, pdl: bool, triton_ops: bool = True):
    """x2 [M, K] (M <= 16) @ a dense w^T through `epilogue`, as the fused steps run a dense linear at every row
    count: a small weight on the rows GEMV (kernels/rows_gemv.py: the PLE gate), a larger one on the skinny GEMM
    (kernels/skinny_gemm.py), chosen by the weight's shape and size only, so that a row's result is the same at
    one row and among k + 1 (fuse.batch_invariant); triton_ops=False: their twin."""
    from ..kernels import rows_gemv
    from ..kernels.skinny_gemm import skinny_matmul_op, skinny_matmul_ref

    if not triton_ops:
        return skinny_matmul_ref(x2, w, epilogue=epilogue, aux=aux)
    if rows_gemv.fits(x2.shape[0], *w.shape, w.numel() * w.element_size(), epilogue):
        return rows_gemv.rows_gemv_op(x2, w, epilogue, aux, pdl)
    return skinny_matmul_op(x2, w, epilogue, aux, pdl)


class _Fold:
    """fuse.norm_fold: the residual update + norm between two one-row tensor-core GEMVs folded into
    them (kernels/norm_fold.py): `pair` says whether a producer / consumer pair takes it, `produce`
    runs the producer (its output, the two rows and the partials), `consume` the consumer (its
    output and h)."""

    def __init__(self, eps: float, off: float, pdl: bool):
        self.eps, self.off, self.pdl = eps, off, pdl

    @staticmethod
    def pair(prod, cons, epilogue: str) -> bool:
        from ..kernels.mma_fold import consumer_problem, producer_problem

        pc = _mma_cfg(prod, 1, "none", torch.bfloat16)
        cc = _mma_cfg(cons, 1, epilogue, torch.bfloat16)
        return (pc is not None and cc is not None and prod.out_features == cons.in_features
                and producer_problem(pc, prod.out_features, prod.in_features, prod.group_size) is None
                and consumer_problem(cc, cons.out_features, cons.in_features, cons.group_size, epilogue) is None)

    @staticmethod
    def takes_parts(prod, splits: int, heads: int, head_dim: int) -> bool:
        """Whether the producer prod can take a one-row attention's `splits` partials of `heads` heads of
        head_dim (fuse.attn_fold, kernels/attn_fold.py): its one-row config is persistent, the attention
        has more than one split (one writes its output itself), and the partials fit (`parts_shape_problem`)."""
        from ..kernels.attn_fold import parts_shape_problem

        cfg = _mma_cfg(prod, 1, "none", torch.bfloat16)
        return (cfg is not None and cfg.persist > 0 and splits > 1
                and parts_shape_problem(heads, head_dim, splits, prod.in_features, prod.group_size) is None)

    def produce(self, x, mod, res, post, pre):
        """x: the activation row, or (o_part, lse): a one-row attention's split partials."""
        from ..kernels.mma_fold import mma_rows_op
        from ..kernels.mma_w4a16 import config_args

        x, lse = x if isinstance(x, tuple) else (x.reshape(1, -1), None)
        cfg = _mma_cfg(mod, 1, "none", x.dtype)
        return mma_rows_op(x, mod.mma_words, mod.mma_sz, mod.out_features, mod.group_size,
                           res.reshape(-1), post, pre, self.off, *config_args(cfg), self.pdl, lse)

    def consume(self, mod, rows, parts, res, y, post, scale, epilogue: str = "none"):
        from ..kernels.mma_fold import mma_fold_op
        from ..kernels.mma_w4a16 import config_args

        cfg = _mma_cfg(mod, 1, epilogue, rows.dtype)
        return mma_fold_op(rows, parts, mod.mma_words, mod.mma_sz, mod.out_features, mod.group_size, epilogue,
                           res.reshape(-1), y.reshape(-1), post, scale, self.eps, self.off, *config_args(cfg),
                           self.pdl)


def _finish_q(at, q, cos, sin, kernel: bool, pdl: bool = False):
    """A query-only projection q [B, T, H*D] -> q_norm + RoPE [B, T, H, D]: one launch of
    kernels/qkv_finish.py (kernel) or `split_qkv` (the twin)."""
    if not kernel:
        return split_qkv(at, q, cos, sin)[0]
    from ..kernels.qkv_finish import qkv_finish_op

    qn = at.q_norm
    return qkv_finish_op(q, qn.weight, cos, sin, at.num_heads, qn.eps, qn.offset, pdl)


def _qkv_attend(layer, qkv, store_attend, cache, kernel: bool, pdl: bool = False, attn_qkv: bool = False,
                attn_tiles: dict | None = None, parts: bool = False, query_qkv: bool = False):
    """The attention output [B, T, H*D] from the merged projection's qkv [B, T, N]. kernel: q/k/v
    norms, RoPE and the cache writes in one launch (kernels/qkv_finish.py), then the attention
    alone; attn_qkv: all of it in the attention's split kernel (`_attend_qkv`, with `attn_tiles`;
    parts: its split partials (o_part, lse) instead, no combine); query_qkv (fuse.attn_qkv under
    fuse.batch_invariant): a KV-shared layer's q norm + RoPE in the split kernel, its per-position row
    tiles (a store layer keeps `kernel`'s launch); else `split_qkv` and the static step's own writes
    (the twin)."""
    at, s = layer.self_attn, layer.spec
    cos, sin = store_attend.rope[s.sliding]
    if attn_qkv:
        return _attend_qkv(at, s, qkv, cos, sin, cache, store_attend.pos, store_attend.slots[s.sliding],
                           store_attend.options, store_attend.scale, attn_tiles, parts)
    if not s.stores_kv:  # a KV-shared layer: q only
        if query_qkv:
            return _attend_qkv(at, s, qkv, cos, sin, cache, store_attend.pos, None,
                               dict(store_attend.options, per_position=True), store_attend.scale, attn_tiles)
        return store_attend.attend(layer, _finish_q(at, qkv, cos, sin, kernel, pdl))
    if not kernel:
        return store_attend(layer, *split_qkv(at, qkv, cos, sin))
    from ..kernels.qkv_finish import qkv_finish_store_op
    from ..model.layers import RMSNorm

    qn = at.q_norm
    q = qkv_finish_store_op(qkv, qn.weight, at.k_norm.weight, cos, sin, cache.k[s.index], cache.v[s.index],
                            store_attend.slots[s.sliding], at.num_heads, qn.eps, qn.offset,
                            isinstance(at.v_norm, RMSNorm), pdl)
    return store_attend.attend(layer, q)


def _attn_kind(s) -> str:
    """A layer's kind for fuse.attn_tiles: sliding / full, store / query."""
    return f"{'sliding' if s.sliding else 'full'}_{'store' if s.stores_kv else 'query'}"


def _attn_splits(layer, cache, tiles: dict | None) -> int:
    """The split count of the layer's one-row attention in the q/k/v mode (its own rows' split included)."""
    from ..kernels.attention_tiles import qkv_splits

    at, s = layer.self_attn, layer.spec
    src = s.index if s.stores_kv else s.kv_source
    return qkv_splits(cache.k[src], at.num_heads, at.head_dim, s.stores_kv, (tiles or {}).get(_attn_kind(s), ""))


def _attend_qkv(at, s, qkv, cos, sin, cache, q_pos, slots, options: dict, scale: float = 1.0,
                tiles: dict | None = None, parts: bool = False):
    """kernels/decode_attention.py's q/k/v mode: q [B, T, H*D] (a query-only layer, s.stores_kv False:
    KV-shared, or the drafter) or q|k|v rows [B, T, (H + 2 Hkv) D] (a store layer: its K / V written at
    `slots`) -> the attention output [B, T, H*D] over the cache of s.kv_source; `options`: the
    attention's pdl / merge; `tiles`: {layer kind: 'NxWsS'} (`fuse.attn_tiles`, parse_qkv_tiles)
    for the kinds whose tiles are not the kernel's own. parts (one row): the split partials (o_part
    [Hkv, splits, H / Hkv, D], lse) instead, for the o GEMV to combine (fuse.attn_fold)."""
    from ..kernels import decode_attention as da
    from ..model.layers import RMSNorm

    qn, src = at.q_norm, s.kv_source
    ring, window = (cache.ring_pos, cache.window) if s.sliding else (None, 0)
    common = dict(window=window, heads=at.num_heads, eps=qn.eps, offset=qn.offset, scale=scale,
                  tiles=(tiles or {}).get(_attn_kind(s), ""), **options)
    if parts:
        common.pop("merge", None)
        if not s.stores_kv:
            return da.decode_attention_qkv_parts_op(qkv, qn.weight, cos, sin, cache.k[src], cache.v[src], q_pos, ring,
                                                    **common)
        return da.decode_attention_qkv_store_parts_op(qkv, qn.weight, at.k_norm.weight, cos, sin, cache.k[s.index],
                                                      cache.v[s.index], slots, q_pos, ring,
                                                      v_norm=isinstance(at.v_norm, RMSNorm), **common)
    if not s.stores_kv:
        o = da.decode_attention_qkv_op(qkv, qn.weight, cos, sin, cache.k[src], cache.v[src], q_pos, ring, **common)
    else:
        o = da.decode_attention_qkv_store_op(qkv, qn.weight, at.k_norm.weight, cos, sin, cache.k[s.index],
                                             cache.v[s.index], slots, q_pos, ring,
                                             v_norm=isinstance(at.v_norm, RMSNorm), **common)
    return o.flatten(2)


def _embed(model, ids, invariant: bool, triton_ops: bool, pdl: bool, mma: bool = False, x0=None):
    """model.embed(ids); invariant (fuse.batch_invariant, Triton): the PLE context projection on the
    tensor-core kernel's one-row config (int4) or as `_dense_rows` runs a dense one, and its RMSNorm in
    kernels/residual_norm.py, one program per row, so each row's PLE input does not depend on the
    rows beside it (a dense projection's cuBLAS GEMV and GEMM, inductor's reductions, may sum in
    other orders at 1 and k+1 rows). mma (fuse.int4_mma, Triton), not invariant: an int4 projection on the
    tensor-core kernel where its table has the rows' config (else the linear's own launch), the norm as
    the model computes it. x0: the tokens' scaled embeddings already computed (kernels/step_start.py): only the PLE
    inputs are computed here."""
    def embed(project=None, norm=None):
        return model.embed(ids, project, norm) if x0 is None else (x0, model.ple_inputs(ids, x0, project, norm))

    if not (triton_ops and model.ple_projected and (invariant or mma)):
        return embed()  # (ple=table: a row gather, the same for every row count)
    proj, norm, c = model.per_layer_model_projection, model.per_layer_projection_norm, model.config
    if not invariant:
        def on_mma(x0):
            y = _mma_call(proj, x0.reshape(-1, x0.shape[-1]), "none", pdl)
            return proj(x0) if y is None else y.reshape(*x0.shape[:-1], -1)

        return embed(on_mma)
    from ..kernels.residual_norm import residual_norm_op
    from .quant import Int4Linear

    def project(x0):
        x2 = x0.reshape(-1, x0.shape[-1])
        y = (_mma_call(proj, x2, "none", pdl, invariant=True) if isinstance(proj, Int4Linear)
             else _dense_rows(x2, proj.weight, "none", None, pdl))
        if y is None:
            raise _no_invariant_config(proj, "none")
        return y.reshape(*x0.shape[:-1], -1)

    def rms(t):
        return residual_norm_op(t.reshape(-1, t.shape[-1]), None, None, None, norm.weight, c.rms_eps,
                                c.norm_offset, pdl)[1].reshape(t.shape)

    return embed(project, rms)
