"""The architecture as a typed dataclass: named presets, a reader for a checkpoint's config.json,
and the per-layer facts (sliding/full, head dim, KV source) resolved once.

Gemma 4 and Gemma 3 text models share one layer shape; their differences are data here:
RMSNorm offset (Gemma 3 stores w-1), attention scale, v_norm, PLE, KV sharing, softcap.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SLIDING, FULL = "sliding_attention", "full_attention"


class ConfigError(ValueError):
    """A config that this engine cannot build."""


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: str            # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    intermediate_size: int
    kv_source: int       # layer whose K/V this layer attends over (== index when it stores its own)
    stores_kv: bool      # owns cache memory

    @property
    def sliding(self) -> bool:
        return self.kind == SLIDING


@dataclass(frozen=True)
class ModelConfig:
    family: str = "gemma4"                 # "gemma4" | "gemma3"
    vocab_size: int = 262144
    hidden_size: int = 2560
    intermediate_size: int = 10240
    num_layers: int = 42
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 256                    # sliding layers
    global_head_dim: int = 512             # full layers
    num_global_kv_heads: int | None = None  # None: same as num_kv_heads
    layer_types: tuple[str, ...] = ()      # empty: 5 sliding : 1 full, last layer full
    sliding_window: int = 512              # keys kept when kv_pos > q_pos - window
    rope_local_theta: float = 10_000.0
    rope_global_theta: float = 1_000_000.0
    rope_global_partial: float = 0.25      # proportional RoPE: 64 of 256 frequencies rotate
    rope_global_factor: float = 1.0        # linear scaling (Gemma 3 4B+: 8.0)
    rms_eps: float = 1e-6
    final_logit_softcap: float | None = 30.0
    num_kv_shared_layers: int = 18
    ple_dim: int = 256                     # hidden_size_per_layer_input; 0 = no PLE
    ple_vocab_size: int = 262144
    double_wide_mlp: bool = False          # KV-shared layers get 2x intermediate (E2B)
    attn_scale: float = 1.0                # Gemma 4: 1.0 (no 1/sqrt(d)); Gemma 3: qpas**-0.5
    norm_offset: float = 0.0               # Gemma 3 RMSNorm multiplies by (1 + w)
    v_norm: bool = True
    layer_scalar: bool = True
    tie_embeddings: bool = True
    bos_id: int = 2
    eos_ids: tuple[int, ...] = (1, 106)
    pad_id: int = 0
    max_position_embeddings: int = 131072
    name: str = "custom"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not self.layer_types:
            types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers))
            object.__setattr__(self, "layer_types", types[:-1] + (FULL,))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ---- derived facts, resolved once ---------------------------------------------------------
    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    @property
    def embed_scale(self) -> float:
        return self.hidden_size ** 0.5

    def layer_specs(self) -> list[LayerSpec]:
        first = self.first_shared_layer
        # a shared layer reads the last non-shared layer of its own type (transformers' kv_sharing_modes)
        source = {}
        for i in range(first):
            source[self.layer_types[i]] = i
        specs = []
        for i, kind in enumerate(self.layer_types):
            full = kind == FULL
            shared = i >= first
            inter = self.intermediate_size * (2 if (self.double_wide_mlp and shared) else 1)
            specs.append(LayerSpec(
                index=i, kind=kind,
                head_dim=self.global_head_dim if full else self.head_dim,
                num_kv_heads=(self.num_global_kv_heads or self.num_kv_heads) if full else self.num_kv_heads,
                intermediate_size=inter,
                kv_source=source[kind] if shared else i,
                stores_kv=not shared,
            ))
        return specs

    def validate(self):
        n = self.num_layers
        if len(self.layer_types) != n:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {n} layers")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise ConfigError(f"unknown layer types {bad}; expected {SLIDING!r} or {FULL!r}")
        if not 0 <= self.num_kv_shared_layers < n:
            raise ConfigError(f"num_kv_shared_layers={self.num_kv_shared_layers} must be in [0, {n})")
        unshared = set(self.layer_types[: self.first_shared_layer])
        if self.num_kv_shared_layers and unshared != set(self.layer_types):
            raise ConfigError("every layer type that is KV-shared needs a non-shared layer of that type to read")
        for h in (self.num_kv_heads, self.num_global_kv_heads or self.num_kv_heads):
            if self.num_heads % h:
                raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={h}")
        if self.family not in ("gemma4", "gemma3"):
            raise ConfigError(f"unknown family {self.family!r}")
        if self.sliding_window < 1:
            raise ConfigError("sliding_window must be >= 1")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def param_count(self) -> dict[str, int]:
        """Parameter counts by role (GEMMA4.md's 'Sizes and bytes')."""
        h, v = self.hidden_size, self.vocab_size
        attn = mlp = ple_layer = norms = 0
        for s in self.layer_specs():
            q = self.num_heads * s.head_dim
            kv = s.num_kv_heads * s.head_dim
            attn += h * q + q * h + (2 * h * kv if s.stores_kv else 0)
            mlp += 3 * h * s.intermediate_size
            ple_layer += 2 * h * self.ple_dim if self.ple_dim else 0
            norms += 4 * h + 2 * s.head_dim + (h if self.ple_dim else 0)
        counts = {"embed": v * h, "attention": attn, "mlp": mlp, "ple_layer": ple_layer, "norms": norms}
        if self.ple_dim:
            counts["ple_table"] = self.ple_vocab_size * n_ple(self)
            counts["ple_projection"] = h * n_ple(self)
        counts["total"] = sum(counts.values())
        return counts


def n_ple(cfg: ModelConfig) -> int:
    return cfg.num_layers * cfg.ple_dim


# ---- presets ------------------------------------------------------------------------------------
GEMMA4_E4B = ModelConfig(name="gemma4_e4b")

# E2B: 35 layers (4 sliding : 1 full), 1 KV head, 20 KV-shared layers with a double-wide MLP.
GEMMA4_E2B = ModelConfig(
    name="gemma4_e2b", hidden_size=1536, intermediate_size=6144, num_layers=35, num_kv_heads=1,
    layer_types=tuple(FULL if (i + 1) % 5 == 0 else SLIDING for i in range(35)),
    num_kv_shared_layers=20, double_wide_mlp=True,
)

# Tiny: the real structure (5:1 pattern, PLE, both layer types KV-shared, two head dims, partial
# proportional RoPE, softcap) at a size that runs in milliseconds on a CPU.
GEMMA4_TINY = ModelConfig(
    name="gemma4_tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=12,
    num_heads=4, num_kv_heads=2, head_dim=32, global_head_dim=64, sliding_window=16,
    num_kv_shared_layers=4, ple_dim=16, ple_vocab_size=512, max_position_embeddings=4096,
)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (GEMMA4_E4B, GEMMA4_E2B, GEMMA4_TINY)}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None


# ---- reading a checkpoint's config.json ---------------------------------------------------------
_GEMMA4_TYPES = {"gemma4", "gemma4_text"}
_GEMMA3_TYPES = {"gemma3", "gemma3_text"}


def from_hf_dict(d: dict, name: str = "checkpoint") -> ModelConfig:
    """Build from a transformers config dict: Gemma4ForConditionalGeneration (nested text_config),
    Gemma4ForCausalLM (top level), or a Gemma 3 text config."""
    mtype = d.get("model_type")
    if "text_config" in d and isinstance(d["text_config"], dict):
        if mtype not in _GEMMA4_TYPES | _GEMMA3_TYPES:
            raise ConfigError(f"model_type {mtype!r} is not Gemma 4 (expected one of {sorted(_GEMMA4_TYPES)})")
        d = d["text_config"]
        mtype = d.get("model_type", "gemma4_text" if mtype in _GEMMA4_TYPES else "gemma3_text")
    if mtype in _GEMMA4_TYPES:
        return _from_gemma4(d, name)
    if mtype in _GEMMA3_TYPES:
        return _from_gemma3(d, name)
    raise ConfigError(f"model_type {mtype!r} is not Gemma 4 (expected one of {sorted(_GEMMA4_TYPES)}, "
                      f"or Gemma 3 text: {sorted(_GEMMA3_TYPES)})")


def _req(d: dict, key: str):
    if key not in d:
        raise ConfigError(f"config.json lacks {key!r}")
    return d[key]


def _eos(d: dict) -> tuple[int, ...]:
    e = d.get("eos_token_id", 1)
    return tuple(e) if isinstance(e, list) else (e,)


def _rope(d: dict, kind: str) -> dict:
    rp = d.get("rope_parameters") or {}
    return rp.get(kind) or {}


def _from_gemma4(d: dict, name: str) -> ModelConfig:
    n = _req(d, "num_hidden_layers")
    head_dim = d.get("head_dim", 256)
    # the full-layer head dim: a top-level key in released configs, per_layer_config in newer ones
    gdim = d.get("global_head_dim")
    plc = d.get("per_layer_config") or {}
    for v in plc.values():
        if isinstance(v, dict) and "head_dim" in v:
            gdim = gdim or v["head_dim"]
    if d.get("enable_moe_block"):
        raise ConfigError("Gemma 4 MoE checkpoints (enable_moe_block) are not supported")
    if d.get("attention_k_eq_v"):
        raise ConfigError("attention_k_eq_v checkpoints are not supported")
    full = _rope(d, FULL)
    loc = _rope(d, SLIDING)
    return ModelConfig(
        family="gemma4", name=name,
        vocab_size=_req(d, "vocab_size"), hidden_size=_req(d, "hidden_size"),
        intermediate_size=_req(d, "intermediate_size"), num_layers=n,
        num_heads=_req(d, "num_attention_heads"), num_kv_heads=_req(d, "num_key_value_heads"),
        head_dim=head_dim, global_head_dim=gdim or 512,
        num_global_kv_heads=d.get("num_global_key_value_heads") if d.get("attention_k_eq_v") else None,
        layer_types=tuple(d.get("layer_types") or ()),
        sliding_window=d.get("sliding_window", 512),
        rope_local_theta=loc.get("rope_theta", 10_000.0),
        rope_global_theta=full.get("rope_theta", 1_000_000.0),
        rope_global_partial=full.get("partial_rotary_factor", 0.25 if full.get("rope_type", "proportional") == "proportional" else 1.0),
        rope_global_factor=full.get("factor", 1.0),
        rms_eps=d.get("rms_norm_eps", 1e-6),
        final_logit_softcap=d.get("final_logit_softcapping"),
        num_kv_shared_layers=d.get("num_kv_shared_layers", 0),
        ple_dim=d.get("hidden_size_per_layer_input", 0) or 0,
        ple_vocab_size=d.get("vocab_size_per_layer_input", d["vocab_size"]),
        double_wide_mlp=bool(d.get("use_double_wide_mlp", False)),
        tie_embeddings=d.get("tie_word_embeddings", True),
        bos_id=d.get("bos_token_id", 2), eos_ids=_eos(d), pad_id=d.get("pad_token_id", 0) or 0,
        max_position_embeddings=d.get("max_position_embeddings", 131072),
    )


def _from_gemma3(d: dict, name: str) -> ModelConfig:
    """A Gemma 3 text config (Gemma3ForCausalLM, or the text_config of Gemma3ForConditionalGeneration).
    Missing keys take Gemma3TextConfig's defaults, as transformers reads the same file."""
    n = _req(d, "num_hidden_layers")
    head_dim = d.get("head_dim", 256)
    window = d.get("sliding_window", 4096)
    types = d.get("layer_types")
    if not types:
        pat = d.get("sliding_window_pattern", 6)
        types = [FULL if (i + 1) % pat == 0 else SLIDING for i in range(n)]
    if not window:  # no window: every layer attends over the whole context
        types, window = [FULL] * n, d.get("max_position_embeddings", 131072)
    rp = d.get("rope_parameters") or {}
    full = dict(rp.get(FULL) or {})
    loc = dict(rp.get(SLIDING) or {})
    if not rp:  # older layout: rope_theta / rope_local_base_freq / rope_scaling (full layers only)
        full = {"rope_theta": d.get("rope_theta", 1_000_000.0), **(d.get("rope_scaling") or {})}
        loc = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    for kind, r in ((FULL, full), (SLIDING, loc)):
        rtype = r.get("rope_type", r.get("type", "default"))
        if rtype not in ("default", "linear") or (kind == SLIDING and rtype != "default"):
            raise ConfigError(f"Gemma 3 RoPE type {rtype!r} on {kind} layers is not supported "
                              "(default everywhere, or linear on full-attention layers)")
    linear = full.get("rope_type", full.get("type")) == "linear"
    if d.get("attn_logit_softcapping"):
        raise ConfigError("Gemma 3 configs with attn_logit_softcapping are not supported")
    if d.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention (EmbeddingGemma) is an encoder, not a decoder")
    return ModelConfig(
        family="gemma3", name=name,
        vocab_size=_req(d, "vocab_size"), hidden_size=_req(d, "hidden_size"),
        intermediate_size=_req(d, "intermediate_size"), num_layers=n,
        num_heads=_req(d, "num_attention_heads"), num_kv_heads=_req(d, "num_key_value_heads"),
        head_dim=head_dim, global_head_dim=head_dim, layer_types=tuple(types),
        sliding_window=window,
        rope_local_theta=loc.get("rope_theta", 10_000.0),
        rope_global_theta=full.get("rope_theta", 1_000_000.0),
        rope_global_partial=1.0,
        rope_global_factor=float(full["factor"]) if linear else 1.0,
        rms_eps=d.get("rms_norm_eps", 1e-6),
        final_logit_softcap=d.get("final_logit_softcapping"),
        num_kv_shared_layers=0, ple_dim=0, ple_vocab_size=0,
        # Gemma 3 scales q.k by query_pre_attn_scalar^-0.5 (256^-0.5 = 1/16 for 270M-12B)
        attn_scale=d.get("query_pre_attn_scalar", 256) ** -0.5,
        norm_offset=1.0, v_norm=False, layer_scalar=False,
        tie_embeddings=d.get("tie_word_embeddings", True),
        bos_id=d.get("bos_token_id", 2), eos_ids=_eos(d), pad_id=d.get("pad_token_id", 0) or 0,
        max_position_embeddings=d.get("max_position_embeddings", 131072),
    )


def read_config_json(path: str | Path) -> ModelConfig:
    """config.json of a checkpoint directory (or the file itself)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise ConfigError(f"{p}: no such file or directory")
    if not f.is_file():
        raise ConfigError(f"{p}: no config.json in this directory")
    try:
        d = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{f}: cannot read config ({e})") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{f}: not a JSON object")
    return from_hf_dict(d, name=p.name if p.is_dir() else p.parent.name)
