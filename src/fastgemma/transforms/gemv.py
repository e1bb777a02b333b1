"""Dense linears through our Triton GEMV at one row (`quant=bf16 quant.backend=triton`).

`GemvLinear` is nn.Linear (same parameters and state dict) whose forward sends an input of one
row (decode at batch 1) to `fastgemma.kernels.gemv.gemv_op`, and anything wider (prefill, the
verify pass's rows) to F.linear (cuBLAS). The row count is a shape, so the choice is made when a
step is traced or captured, not per token. `use_gemv(model)` switches every dense body linear
(the tied head is an Embedding and stays with its head transform); `use_gemv(model, False)`
switches back. A switch resets torch.compile's caches: dynamo keys a compiled step by its code
object and does not guard on a module's class, so a step compiled before the switch would
otherwise be replayed unchanged by the next one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.gemv import MAX_M, gemv_op


class GemvLinear(nn.Linear):
    def forward(self, x):
        if self.bias is None and x.numel() <= MAX_M * self.in_features:
            return gemv_op(x.reshape(-1, self.in_features), self.weight).reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def use_gemv(model: nn.Module, on: bool = True) -> int:
    """Swap the class of every nn.Linear (GemvLinear when on, nn.Linear when off); returns how many."""
    n = 0
    for mod in model.modules():
        if on and type(mod) is nn.Linear:
            mod.__class__ = GemvLinear
            n += 1
        elif not on and type(mod) is GemvLinear:
            mod.__class__ = nn.Linear
            n += 1
    if n:
        torch._dynamo.reset()
    return n
