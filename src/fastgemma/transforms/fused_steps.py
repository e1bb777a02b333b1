"""The fused steps of `fuse=layers` (transforms/fuse_layers.py has the layout of a layer's launches):
`fused_decode`, the one-row step; `fused_verify`, wider steps (the verify pass, batches) on the layer's
GEMMs with their epilogues and the residual-norm kernels; `fused_draft`, the MTP drafter's one-row step,
set on the drafter by `fuse_drafter`."""
from __future__ import annotations

import functools

import torch
from torch import nn

from .fuse import MergeProjections
from .fused_layer_ops import (_attend_qkv, _attn_splits, _caller, _dense_rows, _embed, _final_norm, _finish_q, _Fold,
                              _early_norm, _layer_linears, _mma_call, _mma_cfg, _no_invariant_config, _qkv_attend,
                              _residual_norm)


def fused_decode(model, ids, pos, cache, gemv, gemv4, pdl: bool = False, qkv_kernel: bool = False,
                 attn_pdl: bool = False, attn_merge: bool = False, int4_mma: bool = False, attn_qkv: bool = False,
                 batch_invariant: bool = False, triton_ops: bool = True, attn_tiles: dict | None = None,
                 norm_fold: bool = False, attn_fold: bool = False, query_qkv: bool = False, tail_norm: bool = False,
                 start_kernel: bool = False):
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
    producer and the attention has 2-8 splits (kernels/attn_fold.py: E4B's sliding layers);
    tail_norm: the last layer's residual update and the final norm in kernels/residual_norm.py (the verify
    pass's kernel, its rounding; batch_invariant takes it anyway) instead of the compiled torch ops;
    start_kernel (Triton, not batch_invariant): the token's embedding, the first q|k|v's input norm where the
    tensor-core kernel takes it (its prologue's own launch otherwise), ple=table's row, the RoPE cos / sin and the
    ring slot in one launch (kernels/step_start.py)."""
    c = model.config
    layers = list(model.layers)
    xn0 = None  # the first q|k|v's normed input, where the start kernel made it
    if start_kernel and triton_ops and not batch_invariant:
        x, xn0, ple, rope, slots = _start(model, ids, pos, cache, layers[0], int4_mma)
        x, ple = _embed(model, ids, False, triton_ops, pdl, int4_mma, x0=x) if ple is None else (x, ple)
        store_attend = model.step_store_attend(ids, pos, cache, attn_pdl, attn_merge, start=(rope, slots))
    else:
        x, ple = _embed(model, ids, batch_invariant, triton_ops, pdl, int4_mma)
        store_attend = model.step_store_attend(ids, pos, cache, attn_pdl, attn_merge, batch_invariant)
    call = _caller(gemv, gemv4, pdl, c.rms_eps, c.norm_offset, int4_mma, batch_invariant, triton_ops)
    fold = _Fold(c.rms_eps, c.norm_offset, pdl) if norm_fold and int4_mma and triton_ops and not batch_invariant \
        else None
    h = x.reshape(1, -1)
    # a residual update not yet applied: (res, y, norm, scale, rows, parts): h = (res + norm(y)) * scale;
    # rows / parts: the fold's, when the GEMV that made y was its producer (else None)
    pend = None
    for i, layer in enumerate(layers):
        lin = _layer_linears(i, layer)
        pre = layer.input_layernorm.weight
        if pend is None:
            qkv, _ = call(h, lin["in"], pre=pre) if xn0 is None else call(xn0, lin["in"])
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
    # the last layer's update (no GEMV follows it); batch_invariant: in the verify pass's kernel
    return _final_norm(*pend[:4], model.norm, c.rms_eps, c.norm_offset, batch_invariant or tail_norm, triton_ops,
                       pdl).reshape(1, 1, -1)


def _start(model, ids, pos, cache, layer0, int4_mma: bool):
    """kernels/step_start.py's launch for the one-row step -> (x [1, 1, H], the first q|k|v's normed input [1, H] or
    None where its GEMV takes the norm itself, ple [1, 1, L, P] or None without ple=table, rope, ring slots)."""
    from ..kernels.step_start import step_start_op

    c = model.config
    w = model.embed_tokens.weight
    # the tensor-core kernel launches the first q|k|v's prologue on its own (`_caller`): here it is made instead
    norm0 = int4_mma and _mma_cfg(_layer_linears(0, layer0)["in"], 1, "none", w.dtype) is not None
    table = model.embed_tokens_per_layer.weight if c.ple_dim and model.ple_from_table else None
    x, xn, ple, cs, ss, cf, sf, slots = step_start_op(
        ids, pos, w, model.embed_scale(), layer0.input_layernorm.weight if norm0 else None, c.rms_eps, c.norm_offset,
        table, model.inv_freq_sliding, model.inv_freq_full, cache.ring_pos)
    return (x, xn if norm0 else None, ple.unflatten(-1, (c.num_layers, c.ple_dim)) if table is not None else None,
            {True: (cs, ss), False: (cf, sf)}, slots)


# dense weights up to this size take `_dense_rows` in wider steps (the PLE gate: 1.3 MB, on the rows GEMV);
# larger dense GEMMs (a bf16 body's gate|up) stay with cuBLAS and torch's epilogue
DENSE_ROWS_MAX_BYTES = 4 << 20


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
    kernel can: the int4 per-group kernel (Int4Linear), `_dense_rows` (small dense weights, <= 16
    rows: the rows GEMV or the skinny GEMM); otherwise the GEMM (an Int8Linear's own), then torch's
    epilogue. No epilogue: a dense or int8 linear is mod(x) itself; an Int4Linear's tile override
    (`config`) holds, as in its forward.
    `pdl`: the Triton GEMMs launch with programmatic dependent launch. `int4_mma`: an Int4Linear goes
    to the tensor-core kernel where `_mma_call` takes it (<= 8 rows, a shape in its table). invariant
    (fuse.batch_invariant): the one-row step's kernels and configs at any row count (`_caller`): int4
    on the tensor-core kernel's one-row entry only, dense on `_dense_rows` whatever its size."""
    from ..kernels.skinny_gemm import fits
    from ..kernels.w4a16 import apply_epilogue
    from .quant import Int4Linear
    from .quant_int8 import Int8Linear

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
    elif isinstance(mod, Int8Linear):  # its own matmul (kernels/w8a16.py), then torch's epilogue
        y = apply_epilogue(mod(x2), epilogue, a2)
    elif fits(*x2.shape) and (invariant or mod.weight.numel() * mod.weight.element_size() <= DENSE_ROWS_MAX_BYTES):
        y = _dense_rows(x2, mod.weight, epilogue, a2, pdl, triton_ops)
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
    tensor-core kernel's one-row configs, `_dense_rows` for dense linears, the attention's row
    tiles per group of positions with the one-row split count, the embedding's PLE path in kernels): the
    verify pass's rows equal the AR steps' bit for bit. query_qkv: as `fused_decode`'s."""
    c = model.config
    eps, off = c.rms_eps, c.norm_offset

    def rn(a, y=None, post=None, scale=None, pre=None, early=False):  # early: `_early_norm` of the GEMM after it
        h, x = _residual_norm(a, y, post, scale, pre, eps, off, triton_ops and norm_kernels, pdl, early)
        return (h if y is not None else a), (x if pre is not None else None)

    def gemm(mod, x, epilogue="none", aux=None):
        return _epilogue_call(mod, x, epilogue, aux, triton_ops=triton_ops, pdl=pdl, int4_mma=int4_mma,
                              invariant=batch_invariant)

    x, ple = _embed(model, ids, batch_invariant, triton_ops, pdl, int4_mma)
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
        gate_up = _mma_cfg(lin["gate_up"], h.shape[0], "geglu", h.dtype, batch_invariant) if int4_mma else None
        h, xff = rn(h, o, layer.post_attention_layernorm.weight, None, layer.pre_feedforward_layernorm.weight,
                    _early_norm(gate_up))
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
                attn_tiles: dict | None = None, tail_norm: bool = False, triton_ops: bool = True):
    """The MTP drafter's one-row step (Drafter.forward at B = 1) through the fused GEMVs: x [1, 1, 2 H]
    -> g [1, 1, hidden] (final-norm), h' [1, 1, H]. Per layer (query-only, no PLE): q (prologue: the
    previous layer's residual update with its layer scalar, then input_layernorm), o, gate|up (+ the
    residual update, pre_feedforward_layernorm, GeGLU), down; q norm + RoPE (torch, or one launch of
    kernels/qkv_finish.py with `qkv_kernel`) and the attention over the target's K/V as in the unfused
    step (its kernels under PDL with `attn_pdl`, no combine launch with `attn_merge`; with `attn_qkv`
    the q norm + RoPE in the attention's split kernel, kernels/decode_attention.py's q/k/v mode).
    The last update and the final norm run in torch, or with `tail_norm` in kernels/residual_norm.py (its twin
    without `triton_ops`)."""
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
    g = _final_norm(*pend, d.model.norm, body.rms_eps, body.norm_offset, tail_norm, triton_ops, pdl)
    hp, _ = call(g, d.post_projection)
    return g.reshape(1, 1, -1), hp.reshape(1, 1, -1)


def fuse_drafter(drafter, gemv, gemv4, pdl: bool = False, head=None, attn_pdl: bool = False, qkv_kernel: bool = False,
                 attn_merge: bool = False, attn_qkv: bool = False, draft_loop: bool = False,
                 attn_tiles: dict | None = None, tail_norm: bool = False, triton_ops: bool = True):
    """fuse=layers on the MTP drafter: gate|up merged, its one-row step through `fused_draft`;
    `head` replaces its centroid-masked head (FuseLayers passes `model.draft_head`; None: torch's
    topk path; with `pdl` its launches are programmatic dependent ones). Dense bias-free linears only
    (a quantized drafter keeps the unfused step).
    draft_loop: `drafter.loop_kernel` is kernels/draft_loop.DraftLoop, which speculative decoding
    builds over its cache to run a one-row draft loop in one launch. tail_norm: its last update and final norm
    in kernels/residual_norm.py (the twin without triton_ops)."""
    for i, layer in enumerate(drafter.model.layers):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            mod = layer.get_submodule(name)
            if type(mod) is not nn.Linear or mod.bias is not None:
                raise ValueError(f"fuse=layers fuses the drafter's bias-free nn.Linear layers; drafter "
                                 f"layers.{i}.{name} is {type(mod).__name__}")
    MergeProjections(qkv=False).apply(drafter.model)
    drafter.fused_forward = functools.partial(fused_draft, gemv=gemv, gemv4=gemv4, pdl=pdl, attn_pdl=attn_pdl,
                                              qkv_kernel=qkv_kernel, attn_merge=attn_merge, attn_qkv=attn_qkv,
                                              attn_tiles=attn_tiles, tail_norm=tail_norm, triton_ops=triton_ops)
    drafter.head_fn = functools.partial(head, pdl=True) if pdl and head is not None else head
    if draft_loop:
        from ..kernels.draft_loop import DraftLoop
        drafter.loop_kernel = DraftLoop
    return drafter
