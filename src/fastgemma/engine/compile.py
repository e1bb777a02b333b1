"""torch.compile for the engine's steps, with the project's custom ops (torch.ops.fastgemma.*) given
inductor fallbacks up front.

Inductor lowers an op it has no lowering for through an implicit fallback, and torch 2.11 formats
the op's arguments for a log line while it does so, whether or not that log is on (2.13 formats it
lazily). An argument's text holds the IR that produced it, recursively. Once a step's kernels are
all custom ops, no inductor kernel cuts that chain: the one-row step with the q/k/v kernel
(kernels/qkv_finish.py) printed every earlier layer into each op's text, doubled at every fan-out,
and its compile had not finished after 400 s on the H200 (run CG; torch 2.11). `register_fallbacks`
gives every fastgemma op the fallback that path would have made (the layout constraint of its
tags), so inductor never takes it. `compile_step` is torch.compile after that.
"""
from __future__ import annotations

import torch


# the modules that define fastgemma ops; the steps import most of them only while they are traced,
# after torch.compile was called
OP_MODULES = ("argmax", "decode_attention", "draft_head", "fused_gemv", "fused_w4a16", "fused_w8a16", "gather_rows",
              "gemv", "mma_fold", "mma_w4a16", "qkv_finish", "residual_norm", "rows_gemv", "skinny_gemm",
              "sparse_argmax", "step_start", "w4a16", "w8a16")


def fastgemma_ops() -> list:
    """Every torch.ops.fastgemma op overload, after importing the kernels' modules (OP_MODULES; one
    that cannot be imported, e.g. without triton, is skipped: its ops cannot be traced either)."""
    import importlib

    for m in OP_MODULES:
        try:
            importlib.import_module(f"fastgemma.kernels.{m}")
        except ImportError:
            pass
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        ns, _, rest = name.partition("::")
        if ns != "fastgemma":
            continue
        op_name, _, overload = rest.partition(".")
        ops.append(getattr(getattr(torch.ops.fastgemma, op_name), overload or "default"))
    return ops


def register_fallbacks() -> int:
    """Inductor fallbacks for the fastgemma ops that have no lowering yet; -> how many were added."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    added = 0
    for op in fastgemma_ops():
        if op in lowering.lowerings:
            continue
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint, warn=False)
        added += 1
    return added


def compile_step(fn, dynamic: bool = False, options: dict | None = None):
    """torch.compile(fn, dynamic=dynamic, options=options) after `register_fallbacks`; options: inductor's config
    keys for this compile (e.g. {"combo_kernels": True}), None: its defaults."""
    register_fallbacks()
    return torch.compile(fn, dynamic=dynamic, options=options or None)
