"""W8A16: int8 weights with one fp32 scale per output row (symmetric round-to-nearest) x 16-bit activations.

y[m, n] = round(round(x[m] . q[n]) * s[n]), each round to x's dtype: the arithmetic of F.linear on the codes
(exact in bf16 / fp16: |q| <= 127), then the scale. One row runs the LM head's int8 row kernel
(kernels/sparse_argmax.py: the rows read as int32 words, four codes a word, no I2F) with its logits store
and no argmax; several rows its tl.dot path. The fp32 output it writes is cast to x's dtype. The same rows
serve `lm_head=int8` and the pruned head's int8 rows (transforms/lm_head.py), so both quantize here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .sparse_argmax import head_argmax


def quantize_int8_rows(w: torch.Tensor):
    """w [N, K] -> (int8 [N, K], fp32 scales [N]); |w - q * s| <= s / 2, s = max|w[n]| / 127."""
    wf = w.detach().float()
    s = wf.abs().amax(-1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row: codes 0, any scale
    q = torch.round(wf / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def check_int8_operands(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"x must be [M, K] and qweight [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(qweight.shape)}")
    if qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be int8, got {qweight.dtype}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (qweight.shape[0],):
        raise ValueError(f"scales must be fp32 [N] = [{qweight.shape[0]}], got {scales.dtype} {tuple(scales.shape)}")


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Triton (CUDA, or TRITON_INTERPRET=1): x [M, K] -> [M, N] in x's dtype."""
    check_int8_operands(x, qweight, scales)
    out = torch.empty(x.shape[0], qweight.shape[0], device=x.device, dtype=torch.float32)
    head_argmax(x, qweight, scales=scales, logits_out=out, want_ids=False, round_to_input=True)
    return out.to(x.dtype)


def w8a16_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The twin: F.linear on the codes in x's dtype, then the scale, each rounded to x's dtype."""
    check_int8_operands(x, qweight, scales)
    return (F.linear(x, qweight.to(x.dtype)).float() * scales).to(x.dtype)


# an opaque op, so torch.compile traces around the launcher
@torch.library.custom_op("fastgemma::w8a16_matmul", mutates_args=())
def w8a16_matmul_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return w8a16_matmul(x, qweight, scales)


@w8a16_matmul_op.register_fake
def _(x, qweight, scales):
    return x.new_empty(x.shape[0], qweight.shape[0])
