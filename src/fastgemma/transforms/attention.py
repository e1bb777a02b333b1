"""Attention backend of the static / captured decode step (`model.step_attention`).

EagerStep and prefill use torch SDPA whatever is chosen here. The kernels module imports triton,
so it is imported only when a choice is applied.
"""
from __future__ import annotations


class TorchAttention:
    """The torch twin: decode_attention_ref (any device)."""

    needs_cuda = False

    def apply(self, model):
        from ..kernels.decode_attention import decode_attention_ref

        model.step_attention = decode_attention_ref
        return model

    def describe(self) -> dict:
        return {"attention": "torch"}


class TritonAttention:
    """The split-KV Triton decode kernel (CUDA; TRITON_INTERPRET=1 runs it slowly on a CPU)."""

    needs_cuda = True

    def apply(self, model):
        from ..kernels.decode_attention import decode_attention_op

        model.step_attention = decode_attention_op  # the kernel as an opaque op (torch.compile-safe)
        return model

    def describe(self) -> dict:
        return {"attention": "triton"}
