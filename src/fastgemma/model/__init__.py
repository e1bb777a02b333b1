"""Architecture config, decoder and the helper that allocates it without touching memory twice."""
from __future__ import annotations

import torch

from .config import ModelConfig, preset, read_config_json  # noqa: F401
from .decoder import Gemma4Model


def empty_model(cfg: ModelConfig, device, dtype, on_meta=None) -> Gemma4Model:
    """Allocate uninitialised parameters directly on `device` in `dtype` (built on the meta device
    first: no fp32 copy anywhere). Buffers are computed; every parameter must then be filled.
    `on_meta(model)` may swap modules while nothing is allocated (a checkpoint's int4 layers)."""
    with torch.device("meta"):
        model = Gemma4Model(cfg).to(dtype)
    if on_meta is not None:
        on_meta(model)
    model.inv_freq_sliding = model.inv_freq_sliding.float()  # RoPE frequencies stay fp32
    model.inv_freq_full = model.inv_freq_full.float()
    model = model.to_empty(device=device)
    with torch.no_grad():
        model.init_buffers()
        for layer in model.layers:
            layer.layer_scalar.fill_(1.0)  # a checkpoint may overwrite it
    return model.requires_grad_(False).eval()
