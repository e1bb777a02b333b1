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
gate|up GEMM's store and gelu_tanh(PLE gate) * PLE input in the PLE gate's (int4, or dense: the
rows GEMV of kernels/rows_gemv.py), and each residual update with the next norm in one
kernel per row (kernels/residual_norm.py). The MTP drafter's one-row step takes the
same GEMVs (`fused_draft`: pre-projection, then per layer q, o, gate|up + GeGLU, down, then the
post-projection), set on the drafter by `model.fuse_drafter` when speculative decoding builds it.
Its centroid-masked head is kernels/draft_head.py's two launches (the twin on the torch backend):
draft loop 0.760 -> 0.719 ms at k=7 against torch's topk path on the H200 (run EA); `model.draft_head`
is that op, `head=None` torch's path.
Linears may be dense 16-bit (`fused_gemv`), Int4Linear (quant=int4: `fused_w4a16`) or Int8Linear
(quant=int8: `fused_w8a16`), each layer as it is; other kinds (nf4) are refused in one line (use fuse=merged).
`pdl=True` launches every fused GEMV with programmatic dependent launch (sm90+), and in wider
steps the GEMMs, norm kernels and the q/k/v kernel; `attn_pdl=True` the attention's split and
combine kernels as well (without it they launch plainly, and so does the kernel after them);
`attn_merge=True` drops the combine launch where a tile's partials are few (the split tile's last
program merges them; decode_attention.MERGE_MAX_ELEMS), `draft_merge=True` in the MTP drafter's step
alone (the target's steps keep the combine, and with it their rounding);
`attn_qkv=True` does the q/k/v norms, RoPE and cache writes inside the attention's split kernel
(kernels/decode_attention.py's q/k/v mode) in the one-row step and the drafter's step;
`attn_tiles` (e.g. "full_store:32x16s2") sets that mode's tiles per layer kind instead of the
kernel's own choice (`attention_tiles.parse_qkv_tiles`), so tile choices compare in one process.
"""
from __future__ import annotations

import functools
import logging

import torch

from .fuse import MergeProjections
from .fused_layer_ops import _layer_linears, _mma_cfg
from .fused_steps import fuse_drafter, fused_decode, fused_verify

log = logging.getLogger(__name__)


class FuseLayers:
    """fuse=layers: MergeProjections (q|k|v, gate|up), then the fused one-row step. backend
    "triton": the Triton kernels (CUDA; TRITON_INTERPRET=1 on a CPU); "torch": their twins (the
    same step structure and rounding, any device: the CPU reference of the fused path)."""

    def __init__(self, backend: str = "triton", pdl: bool = False, attn_pdl: bool = False, qkv_kernel: bool = False,
                 attn_merge: bool = False, int4_mma: bool = False, attn_qkv: bool = False,
                 batch_invariant: bool | str = False, draft_loop: bool = False, attn_tiles="", norm_fold: bool = False,
                 attn_fold: bool = False, tail_norm: bool = False, start_kernel: bool = False,
                 draft_merge: bool = False):
        from ..kernels.attention_tiles import parse_qkv_tiles

        if backend not in ("triton", "torch"):
            raise ValueError(f"fuse=layers backend must be triton or torch, got {backend!r}")
        if draft_loop and backend != "triton":
            raise ValueError("fuse.draft_loop is one Triton kernel: it needs fuse.backend=triton")
        if isinstance(batch_invariant, str) and batch_invariant != "auto":
            raise ValueError(f"fuse.batch_invariant is true, false or auto, got {batch_invariant!r}")
        self.auto_invariant = batch_invariant == "auto"  # settled by `settle_auto` once the other groups are built
        self._auto_depth = None  # the speculative depth where auto was left on by the groups: `validate` asks the model
        invariant = bool(batch_invariant) and not self.auto_invariant
        if norm_fold and not int4_mma:  # (like int4_mma, it does nothing on the torch backend)
            raise ValueError("fuse.norm_fold folds the norms into the tensor-core int4 GEMVs: it needs "
                             "fuse.int4_mma=true")
        if attn_fold and not invariant and not (norm_fold and attn_qkv):  # (batch_invariant: off with the fold)
            raise ValueError("fuse.attn_fold folds the attention's combine into o as the norm fold's producer: it "
                             "needs fuse.norm_fold=true and fuse.attn_qkv=true")
        self._asked = dict(norm_fold=bool(norm_fold), attn_fold=bool(attn_fold), start_kernel=bool(start_kernel))
        self.qkv_kernel = bool(qkv_kernel)
        self._settle(invariant, log.warning)
        self.tail_norm = bool(tail_norm)
        self.backend, self.pdl, self.attn_pdl = backend, bool(pdl), bool(attn_pdl)
        self.attn_merge = bool(attn_merge)
        self.draft_merge = bool(draft_merge) or self.attn_merge
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

    def _settle(self, batch_invariant: bool, say) -> None:
        """The switch and what it turns off: the norm fold (and the attention fold, its producer) rounds otherwise
        than the verify pass's norm kernel, the start kernel's cos / sin as CUDA's cosf / sinf, the verify pass's
        as inductor's, so the exact-tokens switch wins (a recipe with them, e.g. experiment=frontier, + the
        switch); `say` tells the user which ones went."""
        if batch_invariant and not self.qkv_kernel:
            # without qkv_kernel the q/k/v norms are inductor's reductions, sized by the step's rows
            raise ValueError("fuse.batch_invariant needs fuse.qkv_kernel=true")
        asked = self._asked
        self.batch_invariant = bool(batch_invariant)
        self.norm_fold = asked["norm_fold"] and not batch_invariant
        self.attn_fold = asked["attn_fold"] and self.norm_fold
        self.start_kernel = asked["start_kernel"] and not batch_invariant
        if batch_invariant and asked["norm_fold"]:
            say("fuse.norm_fold is off under fuse.batch_invariant: the fold rounds otherwise than the verify pass's "
                "norm kernel")
        if batch_invariant and asked["start_kernel"]:
            say("fuse.start_kernel is off under fuse.batch_invariant: the verify pass computes the step's inputs "
                "otherwise")

    def settle_auto(self, parts) -> None:
        """fuse.batch_invariant=auto, given the other groups' objects: on where speculative decoding verifies on the
        int4 body's tensor-core kernels (measured there: the AR step's tokens bit for bit and the faster verify
        pass, the README's k=7 recipe), else off; the AR step alone is faster without it. What the groups decide
        is settled here and logged; a choice they leave open waits for the model (`validate`: whether its body is
        int4, quantized here or loaded so, with a one-row tensor-core config for every int4 linear)."""
        if not self.auto_invariant:
            return
        why = self._invariant_blocker(parts)
        if why is None:  # (an MtpSpec: its depth)
            self._auto_depth = parts.spec.depth
            self._settle(True, lambda msg: None)  # said in `validate`, once the model confirms it
        else:
            log.info("fuse.batch_invariant=auto: off (%s)", why)

    @property
    def _auto_pending(self) -> bool:
        """auto left on by the groups, not yet confirmed by the model."""
        return self._auto_depth is not None

    def _invariant_blocker(self, parts) -> str | None:
        """Why auto leaves the switch off, from the groups alone, or None (the model may still: `_model_blocker`)."""
        from ..kernels.mma_table import MAX_ROWS
        from .lm_head import Int4Head
        from .quant import Int4Quant, NoQuant
        from .sampler import FusedArgmax
        from .spec import MtpSpec

        if not isinstance(parts.spec, MtpSpec):
            return "no speculative decoding: the one-row step is faster without it"
        if parts.spec.depth + 1 > MAX_ROWS:
            return (f"spec.depth={parts.spec.depth}: {parts.spec.depth + 1} verify rows, the tensor-core kernel's "
                    f"one-row configs take {MAX_ROWS}")
        if self.backend != "triton":
            return "fuse.backend=torch: the twins"
        if not (isinstance(parts.quant, (Int4Quant, NoQuant)) and self.int4_mma):
            # NoQuant: a checkpoint already in int4 keeps its layers int4 (`_model_blocker` looks)
            return "it is measured on the int4 body (quant=int4, or a checkpoint in int4) with fuse.int4_mma=true"
        if not self.qkv_kernel:
            return "it needs fuse.qkv_kernel=true"
        if isinstance(parts.lm_head, Int4Head):
            return "an int4 head picks through a kernel whose tiles follow the row count"
        if not isinstance(parts.sampler, FusedArgmax):
            return "it needs sampler=fused_argmax"
        return None

    def _model_blocker(self, model) -> str | None:
        """Why auto leaves the switch off, from the built model, or None: a body with no int4 linear on the tensor-core
        kernel (bf16, or another model's shapes), or what `_invariant_problem` would refuse."""
        from .quant import Int4Linear

        if not any(isinstance(mod, Int4Linear) and mod.mma for i, layer in enumerate(model.layers)
                   for mod in _layer_linears(i, layer).values()):
            return ("the body has no int4 linear on the tensor-core kernel (a bf16 body, or shapes outside its "
                    "table): it is measured on the int4 body")
        return self._invariant_problem(model)

    def _confirm_auto(self, model) -> None:
        """auto, once the groups left it on: the model confirms it (logged with what it turns off), or it goes off
        and the steps are installed again without it."""
        depth, self._auto_depth = self._auto_depth, None
        why = self._model_blocker(model)
        if why is None:
            self._settle(True, log.info)
            log.info("fuse.batch_invariant=auto: on (speculative depth %d on the int4 tensor-core body: the verify "
                     "pass's rows are the AR step's bit for bit)", depth)
            return
        self._settle(False, log.info)
        log.info("fuse.batch_invariant=auto: off (%s)", why)
        self._install(model)

    def apply(self, model):
        model = self.merge.apply(model) or model
        self._install(model)
        return model

    def _install(self, model) -> None:
        """The fused steps on `model` as the switches stand (again where auto's switch changes in `validate`)."""
        from ..kernels.draft_head import draft_head_op, draft_head_ref
        from ..kernels.fused_gemv import fused_gemv_op, fused_gemv_ref
        from ..kernels.fused_w4a16 import fused_w4a16_op, fused_w4a16_ref

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
                                               attn_fold=self.attn_fold, tail_norm=self.tail_norm,
                                               start_kernel=self.start_kernel, **body)
        # the verify pass keeps qkv_finish: with its own rows in a split of their own, a row's softmax
        # would sum in an order that depends on where the step began (run ED: no faster, 2.217 -> 2.232
        # ms, and replay traces primed with every draft rejected no longer reproduced)
        model.fused_verify = functools.partial(fused_verify, triton_ops=self.backend == "triton",
                                               **dict(body, attn_qkv=False))
        # spec=mtp|replay builds its drafter after the model's transforms: it fuses it through this
        model.fuse_drafter = functools.partial(fuse_drafter, gemv=gemv, gemv4=gemv4, head=head,
                                               draft_loop=self.draft_loop, tail_norm=self.tail_norm,
                                               triton_ops=self.backend == "triton",
                                               **dict(step, attn_merge=self.draft_merge))
        self._enable_mma(model)
        model.draft_head = head  # kernels/draft_head.py (or its twin): the fused drafter's head
        model.batch_invariant = self.batch_invariant  # the greedy pick reads it (transforms/sampler.py)

    def validate(self, model) -> None:
        """Every linear the fused step reads is dense, int4 or int8 (after quant and the other groups ran);
        with int4_mma, the int4 ones get the tensor-core kernel's copy of their weights; auto's switch, where
        the groups left it on, confirmed by the model or turned off (`_confirm_auto`); with batch_invariant,
        what `_invariant_problem` names is refused."""
        for i, layer in enumerate(model.layers):
            _layer_linears(i, layer)
        self._enable_mma(model)
        if self._auto_pending:
            self._confirm_auto(model)
        problem = self._invariant_problem(model) if self.batch_invariant else None
        if problem:
            raise ValueError(problem)

    def _invariant_problem(self, model) -> str | None:
        """What batch_invariant cannot keep row-invariant on `model`, or None: an int8 linear (its one-row GEMV and
        its wider matmul sum in other orders); on the Triton backend, an int4 linear (the PLE context projection
        too) without a one-row entry in the tensor-core kernel's table, or an int4 head (its tiles follow the row
        count)."""
        from .lm_head import decode_head
        from .quant import Int4Linear
        from .quant_int8 import Int8Linear

        if any(isinstance(m, Int8Linear) for m in model.modules()):
            return ("fuse.batch_invariant has no int8 form: the one-row int8 GEMV and the wider int8 matmul sum in "
                    "other orders; use quant=int4 or bf16 with it, or batch_invariant=false")
        if self.backend != "triton":
            return None
        epilogues = {"gate_up": "geglu", "ple_gate": "gelu_mul"}
        named = [(f"layers.{i}.{role}", mod, epilogues.get(role, "none"))
                 for i, layer in enumerate(model.layers) for role, mod in _layer_linears(i, layer).items()]
        if model.ple_projected:
            named.append(("per_layer_model_projection", model.per_layer_model_projection, "none"))
        # the runtime's own lookup: None without int4_mma's copy, an epilogue the kernel lacks, or no config
        bad = [f"{name} ({mod.out_features} x {mod.in_features}, g{mod.group_size}, {epi})" for name, mod, epi in named
               if isinstance(mod, Int4Linear) and _mma_cfg(mod, 1, epi, torch.bfloat16, invariant=True) is None]
        if bad:
            return ("fuse.batch_invariant runs int4 linears on the tensor-core kernel's one-row configs "
                    f"(fuse.int4_mma=true, kernels/mma_table.MMA_CONFIGS); none for {', '.join(bad[:4])}"
                    + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""))
        if getattr(decode_head(model), "kind", None) == "int4":
            return ("fuse.batch_invariant: an int4 head picks through the w4a16 GEMV, whose tiles follow the row "
                    "count; use lm_head=full, int8 or pruned")
        return None

    def _enable_mma(self, model) -> None:
        """The fragment-order copy for the int4 linears whose shape the kernel's table has (one or
        more rows): the others would never read it. Records `model.max_verify_rows`: the kernel's rows
        under batch_invariant once a linear holds the copy (one config at every row count), else None."""
        from ..kernels.mma_table import INVARIANT_CONFIGS, MAX_ROWS, MMA_CONFIGS, settle_cuda_entries, table_pairs
        from .quant import Int4Linear

        model.max_verify_rows = None  # the rows a wider step may take (SpecGenerator: depth + 1), None: no limit
        if not (self.int4_mma and self.backend == "triton"):
            return
        for line in settle_cuda_entries(next(model.parameters()).device):
            log.warning("the tensor-core table's CUDA entry %s", line)
        mods = [(role, mod) for i, layer in enumerate(model.layers) for role, mod in _layer_linears(i, layer).items()]
        if model.ple_projected:  # the embedding's PLE projection (`_embed`)
            mods.append(("ple_model", model.per_layer_model_projection))
        for role, mod in mods:
            shape = (mod.out_features, mod.in_features) if isinstance(mod, Int4Linear) else None
            if shape and (any((*shape, m) in MMA_CONFIGS for m in (False, True))
                          or (self.batch_invariant and shape in INVARIANT_CONFIGS)):
                pairs = role == "gate_up" and table_pairs(*shape)
                if not mod.mma or mod.mma_pairs != pairs:
                    mod.enable_mma(pairs)
            elif shape and mod.mma:  # held for the switch's configs, which auto turned off again
                mod.disable_mma()
        if self.batch_invariant and any(getattr(mod, "mma", False) for _, mod in mods):
            model.max_verify_rows = MAX_ROWS  # one config at every row count: the kernel's rows at most

    def describe(self) -> dict:
        from ..kernels.attention_tiles import qkv_tiles_text

        return {**self.merge.describe(), "fused_layers": True, "fused_backend": self.backend, "pdl": self.pdl,
                "attn_pdl": self.attn_pdl, "qkv_kernel": self.qkv_kernel, "attn_merge": self.attn_merge,
                "draft_merge": self.draft_merge, "int4_mma": self.int4_mma, "attn_qkv": self.attn_qkv,
                "batch_invariant": self.batch_invariant, "batch_invariant_auto": self.auto_invariant,
                "draft_loop": self.draft_loop,
                "attn_tiles": qkv_tiles_text(self.attn_tiles), "norm_fold": self.norm_fold, "attn_fold": self.attn_fold,
                "tail_norm": self.tail_norm, "start_kernel": self.start_kernel, "verify_epilogues": True}
