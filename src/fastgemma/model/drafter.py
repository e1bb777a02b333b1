"""The Gemma 4 MTP drafter: transformers' Gemma4AssistantForCausalLM (google/gemma-4-E4B-it-assistant).

E4B's drafter: hidden 256, 4 layers [sliding x3, full], 4 query heads over 2 KV heads, every layer
KV-shared: it computes queries only and attends over the target's post-norm, post-RoPE K/V of the
target's last store layer of each type (E4B: 22 sliding, 23 full); it never writes the cache.
One draft step (batch B, one row):
  z = W_pre [E_target[tok] * sqrt(H_target) ; h]      [B, 1, 2 * 2560] -> [B, 1, 256]
  z = 4 decoder layers (RoPE at the fixed position p, keys at positions < p)
  g = final_norm(z); h' = W_post g                    [B, 1, 256] -> [B, 1, 2560]
  token = argmax over the candidates of the top-k centroids of W_c g (32 x 128 of 262,144 rows)
Names follow transformers' state dict (`model.layers.{i}...`, `pre_projection`, `masked_embedding.*`)
so a checkpoint loads by name. The head's rows are the drafter's own tied embedding (262144 x 256);
it is never used as an input embedding (inputs come from the target's table).

Traps: no softcap on the drafter's logits; `token_ordering` viewed [num_centroids, V / num_centroids]
lists each centroid's canonical token ids; layer_scalar is a persistent buffer in checkpoints.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import is_int
from .config import FULL, SLIDING, LayerSpec, ModelConfig
from .decoder import DecoderLayer, _rounded
from .layers import RMSNorm, fill_rope_buffers, register_rope_buffers, rope_cos_sin


class DrafterError(ValueError):
    """A drafter that cannot serve this target, said in one line."""


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int = 256
    intermediate_size: int = 2048
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 256                  # sliding layers
    global_head_dim: int = 512           # full layers
    layer_types: tuple[str, ...] = (SLIDING, SLIDING, SLIDING, FULL)
    vocab_size: int = 262144
    backbone_hidden_size: int = 2560     # the target's hidden size it was trained on (E2B: 1536)
    ordered_embeddings: bool = True      # centroid-masked head (use_ordered_embeddings)
    num_centroids: int = 2048
    centroid_top_k: int = 32             # centroid_intermediate_top_k: 32 x 128 = 4096 candidates
    rms_eps: float = 1e-6
    rope_local_theta: float = 10_000.0
    rope_global_theta: float = 1_000_000.0
    rope_global_partial: float = 0.25
    rope_global_factor: float = 1.0
    sliding_window: int = 512            # informational: the cache's window is what masks keys
    name: str = "gemma4_e4b_assistant"

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad or not self.layer_types:
            raise DrafterError(f"drafter layer_types {list(self.layer_types)}: expected {SLIDING!r} / {FULL!r}")
        if self.num_heads % self.num_kv_heads:
            raise DrafterError(f"drafter num_heads={self.num_heads} is not a multiple of "
                               f"num_kv_heads={self.num_kv_heads}")
        if self.ordered_embeddings:
            if self.vocab_size % self.num_centroids:
                raise DrafterError(f"vocab {self.vocab_size} is not a multiple of num_centroids {self.num_centroids}")
            if not 1 <= self.centroid_top_k <= self.num_centroids:
                raise DrafterError(f"centroid_top_k={self.centroid_top_k} must be in [1, {self.num_centroids}]")

    @property
    def tokens_per_centroid(self) -> int:
        return self.vocab_size // self.num_centroids

    @property
    def candidates(self) -> int:
        """Head rows scored per draft token (E4B: 4096); the whole vocabulary without ordering."""
        return self.centroid_top_k * self.tokens_per_centroid if self.ordered_embeddings else self.vocab_size

    def body_config(self) -> ModelConfig:
        """A ModelConfig for DecoderLayer: no PLE, Gemma 4 norms and attention scale 1.0."""
        return ModelConfig(
            name=self.name, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=len(self.layer_types), num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, global_head_dim=self.global_head_dim,
            layer_types=self.layer_types, num_kv_shared_layers=0, ple_dim=0, ple_vocab_size=0,
            rms_eps=self.rms_eps, final_logit_softcap=None, sliding_window=self.sliding_window)

    def check_target(self, target: ModelConfig, where: str = "drafter"):
        """Refuse a target whose embedding, hidden size or shared K/V this drafter cannot read."""
        if target.family != "gemma4":
            raise DrafterError(f"{where}: the MTP drafter serves Gemma 4 targets, not {target.family} ({target.name})")
        if self.backbone_hidden_size != target.hidden_size:
            raise DrafterError(
                f"{where}: the drafter was trained on a backbone of hidden size {self.backbone_hidden_size}, but the "
                f"target {target.name} has hidden size {target.hidden_size} (E4B 2560, E2B 1536): use the drafter "
                f"made for this target")
        if self.vocab_size != target.vocab_size:
            raise DrafterError(f"{where}: drafter vocabulary {self.vocab_size} != target vocabulary "
                               f"{target.vocab_size}")
        src = kv_sources(target)
        for kind, (dim, heads) in {SLIDING: (self.head_dim, self.num_kv_heads),
                                   FULL: (self.global_head_dim, self.num_kv_heads)}.items():
            if kind not in self.layer_types:
                continue
            if kind not in src:
                raise DrafterError(f"{where}: the drafter has {kind} layers but target {target.name} stores no such KV")
            s = target.layer_specs()[src[kind]]
            if (s.head_dim, s.num_kv_heads) != (dim, heads):
                raise DrafterError(
                    f"{where}: drafter {kind} layers read target layer {s.index}'s K/V: head_dim {dim} x {heads} KV "
                    f"heads vs the target's {s.head_dim} x {s.num_kv_heads}")


def kv_sources(target: ModelConfig) -> dict[str, int]:
    """Target layer whose cache the drafter's layers of each type read: the last store layer of
    that type (E4B: sliding 22, full 23), which is what transformers' shared_kv_states holds."""
    out = {}
    for s in target.layer_specs():
        if s.stores_kv:
            out[s.kind] = s.index
    return out


def drafter_config_for(target: ModelConfig, **overrides) -> DrafterConfig:
    """The drafter shape for a target: E4B's published shape for E4B-like targets (hidden 256,
    intermediate 2048); otherwise the same structure scaled down (the tiny test drafter)."""
    src = kv_sources(target)
    specs = target.layer_specs()
    sl = specs[src[SLIDING]] if SLIDING in src else specs[src[FULL]]
    fl = specs[src[FULL]] if FULL in src else sl
    kv = sl.num_kv_heads
    big = target.hidden_size >= 1024
    hidden = 256 if big else max(16, target.hidden_size // 2)
    cent = 2048
    while cent > 1 and (target.vocab_size % cent or target.vocab_size // cent < 16):
        cent //= 2
    d = dict(hidden_size=hidden, intermediate_size=8 * hidden, num_heads=kv * max(1, 4 // kv), num_kv_heads=kv,
             head_dim=sl.head_dim, global_head_dim=fl.head_dim, vocab_size=target.vocab_size,
             backbone_hidden_size=target.hidden_size, num_centroids=cent, centroid_top_k=min(32, max(1, cent // 4)),
             rms_eps=target.rms_eps, rope_local_theta=target.rope_local_theta,
             rope_global_theta=target.rope_global_theta, rope_global_partial=target.rope_global_partial,
             rope_global_factor=target.rope_global_factor, sliding_window=target.sliding_window,
             name=f"{target.name}_assistant" + ("" if big else "_scaled"))
    d.update(overrides)
    return DrafterConfig(**d)


class DrafterBody(nn.Module):
    """transformers' `model.` prefix: embed_tokens (the head's rows only), layers, final norm."""

    def __init__(self, cfg: DrafterConfig, sources: dict[str, int]):
        super().__init__()
        body = cfg.body_config()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        specs = [LayerSpec(index=i, kind=kind, head_dim=cfg.global_head_dim if kind == FULL else cfg.head_dim,
                           num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                           kv_source=sources[kind], stores_kv=False)
                 for i, kind in enumerate(cfg.layer_types)]
        self.layers = nn.ModuleList(DecoderLayer(body, s) for s in specs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class MaskedEmbedder(nn.Module):
    """transformers' `masked_embedding`: centroids [C, hidden] and token_ordering [V] (int64)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.centroids = nn.Linear(cfg.hidden_size, cfg.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(cfg.vocab_size, dtype=torch.long))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, target: ModelConfig):
        super().__init__()
        cfg.check_target(target)
        self.config, self.target_config = cfg, target
        self.sources = kv_sources(target)
        self.model = DrafterBody(cfg, self.sources)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, cfg.hidden_size, bias=False)
        self.post_projection = nn.Linear(cfg.hidden_size, cfg.backbone_hidden_size, bias=False)
        self.masked_embedding = MaskedEmbedder(cfg) if cfg.ordered_embeddings else None
        register_rope_buffers(self, cfg)
        self.top_k = cfg.centroid_top_k
        self.fused_forward = None  # fn(drafter, x, rope, q_pos, cache, attn) -> (g, h'): fuse=layers
        self.head_fn = None  # fn(g, centroids, token_ordering, rows, top_k) -> ids, e.g. kernels.draft_head
        self.init_buffers()

    def init_buffers(self):
        fill_rope_buffers(self, self.config)

    def set_top_k(self, k: int | None):
        """Centroids scored per draft token (None: the checkpoint's). Fewer is faster and lossier."""
        c = self.config
        if k is None:
            self.top_k = c.centroid_top_k
            return
        if not c.ordered_embeddings:
            raise DrafterError("centroid_top_k needs a drafter with an ordered (centroid-masked) head")
        if not is_int(k, 1, c.num_centroids):
            raise DrafterError(f"centroid_top_k={k!r} must be an integer in [1, {c.num_centroids}]")
        self.top_k = k

    # ---- one draft step ------------------------------------------------------------------------
    def rope(self, pos, dtype):
        """pos [B, 1] -> {sliding?: (cos, sin)}: the fixed position of the whole draft loop."""
        return {True: rope_cos_sin(pos, self.inv_freq_sliding, dtype),
                False: rope_cos_sin(pos, self.inv_freq_full, dtype)}

    def embed_input(self, tok, target_embed):
        """tok [B, 1] -> E_target[tok] * sqrt(H_target) in the weight dtype's rounding (as transformers)."""
        return F.embedding(tok, target_embed) * _rounded(self.config.backbone_hidden_size ** 0.5, target_embed.dtype)

    @staticmethod
    def attend_target(layer, q, q_pos, cache, attn):
        """q [B, 1, H, D] (normed, RoPE'd) -> [B, 1, H * D] over the target's K/V of the layer's kind."""
        s = layer.spec
        src = s.kv_source
        if s.sliding:
            o = attn(q, cache.k[src], cache.v[src], q_pos, cache.ring_pos, cache.window, 1.0)
        else:
            o = attn(q, cache.k[src], cache.v[src], q_pos, None, 0, 1.0)
        return o.flatten(2)

    def forward(self, x, rope, q_pos, cache, attn):
        """x [B, 1, 2 * H_target] (embedding ; hidden) -> g [B, 1, hidden] (final-norm), h' [B, 1, H_target].
        q_pos [B, 1]: the masking position, one before the RoPE position (keys strictly before it).
        One row (B = 1) takes `fused_forward` when fuse=layers set it (decided when traced)."""
        if self.fused_forward is not None and x.shape[0] == 1:
            return self.fused_forward(self, x, rope, q_pos, cache, attn)
        z = self.pre_projection(x)

        def attend(layer, a):
            q, _, _ = layer.self_attn.project(a, *rope[layer.spec.sliding])
            return self.attend_target(layer, q, q_pos, cache, attn)

        for layer in self.model.layers:
            z = layer(z, None, attend)
        g = self.model.norm(z)
        return g, self.post_projection(g)

    # ---- head ----------------------------------------------------------------------------------
    def candidates(self, g):
        """g [N, hidden] -> candidate token ids [N, top_k * V/C] (None: the whole vocabulary)."""
        if self.masked_embedding is None:
            return None
        me = self.masked_embedding
        top = me.centroids(g).topk(self.top_k, dim=-1).indices  # [N, top_k]
        table = me.token_ordering.view(self.config.num_centroids, -1)  # [C, V/C]
        return table[top].flatten(1)

    def next_token(self, g):
        """g [..., hidden] -> argmax token ids [...]: scores only the candidate rows (E4B: 4096 x 256,
        2 MB in bf16, instead of the 134 MB head)."""
        shape = g.shape[:-1]
        g = g.reshape(-1, g.shape[-1])
        w = self.model.embed_tokens.weight
        me = self.masked_embedding
        if self.head_fn is not None and me is not None:  # e.g. two launches (kernels/draft_head.py)
            return self.head_fn(g, me.centroids.weight, me.token_ordering, w, self.top_k).view(shape)
        cand = self.candidates(g)
        if cand is None:
            return F.linear(g, w).argmax(-1).view(shape)
        scores = torch.einsum("nkd,nd->nk", w[cand], g)  # [N, K]
        return cand.gather(1, scores.argmax(-1, keepdim=True)).view(shape)

    def logits(self, g):
        """g [..., hidden] -> [..., V] as transformers returns them: candidates scored, the rest set to
        (min candidate score - 1). The reference for next_token; host sync (min), not for the hot loop."""
        shape = g.shape[:-1]
        g = g.reshape(-1, g.shape[-1])
        w = self.model.embed_tokens.weight
        cand = self.candidates(g)
        if cand is None:
            return F.linear(g, w).view(*shape, -1)
        scores = torch.einsum("nkd,nd->nk", w[cand], g)
        fill = scores.min().item() - 1.0
        out = torch.full((g.shape[0], self.config.vocab_size), fill, dtype=g.dtype, device=g.device)
        return out.scatter_(1, cand, scores).view(*shape, -1)

    def nbytes_per_step(self) -> int:
        """Weight bytes one draft step reads: every matrix but the head table, plus the candidate rows."""
        n = 0
        for name, p in self.named_parameters():
            if name != "model.embed_tokens.weight":
                n += p.numel() * p.element_size()
        w = self.model.embed_tokens.weight
        rows = self.top_k * self.config.tokens_per_centroid if self.masked_embedding is not None else w.shape[0]
        return n + rows * w.shape[1] * w.element_size()


# ---- building: synthetic or from a checkpoint ---------------------------------------------------
def empty_drafter(cfg: DrafterConfig, target: ModelConfig, device, dtype) -> Drafter:
    """Parameters allocated on `device` in `dtype` without initialising them twice (meta first)."""
    with torch.device("meta"):
        d = Drafter(cfg, target).to(dtype)
    d.inv_freq_sliding = d.inv_freq_sliding.float()  # RoPE frequencies stay fp32
    d.inv_freq_full = d.inv_freq_full.float()
    if d.masked_embedding is not None:
        d.masked_embedding.token_ordering = d.masked_embedding.token_ordering.long()
    d = d.to_empty(device=device)
    with torch.no_grad():
        d.init_buffers()
        for layer in d.model.layers:
            layer.layer_scalar.fill_(1.0)
    return d.requires_grad_(False).eval()


@torch.no_grad()
def synthetic_drafter(target: ModelConfig, device="cpu", dtype=torch.bfloat16, seed: int = 0,
                      cfg: DrafterConfig | None = None) -> Drafter:
    """Seeded random weights with the exact shapes (E4B: 78.5M parameters) and a random
    token_ordering permutation. Untrained: its drafts almost never match (spec=replay sets acceptance)."""
    from ..weights.synthetic import _std

    cfg = cfg or drafter_config_for(target)
    d = empty_drafter(cfg, target, device, dtype)
    dev = torch.device(device)
    for name, p in d.named_parameters():
        g = torch.Generator(device=dev)
        g.manual_seed(seed * 1_000_003 + zlib.crc32(("drafter." + name).encode()))
        mean, std = _std(name, p)
        p.normal_(mean, std, generator=g)
    if d.masked_embedding is not None:
        g = torch.Generator().manual_seed(seed + 17)
        d.masked_embedding.token_ordering.copy_(torch.randperm(cfg.vocab_size, generator=g))
    return d


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DrafterError(f"{path}: cannot read ({e})") from e
    if not isinstance(d, dict):
        raise DrafterError(f"{path}: not a JSON object")
    return d


def config_from_hf(d: dict, where: str = "config.json") -> DrafterConfig:
    """DrafterConfig from a Gemma4AssistantConfig dict (model_type gemma4_assistant)."""
    if d.get("model_type") != "gemma4_assistant":
        raise DrafterError(f"{where}: model_type {d.get('model_type')!r} is not a Gemma 4 drafter "
                           "(expected 'gemma4_assistant', transformers' Gemma4AssistantForCausalLM)")
    t = d.get("text_config")
    if not isinstance(t, dict):
        raise DrafterError(f"{where}: no text_config")
    for key, want in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False), ("use_double_wide_mlp", False)):
        if t.get(key) not in (None, want):
            raise DrafterError(f"{where}: text_config.{key}={t.get(key)!r} (a drafter has {want!r})")
    if t.get("attention_k_eq_v"):
        raise DrafterError(f"{where}: attention_k_eq_v drafters are not supported")
    try:
        n = t["num_hidden_layers"]
        head_dim = t.get("head_dim", 256)
        gdim = t.get("global_head_dim")
        for v in (t.get("per_layer_config") or {}).values():
            if isinstance(v, dict) and "head_dim" in v and v["head_dim"] != head_dim:
                gdim = gdim or v["head_dim"]
        rp = t.get("rope_parameters") or {}
        full, loc = rp.get(FULL) or {}, rp.get(SLIDING) or {}
        types = tuple(t.get("layer_types") or (SLIDING,) * (n - 1) + (FULL,))
        if len(types) != n:
            raise DrafterError(f"{where}: {len(types)} layer_types for {n} layers")
        return DrafterConfig(
            hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
            num_heads=t["num_attention_heads"], num_kv_heads=t["num_key_value_heads"], head_dim=head_dim,
            global_head_dim=gdim or head_dim, layer_types=types, vocab_size=t["vocab_size"],
            backbone_hidden_size=d.get("backbone_hidden_size", 1536),
            ordered_embeddings=bool(d.get("use_ordered_embeddings", False)),
            num_centroids=d.get("num_centroids", 2048), centroid_top_k=d.get("centroid_intermediate_top_k", 32),
            rms_eps=t.get("rms_norm_eps", 1e-6), rope_local_theta=loc.get("rope_theta", 10_000.0),
            rope_global_theta=full.get("rope_theta", 1_000_000.0),
            rope_global_partial=full.get("partial_rotary_factor",
                                         0.25 if full.get("rope_type", "proportional") == "proportional" else 1.0),
            rope_global_factor=full.get("factor", 1.0), sliding_window=t.get("sliding_window", 512),
            name=d.get("_name_or_path") or "checkpoint")
    except KeyError as e:
        raise DrafterError(f"{where}: text_config lacks {e.args[0]!r}") from None


def to_hf_assistant_config(cfg: DrafterConfig, **kw):
    """transformers' Gemma4AssistantConfig with this architecture: the reference in tests, and the
    config.json a checkpoint of this shape carries."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    text = Gemma4TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=len(cfg.layer_types), num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, global_head_dim=cfg.global_head_dim,
        layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
        num_kv_shared_layers=len(cfg.layer_types), hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        final_logit_softcapping=None, rms_norm_eps=cfg.rms_eps,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
                         FULL: {"rope_type": "proportional", "rope_theta": cfg.rope_global_theta,
                                "partial_rotary_factor": cfg.rope_global_partial}}, **kw)
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=cfg.backbone_hidden_size,
                                 use_ordered_embeddings=cfg.ordered_embeddings, num_centroids=cfg.num_centroids,
                                 centroid_intermediate_top_k=cfg.centroid_top_k)


@torch.no_grad()
def load_drafter(path, target: ModelConfig, device="cpu", dtype=torch.bfloat16) -> Drafter:
    """A local checkpoint directory in google/gemma-4-E4B-it-assistant's format (config.json +
    safetensors). Every key and shape is checked before a byte is copied."""
    from safetensors import safe_open

    from ..weights.hf import CheckpointError, _headers, _shards

    root = Path(path).expanduser()
    if not root.is_dir():
        raise DrafterError(f"drafter checkpoint {root}: no such directory")
    if not (root / "config.json").is_file():
        raise DrafterError(f"drafter checkpoint {root}: no config.json")
    cfg = config_from_hf(_read_json(root / "config.json"), str(root / "config.json"))
    cfg = replace(cfg, name=root.name)
    cfg.check_target(target, where=f"drafter checkpoint {root}")
    try:
        header = _headers(_shards(root))
    except CheckpointError as e:
        raise DrafterError(str(e)) from None
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Drafter(cfg, target).state_dict().items()}
    head = "model.embed_tokens.weight"
    # the drafter's embed_tokens is only its head: an untied lm_head takes its place
    keys = dict(header)
    if "lm_head.weight" in keys:
        keys[head] = keys.pop("lm_head.weight")
    missing = sorted(set(expected) - set(keys))
    unexpected = sorted(set(keys) - set(expected))
    shapes = [f"{k}: checkpoint {list(keys[k][1])} vs model {list(v)}" for k, v in expected.items()
              if k in keys and tuple(keys[k][1]) != v]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing[:12])}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:12])}")
    if shapes:
        problems.append("shape mismatch: " + "; ".join(shapes[:12]))
    if problems:
        raise DrafterError(f"drafter checkpoint {root}: " + " | ".join(problems))
    d = empty_drafter(cfg, target, device, dtype)
    sd = d.state_dict()
    src_name = {k: k for k in expected}
    if "lm_head.weight" in header:
        src_name[head] = "lm_head.weight"
    by_file: dict[Path, list[str]] = {}
    for k in expected:
        by_file.setdefault(header[src_name[k]][0], []).append(k)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for k in names:
                sd[k].copy_(sf.get_tensor(src_name[k]))
    if d.masked_embedding is not None:
        order = d.masked_embedding.token_ordering
        if int(order.min()) < 0 or int(order.max()) >= cfg.vocab_size:
            raise DrafterError(f"drafter checkpoint {root}: token_ordering has ids outside [0, {cfg.vocab_size})")
    d.init_buffers()
    return d
