"""transformers' Gemma4TextConfig for a fastgemma ModelConfig: the reference model in tests and benchmarks."""
from __future__ import annotations

from .config import ModelConfig


def to_hf_text_config(cfg: ModelConfig, **kw):
    from transformers import Gemma4TextConfig

    if cfg.family != "gemma4":
        raise ValueError(f"to_hf_text_config builds Gemma 4 configs, not {cfg.family}")
    return Gemma4TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, global_head_dim=cfg.global_head_dim,
        layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
        num_kv_shared_layers=cfg.num_kv_shared_layers, hidden_size_per_layer_input=cfg.ple_dim,
        vocab_size_per_layer_input=cfg.ple_vocab_size, final_logit_softcapping=cfg.final_logit_softcap,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_eps,
        use_double_wide_mlp=cfg.double_wide_mlp, **kw,
    )


def hf_model_sharing_weights(model, attn_implementation: str = "sdpa"):
    """A transformers Gemma4ForCausalLM whose parameters ARE this model's tensors (no copy)."""
    import torch
    from transformers import Gemma4ForCausalLM

    hcfg = to_hf_text_config(model.config, attn_implementation=attn_implementation)
    w = model.embed_tokens.weight
    old = torch.get_default_dtype()
    torch.set_default_dtype(w.dtype)  # build in the model dtype, as from_pretrained(dtype=...) does
    try:
        with torch.device(w.device):
            hf = Gemma4ForCausalLM(hcfg)
    finally:
        torch.set_default_dtype(old)
    sd = {"model." + k: v for k, v in model.state_dict().items()}
    sd["lm_head.weight"] = w
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    if unexpected or [k for k in missing if "embed_scale" not in k and "inv_freq" not in k]:
        raise RuntimeError(f"weights do not map onto transformers: missing {missing}, unexpected {unexpected}")
    hf.tie_weights() if hasattr(hf, "tie_weights") else None
    return hf.eval()
