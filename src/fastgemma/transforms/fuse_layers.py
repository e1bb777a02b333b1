"""`fuse=layers`: merged projections, and a one-row decode step whose GEMVs carry the layer's
elementwise work (kernels/fused_gemv.py).

Per layer at one row, five GEMVs with their neighbours folded in, then the PLE projection:

    q|k|v    <- prologue: residual += post_per_layer_norm(previous PLE projection) (x layer scalar),
                then input_layernorm (layer 0: input_layernorm of the embedding)
    o        <- the attention output as is
    gate|up  <- prologue: residual += post_attention_layernorm(o), then pre_feedforward_layernorm;
                epilogue: gelu_tanh(gate) * up
    down     <- the GeGLU output as is
    PLE gate <- prologue: residual += post_feedforward_layernorm(down); epilogue: gelu_tanh(.) * PLE input
    PLE proj <- the gated PLE input as is

q/k/v norms, RoPE and the cache writes are the static step's own (compiled, they fuse among
themselves), or with `qkv_kernel` one launch per layer (kernels/qkv_finish.py, which rounds as
eager torch does; `bench.spec --verify-qkv`, `bench.stack --variants`). Models without PLE carry
the MLP's residual into the next q|k|v instead.
The step's rows decide it when the step is traced: one row (batch 1 decode) takes this path,
wider steps (the verify pass, batches) `fused_verify`: the layer's GEMMs with GeGLU in the int4
gate|up GEMM's store and gelu_tanh(PLE gate) * PLE input in the PLE gate's (int4, or the dense
skinny GEMM of kernels/skinny_gemm.py), and each residual update with the next norm in one
kernel per row (kernels/residual_norm.py). The MTP drafter's one-row step takes the
same GEMVs (`fused_draft`: pre-projection, then per layer q, o, gate|up + GeGLU, down, then the
post-projection), set on the drafter by `model.fuse_drafter` when speculative decoding builds it.
Its centroid-masked head is kernels/draft_head.py's two launches (the twin on the torch backend):
draft loop 0.760 -> 0.719 ms at k=7 against torch's topk path on the H200 (run EA); `model.draft_head`
is that op, `head=None` torch's path.
Linears may be dense 16-bit (`fused_gemv`) or Int4Linear (quant=int4: `fused_w4a16`), each layer
as it is; other kinds (nf4) are refused in one line (use fuse=merged).
`pdl=True` launches every fused GEMV with programmatic dependent launch (sm90+), and in wider
steps the GEMMs, norm kernels and the q/k/v kernel; `attn_pdl=True` the attention's split and
combine kernels as well (without it they launch plainly, and so does the kernel after them);
`attn_merge=True` drops the combine launch where a tile's partials are few (the split tile's last
program merges them; decode_attention.MERGE_MAX_ELEMS);
`attn_qkv=True` does the q/k/v norms, RoPE and cache writes inside the attention's split kernel
(kernels/decode_attention.py's q/k/v mode) in the one-row step and the drafter's step;
`attn_tiles` (e.g. "full_store:32x16s2") sets that mode's tiles per layer kind instead of the
kernel's own choice (`attention_tiles.parse_qkv_tiles`), so tile choices compare in one process.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from .fuse import MergeProjections, split_qkv

log = logging.getLogger(__name__)


def _layer_linears(i: int, layer) -> dict:
    """The linears the fused step reads in layer i, by role, each checked: dense bias-free
    nn.Linear (incl. GemvLinear) or Int4Linear."""
    from .gemv import GemvLinear
    from .quant import Int4Linear

    at, m = layer.self_attn, layer.mlp
    named = {"in": ("self_attn.qkv_proj", at.qkv_proj) if layer.spec.stores_kv else ("self_attn.q_proj", at.q_proj),
             "o": ("self_attn.o_proj", at.o_proj), "gate_up": ("mlp.gate_up_proj", m.gate_up_proj),
             "down": ("mlp.down_proj", m.down_proj)}
    if layer.ple:
        named["ple_gate"] = ("per_layer_input_gate", layer.per_layer_input_gate)
        named["ple_proj"] = ("per_layer_projection", layer.per_layer_projection)
    for name, mod in named.values():
        if type(mod) not in (nn.Linear, GemvLinear, Int4Linear) or mod.bias is not None:
            raise ValueError(f"fuse=layers runs bias-free dense or int4 linears through its fused GEMVs; "
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


def _residual_norm(a, y, post, scale, pre, eps: float, off: float, triton_ops: bool, pdl: bool):
    """kernels/residual_norm.py's rows (triton_ops) or its twin -> (h, x)."""
    from ..kernels.residual_norm import residual_norm_op, residual_norm_ref

    if triton_ops:
        return residual_norm_op(a, y, post, scale, pre, eps, off, pdl)
    return residual_norm_ref(a, y, post, scale, pre, eps=eps, offset=off)


def _caller(gemv, gemv4, pdl: bool, eps: float, off: float, mma: bool = False, invariant: bool = False,
            triton_ops: bool = True):
    """call(a, linear, y, post, scale, pre, aux, epilogue) -> (out, h) through the dense or int4 op;
    mma: through kernels/mma_w4a16.py where `_mma_cfg` takes the linear at one row, a GEMV with a
    prologue (residual update and / or norm) after that prologue as its own launch
    (kernels/residual_norm.py, the verify pass's kernel: the same rounding). invariant
    (fuse.batch_invariant): every linear as the wider steps run it, the prologue on its own, then
    int4 on the tensor-core kernel (no other int4 path is taken) and dense on the skinny GEMM with
    the epilogue in its store; triton_ops=False: their twins (the torch backend)."""
    from ..kernels.skinny_gemm import skinny_matmul_op, skinny_matmul_ref
    from .quant import Int4Linear

    def call(a, mod, y=None, post=None, scale=None, pre=None, aux=None, epilogue="none"):
        cfg = _mma_cfg(mod, 1, epilogue, a.dtype, invariant) if mma and aux is None else None
        dense = invariant and not isinstance(mod, Int4Linear)
        if invariant and isinstance(mod, Int4Linear) and cfg is None and triton_ops:
            raise _no_invariant_config(mod, epilogue)
        if cfg is not None or dense:
            a2, h = a.reshape(1, -1), None
            if y is not None or pre is not None:
                h, x = _residual_norm(a2, y.reshape(1, -1) if y is not None else None, post, scale, pre, eps, off,
                                      triton_ops, pdl)
                a2 = x if pre is not None else h
                h = h if y is not None else None
            if cfg is not None:
                return _mma_call(mod, a2, epilogue, pdl, cfg), h
            aux2 = aux.reshape(1, -1) if aux is not None else None
            if triton_ops:
                return skinny_matmul_op(a2, mod.weight, epilogue, aux2, pdl), h
            return skinny_matmul_ref(a2, mod.weight, epilogue=epilogue, aux=aux2), h
        if isinstance(mod, Int4Linear):
            return gemv4(a, mod.qweight, mod.scales, mod.zeros, mod.group_size, y, post, scale, pre, aux, eps, off,
                         epilogue, pdl)
        return gemv(a, mod.weight, y, post, scale, pre, aux, eps, off, epilogue, pdl)

    return call


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


def _embed(model, ids, invariant: bool, triton_ops: bool, pdl: bool):
    """model.embed(ids); invariant (fuse.batch_invariant, Triton): the PLE context projection on the
    tensor-core kernel's one-row config (int4) or the skinny GEMM (dense) and its RMSNorm in
    kernels/residual_norm.py, one program per row, so each row's PLE input does not depend on the
    rows beside it (a dense projection's cuBLAS GEMV and GEMM, inductor's reductions, may sum in
    other orders at 1 and k+1 rows)."""
    if not (invariant and triton_ops and model.config.ple_dim):
        return model.embed(ids)
    from ..kernels.residual_norm import residual_norm_op
    from ..kernels.skinny_gemm import skinny_matmul_op
    from .quant import Int4Linear

    proj, norm, c = model.per_layer_model_projection, model.per_layer_projection_norm, model.config

    def project(x0):
        x2 = x0.reshape(-1, x0.shape[-1])
        y = (_mma_call(proj, x2, "none", pdl, invariant=True) if isinstance(proj, Int4Linear)
             else skinny_matmul_op(x2, proj.weight, "none", None, pdl))
        if y is None:
            raise _no_invariant_config(proj, "none")
        return y.reshape(*x0.shape[:-1], -1)

    def rms(t):
        return residual_norm_op(t.reshape(-1, t.shape[-1]), None, None, None, norm.weight, c.rms_eps,
                                c.norm_offset, pdl)[1].reshape(t.shape)

    return model.embed(ids, project, rms)


def fused_decode(model, ids, pos, cache, gemv, gemv4, pdl: bool = False, qkv_kernel: bool = False,
                 attn_pdl: bool = False, attn_merge: bool = False, int4_mma: bool = False, attn_qkv: bool = False,
                 batch_invariant: bool = False, triton_ops: bool = True, attn_tiles: dict | None = None,
                 norm_fold: bool = False, attn_fold: bool = False, query_qkv: bool = False):
    """One-row static step -> final-norm hidden [1, 1, hidden]. gemv / gemv4: the dense / int4
    fused ops (fused_gemv_op, fused_w4a16_op) or their twins. attn_pdl: the attention kernels launch
    with programmatic dependent launch too; attn_merge: the split kernel merges its partials, no
    combine launch (kernels/decode_attention.py); int4_mma: int4 GEMVs on the tensor-core kernel where
    its table has their shape at one row (kernels/mma_w4a16.py; a prologue then runs on its own in
    kernels/residual_norm.py); attn_qkv: q/k/v norms, RoPE and cache writes in the attention's split
    kernel (kernels/decode_attention.py's q/k/v mode, no qkv_finish launch; its tiles per layer kind
    from `attn_tiles`, else the kernel's own); batch_invariant: every
    row computed as `fused_verify` computes it with the same switch (the embedding's PLE path, each
    linear, the attention's tiles and splits, the last norm), so a verify pass's rows equal the AR
    steps' bit for bit (query_qkv: the KV-shared layers' q norm + RoPE in the attention's split
    kernel, per-position tiles, `_qkv_attend`); triton_ops=False: the twins of the kernels that adds
    (the torch backend);
    norm_fold (with int4_mma, Triton, not batch_invariant): the residual update + norm between o and
    gate|up, and between the PLE projection (down without PLE) and the next layer's q|k|v or q, folded
    into those tensor-core GEMVs (kernels/norm_fold.py) where both have a one-row config that takes it;
    attn_fold (with norm_fold and attn_qkv): the attention's combine folded into o where o is the fold's
    producer and the attention has 2-8 splits (kernels/attn_fold.py: E4B's sliding layers)."""
    c = model.config
    x, ple = _embed(model, ids, batch_invariant, triton_ops, pdl)
    store_attend = model.step_store_attend(ids, pos, cache, attn_pdl, attn_merge, batch_invariant)
    call = _caller(gemv, gemv4, pdl, c.rms_eps, c.norm_offset, int4_mma, batch_invariant, triton_ops)
    fold = _Fold(c.rms_eps, c.norm_offset, pdl) if norm_fold and int4_mma and triton_ops and not batch_invariant \
        else None
    h = x.reshape(1, -1)
    # a residual update not yet applied: (res, y, norm, scale, rows, parts): h = (res + norm(y)) * scale;
    # rows / parts: the fold's, when the GEMV that made y was its producer (else None)
    pend = None
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        lin = _layer_linears(i, layer)
        pre = layer.input_layernorm.weight
        if pend is None:
            qkv, _ = call(h, lin["in"], pre=pre)
        elif pend[4] is not None:
            qkv, h = fold.consume(lin["in"], pend[4], pend[5], pend[0], pend[1], pend[2].weight, pend[3])
        else:
            qkv, h = call(pend[0], lin["in"], pend[1], pend[2].weight, pend[3], pre)
        folds_o = fold is not None and fold.pair(lin["o"], lin["gate_up"], "geglu")
        at = layer.self_attn
        attn_parts = (folds_o and attn_fold and attn_qkv and fold.takes_parts(
            lin["o"], _attn_splits(layer, cache, attn_tiles), at.num_heads, at.head_dim))
        attn = _qkv_attend(layer, qkv.reshape(1, 1, -1), store_attend, cache, qkv_kernel, pdl, attn_qkv, attn_tiles,
                           attn_parts, query_qkv)
        post_a, pre_f = layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight
        if folds_o:
            o, rows, parts = fold.produce(attn, lin["o"], h, post_a, pre_f)
            act, h = fold.consume(lin["gate_up"], rows, parts, h, o, post_a, None, "geglu")
        else:
            o, _ = call(attn.reshape(1, -1), lin["o"])
            act, h = call(h, lin["gate_up"], o, post_a, None, pre_f, epilogue="geglu")
        # the next layer's q|k|v (or q) and its norm: a consumer of the GEMV that ends this layer?
        nxt = (_layer_linears(i + 1, layers[i + 1])["in"], layers[i + 1].input_layernorm.weight) \
            if fold is not None and i + 1 < len(layers) else None
        last = lin["ple_proj"] if layer.ple else lin["down"]
        folds = nxt is not None and fold.pair(last, nxt[0], "none")
        if layer.ple:
            dn, _ = call(act, lin["down"])
            g, h = call(h, lin["ple_gate"], dn, layer.post_feedforward_layernorm.weight, aux=ple[0, 0, i],
                        epilogue="gelu_mul")
            norm, x_last = layer.post_per_layer_input_norm, g
        else:
            norm, x_last = layer.post_feedforward_layernorm, act
        if folds:
            y, rows, parts = fold.produce(x_last, last, h, norm.weight, nxt[1])
            pend = (h, y, norm, layer.layer_scalar, rows, parts)
        else:
            y, _ = call(x_last, last)
            pend = (h, y, norm, layer.layer_scalar, None, None)
    res, y, norm, scale = pend[:4]  # the last layer's update, in torch (no GEMV follows it)
    if batch_invariant:  # in the verify pass's kernel
        _, out = _residual_norm(res.reshape(1, -1), y.reshape(1, -1), norm.weight, scale, model.norm.weight,
                                c.rms_eps, c.norm_offset, triton_ops, pdl)
        return out.reshape(1, 1, -1)
    return model.norm((res + norm(y)) * scale).reshape(1, 1, -1)


# dense weights up to this size take the skinny GEMM in wider steps (the PLE gate: 1.3 MB); larger
# dense GEMMs (a bf16 body's gate|up) stay with cuBLAS and torch's epilogue
SKINNY_MAX_BYTES = 4 << 20


def _int4_epilogue(mod, x2, epilogue: str, a2, triton: bool, pdl: bool):
    """An Int4Linear's x2 [M, K] through the per-group kernel's store epilogue (or its twin)."""
    from ..kernels.w4a16 import w4a16_epilogue_op, w4a16_matmul, w4a16_torch

    w = (mod.qweight, mod.scales, mod.zeros, mod.group_size)
    if not triton:
        return w4a16_torch(x2, *w, epilogue=epilogue, aux=a2)
    if mod.config is not None:  # the module's tile override, honoured as Int4Linear.forward does
        return w4a16_matmul(x2, *w, mod.config, epilogue, a2, mod.sz, pdl)
    return w4a16_epilogue_op(x2, *w, epilogue, a2, mod.sz, pdl)


def _epilogue_call(mod, x, epilogue: str, aux=None, triton_ops: bool = True, pdl: bool = False,
                   int4_mma: bool = False, invariant: bool = False):
    """mod(x) [B, T, N] through `epilogue` (kernels.w4a16.apply_epilogue), in the GEMM's store where a
    kernel can: the int4 per-group kernel (Int4Linear), the skinny GEMM (small dense weights, <= 16
    rows); otherwise the GEMM, then torch's epilogue. No epilogue: a dense linear is mod(x) itself;
    an Int4Linear's tile override (`config`) holds, as in its forward.
    `pdl`: the Triton GEMMs launch with programmatic dependent launch. `int4_mma`: an Int4Linear goes
    to the tensor-core kernel where `_mma_call` takes it (<= 8 rows, a shape in its table). invariant
    (fuse.batch_invariant): the one-row step's kernels and configs at any row count (`_caller`): int4
    on the tensor-core kernel's one-row entry only, dense on the skinny GEMM whatever its size."""
    from ..kernels.skinny_gemm import fits, skinny_matmul_op, skinny_matmul_ref
    from ..kernels.w4a16 import apply_epilogue
    from .quant import Int4Linear

    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    a2 = None if aux is None else aux.reshape(x2.shape[0], -1)
    if isinstance(mod, Int4Linear):
        triton = triton_ops and mod.backend == "triton"
        y = _mma_call(mod, x2, epilogue, pdl, invariant=invariant) if int4_mma and triton else None
        if y is None and invariant and triton:
            raise _no_invariant_config(mod, epilogue)
        if y is None:
            y = _int4_epilogue(mod, x2, epilogue, a2, triton, pdl)
    elif epilogue == "none" and not invariant:
        return mod(x)
    elif fits(*x2.shape) and (invariant or mod.weight.numel() * mod.weight.element_size() <= SKINNY_MAX_BYTES):
        y = (skinny_matmul_op(x2, mod.weight, epilogue, a2, pdl) if triton_ops
             else skinny_matmul_ref(x2, mod.weight, epilogue=epilogue, aux=a2))
    else:
        y = apply_epilogue(torch.nn.functional.linear(x2, mod.weight), epilogue, a2)
    return y.reshape(*lead, -1)


def fused_verify(model, ids, pos, cache, triton_ops: bool = True, norm_kernels: bool = True, pdl: bool = False,
                 qkv_kernel: bool = False, attn_pdl: bool = False, attn_merge: bool = False, int4_mma: bool = False,
                 attn_qkv: bool = False, batch_invariant: bool = False, attn_tiles: dict | None = None,
                 query_qkv: bool = False):
    """Wider static steps (the verify pass, batches) under fuse=layers: the layer's GEMMs with two
    epilogues in their stores: GeGLU in gate|up and gelu_tanh(PLE gate) * PLE input in the PLE gate
    (`_epilogue_call`); between them, each residual update and the next norm in one kernel per row
    (kernels/residual_norm.py: the one-row fused GEMV's prologue, as `fused_decode` groups them)
    instead of compiled reductions; q/k/v norms, RoPE and the cache writes in one launch per layer
    with `qkv_kernel` (kernels/qkv_finish.py; False, the default: the static step's own ops).
    norm_kernels=False: the same updates as torch code (the twin), which torch.compile turns into
    its own reductions (the baseline of `bench.spec --verify-norms`). int4_mma: int4 GEMMs of <= 8 rows
    on the tensor-core kernel where its table has their shape (kernels/mma_w4a16.py).
    pdl=True (fuse.pdl, sm90+): the GEMMs, norm kernels and q/k/v kernels launch with programmatic
    dependent launch: each waits for the kernel before it first, and lets the next one launch after
    its main loop (`bench.spec --verify-pdl`). attn_pdl: the attention kernels too (each waits first
    and lets the next launch at once; `bench.spec --attn-pdl`); attn_merge: no combine launch;
    attn_qkv: q/k/v norms, RoPE and cache writes in the attention's split kernel (`--verify-attn-qkv`;
    its tiles per layer kind from `attn_tiles`).
    batch_invariant: each row computed as `fused_decode` computes it with the same switch (the
    tensor-core kernel's one-row configs, the skinny GEMM for dense linears, the attention's row
    tiles per group of positions with the one-row split count, the embedding's PLE path in kernels): the
    verify pass's rows equal the AR steps' bit for bit. query_qkv: as `fused_decode`'s."""
    c = model.config
    eps, off = c.rms_eps, c.norm_offset

    def rn(a, y=None, post=None, scale=None, pre=None):
        h, x = _residual_norm(a, y, post, scale, pre, eps, off, triton_ops and norm_kernels, pdl)
        return (h if y is not None else a), (x if pre is not None else None)

    def gemm(mod, x, epilogue="none", aux=None):
        return _epilogue_call(mod, x, epilogue, aux, triton_ops=triton_ops, pdl=pdl, int4_mma=int4_mma,
                              invariant=batch_invariant)

    x, ple = _embed(model, ids, batch_invariant, triton_ops, pdl)
    lead = x.shape[:-1]
    store_attend = model.step_store_attend(ids, pos, cache, attn_pdl, attn_merge, batch_invariant)
    h = x.reshape(-1, x.shape[-1])
    pend = None  # a residual update not yet applied: (res, y, norm, scale)
    for i, layer in enumerate(model.layers):
        lin = _layer_linears(i, layer)
        pre = layer.input_layernorm.weight
        if pend is None:
            h, xin = rn(h, pre=pre)
        else:
            h, xin = rn(pend[0], pend[1], pend[2].weight, pend[3], pre)
        qkv = gemm(lin["in"], xin.reshape(*lead, -1))
        attn = _qkv_attend(layer, qkv, store_attend, cache, triton_ops and qkv_kernel, pdl, triton_ops and attn_qkv,
                           attn_tiles, query_qkv=triton_ops and query_qkv)
        o = gemm(lin["o"], attn).reshape(h.shape)
        h, xff = rn(h, o, layer.post_attention_layernorm.weight, None, layer.pre_feedforward_layernorm.weight)
        act = gemm(lin["gate_up"], xff, "geglu")
        dn = gemm(lin["down"], act)
        if layer.ple:
            h, _ = rn(h, dn, layer.post_feedforward_layernorm.weight)
            g = gemm(lin["ple_gate"], h, "gelu_mul", ple[:, :, i].reshape(h.shape[0], -1))
            pend = (h, gemm(lin["ple_proj"], g), layer.post_per_layer_input_norm, layer.layer_scalar)
        else:
            pend = (h, dn, layer.post_feedforward_layernorm, layer.layer_scalar)
    _, out = rn(pend[0], pend[1], pend[2].weight, pend[3], model.norm.weight)
    return out.reshape(*lead, -1)


def fused_draft(d, x, rope, q_pos, cache, attn, gemv, gemv4, pdl: bool = False, attn_pdl: bool = False,
                qkv_kernel: bool = False, attn_merge: bool = False, attn_qkv: bool = False,
                attn_tiles: dict | None = None):
    """The MTP drafter's one-row step (Drafter.forward at B = 1) through the fused GEMVs: x [1, 1, 2 H]
    -> g [1, 1, hidden] (final-norm), h' [1, 1, H]. Per layer (query-only, no PLE): q (prologue: the
    previous layer's residual update with its layer scalar, then input_layernorm), o, gate|up (+ the
    residual update, pre_feedforward_layernorm, GeGLU), down; q norm + RoPE (torch, or one launch of
    kernels/qkv_finish.py with `qkv_kernel`) and the attention over the target's K/V as in the unfused
    step (its kernels under PDL with `attn_pdl`, no combine launch with `attn_merge`; with `attn_qkv`
    the q norm + RoPE in the attention's split kernel, kernels/decode_attention.py's q/k/v mode).
    The last update and the final norm run in torch."""
    body = d.config.body_config()
    if attn_pdl or attn_merge:
        attn = functools.partial(attn, pdl=attn_pdl, merge=attn_merge)
    call = _caller(gemv, gemv4, pdl, body.rms_eps, body.norm_offset)
    h, _ = call(x.reshape(1, -1), d.pre_projection)
    pend = None
    for layer in d.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        pre = layer.input_layernorm.weight
        if pend is None:
            q, _ = call(h, at.q_proj, pre=pre)
        else:
            q, h = call(pend[0], at.q_proj, pend[1], pend[2].weight, pend[3], pre)
        if attn_qkv:
            a = _attend_qkv(at, layer.spec, q.reshape(1, 1, -1), *rope[layer.spec.sliding], cache, q_pos, None,
                            dict(pdl=attn_pdl, merge=attn_merge), tiles=attn_tiles)
        else:
            q = _finish_q(at, q.reshape(1, 1, -1), *rope[layer.spec.sliding], qkv_kernel, pdl)
            a = d.attend_target(layer, q, q_pos, cache, attn)
        o, _ = call(a.reshape(1, -1), at.o_proj)
        act, h = call(h, mlp.gate_up_proj, o, layer.post_attention_layernorm.weight, None,
                      layer.pre_feedforward_layernorm.weight, epilogue="geglu")
        dn, _ = call(act, mlp.down_proj)
        pend = (h, dn, layer.post_feedforward_layernorm, layer.layer_scalar)
    res, y, norm, scale = pend
    g = d.model.norm((res + norm(y)) * scale)
    hp, _ = call(g, d.post_projection)
    return g.reshape(1, 1, -1), hp.reshape(1, 1, -1)


def fuse_drafter(drafter, gemv, gemv4, pdl: bool = False, head=None, attn_pdl: bool = False, qkv_kernel: bool = False,
                 attn_merge: bool = False, attn_qkv: bool = False, draft_loop: bool = False,
                 attn_tiles: dict | None = None):
    """fuse=layers on the MTP drafter: gate|up merged, its one-row step through `fused_draft`;
    `head` replaces its centroid-masked head (FuseLayers passes `model.draft_head`; None: torch's
    topk path; with `pdl` its launches are programmatic dependent ones). Dense bias-free linears only
    (a quantized drafter keeps the unfused step).
    draft_loop: `drafter.loop_kernel` is kernels/draft_loop.DraftLoop, which speculative decoding
    builds over its cache to run a one-row draft loop in one launch."""
    for i, layer in enumerate(drafter.model.layers):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            mod = layer.get_submodule(name)
            if type(mod) is not nn.Linear or mod.bias is not None:
                raise ValueError(f"fuse=layers fuses the drafter's bias-free nn.Linear layers; drafter "
                                 f"layers.{i}.{name} is {type(mod).__name__}")
    MergeProjections(qkv=False).apply(drafter.model)
    drafter.fused_forward = functools.partial(fused_draft, gemv=gemv, gemv4=gemv4, pdl=pdl, attn_pdl=attn_pdl,
                                              qkv_kernel=qkv_kernel, attn_merge=attn_merge, attn_qkv=attn_qkv,
                                              attn_tiles=attn_tiles)
    drafter.head_fn = functools.partial(head, pdl=True) if pdl and head is not None else head
    if draft_loop:
        from ..kernels.draft_loop import DraftLoop
        drafter.loop_kernel = DraftLoop
    return drafter


class FuseLayers:
    """fuse=layers: MergeProjections (q|k|v, gate|up), then the fused one-row step. backend
    "triton": the Triton kernels (CUDA; TRITON_INTERPRET=1 on a CPU); "torch": their twins (the
    same step structure and rounding, any device: the CPU reference of the fused path)."""

    def __init__(self, backend: str = "triton", pdl: bool = False, attn_pdl: bool = False, qkv_kernel: bool = False,
                 attn_merge: bool = False, int4_mma: bool = False, attn_qkv: bool = False,
                 batch_invariant: bool = False, draft_loop: bool = False, attn_tiles="", norm_fold: bool = False,
                 attn_fold: bool = False):
        from ..kernels.attention_tiles import parse_qkv_tiles

        if backend not in ("triton", "torch"):
            raise ValueError(f"fuse=layers backend must be triton or torch, got {backend!r}")
        if draft_loop and backend != "triton":
            raise ValueError("fuse.draft_loop is one Triton kernel: it needs fuse.backend=triton")
        if batch_invariant and not qkv_kernel:
            # without qkv_kernel the q/k/v norms are inductor's reductions, sized by the step's rows
            raise ValueError("fuse.batch_invariant needs fuse.qkv_kernel=true")
        if norm_fold and not int4_mma:  # (like int4_mma, it does nothing on the torch backend)
            raise ValueError("fuse.norm_fold folds the norms into the tensor-core int4 GEMVs: it needs "
                             "fuse.int4_mma=true")
        if norm_fold and batch_invariant:
            # its rounding differs from the verify pass's norm kernel: the rows would no longer match, so the
            # exact-tokens switch wins (a recipe with the fold, e.g. experiment=frontier, + batch_invariant)
            log.warning("fuse.norm_fold is off under fuse.batch_invariant: the fold rounds otherwise than the "
                        "verify pass's norm kernel")
            norm_fold = False
        if attn_fold and not batch_invariant and not (norm_fold and attn_qkv):  # (batch_invariant: off with the fold)
            raise ValueError("fuse.attn_fold folds the attention's combine into o as the norm fold's producer: it "
                             "needs fuse.norm_fold=true and fuse.attn_qkv=true")
        self.norm_fold = bool(norm_fold)
        self.attn_fold = bool(attn_fold) and self.norm_fold
        self.batch_invariant = bool(batch_invariant)
        self.backend, self.pdl, self.attn_pdl, self.qkv_kernel = backend, bool(pdl), bool(attn_pdl), bool(qkv_kernel)
        self.attn_merge = bool(attn_merge)
        self.int4_mma = bool(int4_mma)
        self.attn_qkv = bool(attn_qkv)
        self.draft_loop = bool(draft_loop)
        try:
            self.attn_tiles = parse_qkv_tiles(attn_tiles)  # 'KIND:NxWsS,...' or a list of entries
        except ValueError as e:
            raise ValueError(f"fuse.attn_tiles: {e}") from None
        if self.attn_tiles and not self.attn_qkv:
            raise ValueError("fuse.attn_tiles sets the tiles of the attention's q/k/v mode: it needs "
                             "fuse.attn_qkv=true")
        self.merge = MergeProjections()

    def apply(self, model):
        from ..kernels.draft_head import draft_head_op, draft_head_ref
        from ..kernels.fused_gemv import fused_gemv_op, fused_gemv_ref
        from ..kernels.fused_w4a16 import fused_w4a16_op, fused_w4a16_ref

        model = self.merge.apply(model) or model
        head = draft_head_ref
        if self.backend == "triton":
            gemv, gemv4, head = fused_gemv_op, fused_w4a16_op, draft_head_op
        else:
            def gemv(a, w, y, post, scale, pre, aux, eps, offset, epilogue, pdl):
                return fused_gemv_ref(a, w, y, post, scale, pre, aux, eps=eps, offset=offset, epilogue=epilogue)

            def gemv4(a, qw, s, z, g, y, post, scale, pre, aux, eps, offset, epilogue, pdl):
                return fused_w4a16_ref(a, qw, s, z, g, y, post, scale, pre, aux, eps=eps, offset=offset,
                                       epilogue=epilogue)
        # the q/k/v kernel and the attention's q/k/v mode are Triton's: the torch backend keeps the twin's ops
        step = dict(pdl=self.pdl, attn_pdl=self.attn_pdl, qkv_kernel=self.qkv_kernel and self.backend == "triton",
                    attn_merge=self.attn_merge, attn_qkv=self.attn_qkv and self.backend == "triton",
                    attn_tiles=self.attn_tiles)
        # the tensor-core int4 kernel is Triton's (its copy of the weights is made once quant ran: here
        # when it ran before, else in validate)
        # batch_invariant: attn_qkv serves the drafter and the KV-shared layers' queries (`query_qkv`): a store
        # layer's q/k/v mode sums a step's own rows in a split of their own, and which rows those are depends
        # on where the step began
        body = dict(step, int4_mma=self.int4_mma and self.backend == "triton", batch_invariant=self.batch_invariant,
                    attn_qkv=step["attn_qkv"] and not self.batch_invariant,
                    query_qkv=step["attn_qkv"] and self.batch_invariant)
        model.fused_decode = functools.partial(fused_decode, gemv=gemv, gemv4=gemv4,
                                               triton_ops=self.backend == "triton", norm_fold=self.norm_fold,
                                               attn_fold=self.attn_fold, **body)
        # the verify pass keeps qkv_finish: with its own rows in a split of their own, a row's softmax
        # would sum in an order that depends on where the step began (run ED: no faster, 2.217 -> 2.232
        # ms, and replay traces primed with every draft rejected no longer reproduced)
        model.fused_verify = functools.partial(fused_verify, triton_ops=self.backend == "triton",
                                               **dict(body, attn_qkv=False))
        # spec=mtp|replay builds its drafter after the model's transforms: it fuses it through this
        model.fuse_drafter = functools.partial(fuse_drafter, gemv=gemv, gemv4=gemv4, head=head,
                                               draft_loop=self.draft_loop, **step)
        self._enable_mma(model)
        model.draft_head = head  # kernels/draft_head.py (or its twin): the fused drafter's head
        model.batch_invariant = self.batch_invariant  # the greedy pick reads it (transforms/sampler.py)
        return model

    def validate(self, model) -> None:
        """Every linear the fused step reads is dense or int4 (after quant and the other groups ran);
        with int4_mma, the int4 ones get the tensor-core kernel's copy of their weights; with
        batch_invariant, every int4 linear (the PLE context projection too) has a one-row entry in
        the kernel's table and the head picks in one kernel at every row count."""
        for i, layer in enumerate(model.layers):
            _layer_linears(i, layer)
        self._enable_mma(model)
        if self.batch_invariant and self.backend == "triton":
            self._check_invariant(model)

    def _check_invariant(self, model) -> None:
        from .lm_head import decode_head
        from .quant import Int4Linear

        epilogues = {"gate_up": "geglu", "ple_gate": "gelu_mul"}
        named = [(f"layers.{i}.{role}", mod, epilogues.get(role, "none"))
                 for i, layer in enumerate(model.layers) for role, mod in _layer_linears(i, layer).items()]
        if model.config.ple_dim:
            named.append(("per_layer_model_projection", model.per_layer_model_projection, "none"))
        # the runtime's own lookup: None without int4_mma's copy, an epilogue the kernel lacks, or no config
        bad = [f"{name} ({mod.out_features} x {mod.in_features}, {epi})" for name, mod, epi in named
               if isinstance(mod, Int4Linear) and _mma_cfg(mod, 1, epi, torch.bfloat16, invariant=True) is None]
        if bad:
            raise ValueError("fuse.batch_invariant runs int4 linears on the tensor-core kernel's one-row configs "
                             f"(fuse.int4_mma=true, kernels/mma_table.MMA_CONFIGS); none for {', '.join(bad[:4])}"
                             + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""))
        if getattr(decode_head(model), "kind", None) == "int4":
            raise ValueError("fuse.batch_invariant: an int4 head picks through the w4a16 GEMV, whose tiles follow the "
                             "row count; use lm_head=full, int8 or pruned")

    def _enable_mma(self, model) -> None:
        """The fragment-order copy for the int4 linears whose shape the kernel's table has (one or
        more rows): the others would never read it."""
        from ..kernels.mma_table import INVARIANT_CONFIGS, MMA_CONFIGS, settle_cuda_entries, table_pairs
        from .quant import Int4Linear

        if not (self.int4_mma and self.backend == "triton"):
            return
        for line in settle_cuda_entries(next(model.parameters()).device):
            log.warning("the tensor-core table's CUDA entry %s", line)
        mods = [(role, mod) for i, layer in enumerate(model.layers) for role, mod in _layer_linears(i, layer).items()]
        if self.batch_invariant and model.config.ple_dim:  # the embedding's PLE projection (`_embed`)
            mods.append(("ple_model", model.per_layer_model_projection))
        for role, mod in mods:
            shape = (mod.out_features, mod.in_features) if isinstance(mod, Int4Linear) else None
            if shape and (any((*shape, m) in MMA_CONFIGS for m in (False, True))
                          or (self.batch_invariant and shape in INVARIANT_CONFIGS)):
                pairs = role == "gate_up" and table_pairs(*shape)
                if not mod.mma or mod.mma_pairs != pairs:
                    mod.enable_mma(pairs)

    def describe(self) -> dict:
        from ..kernels.attention_tiles import qkv_tiles_text

        return {**self.merge.describe(), "fused_layers": True, "fused_backend": self.backend, "pdl": self.pdl,
                "attn_pdl": self.attn_pdl, "qkv_kernel": self.qkv_kernel, "attn_merge": self.attn_merge,
                "int4_mma": self.int4_mma, "attn_qkv": self.attn_qkv, "batch_invariant": self.batch_invariant,
                "draft_loop": self.draft_loop, "attn_tiles": qkv_tiles_text(self.attn_tiles),
                "norm_fold": self.norm_fold, "attn_fold": self.attn_fold, "verify_epilogues": True}
