"""The Gemma 4 (and Gemma 3) text decoder over a static KV cache.

`forward` returns final-norm hidden states; `compute_logits` is the head seam (tied embedding,
softcap), where pruned heads and fused argmax plug in. Parameter names follow transformers'
(`embed_tokens`, `layers.{i}.self_attn.q_proj`, ...) so checkpoints map by stripping a prefix.

Two ways through the cache, one layer code:
- `forward(..., start=int)`: prompt chunks and eager decode. Sliding layers attend over
  cat(ring, new) and write afterwards (any chunk length); full layers write, then attend over the
  first start+T slots.
- `step(...)`: the static decode/verify step (T <= cache.step_rows): every write lands before the
  attention, which goes through `self.step_attention` (torch twin or Triton kernel), with no host
  integers, so the whole step can be captured in a CUDA graph.
"""
from __future__ import annotations

import struct
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, LayerSpec
from .layers import MLP, RMSNorm, apply_rope, fill_rope_buffers, gelu_tanh, register_rope_buffers, rope_cos_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        h, d = cfg.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_eps, cfg.norm_offset)
        if spec.stores_kv:
            self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
            self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
            self.k_norm = RMSNorm(d, cfg.rms_eps, cfg.norm_offset)
            # Gemma 4 normalises v without a weight; Gemma 3 leaves v alone
            self.v_norm = RMSNorm(d, cfg.rms_eps, with_scale=False) if cfg.v_norm else nn.Identity()
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def project(self, x, cos, sin):
        """x [B, T, hidden] -> q [B, T, H, D], and k, v [B, T, Hkv, D] (None on KV-shared layers)."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        if not hasattr(self, "k_proj"):
            return apply_rope(self.q_norm(q), cos, sin), None, None
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return self.finish(q, k, v, cos, sin)

    def finish(self, q, k, v, cos, sin):
        """q/k norms, RoPE, v norm: the reference for the fused kernel."""
        q = apply_rope(self.q_norm(q), cos, sin)
        if k is None:
            return q, None, None
        return q, apply_rope(self.k_norm(k), cos, sin), self.v_norm(v)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        h = cfg.hidden_size
        self.spec = spec
        self.self_attn = Attention(cfg, spec)
        self.mlp = MLP(h, spec.intermediate_size)
        norm = lambda: RMSNorm(h, cfg.rms_eps, cfg.norm_offset)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.ple = bool(cfg.ple_dim)
        if self.ple:
            self.per_layer_input_gate = nn.Linear(h, cfg.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(cfg.ple_dim, h, bias=False)
            self.post_per_layer_input_norm = norm()
        self.register_buffer("layer_scalar", torch.ones(1), persistent=cfg.layer_scalar)

    def forward(self, x, p, attend):
        """x [B, T, hidden]; p [B, T, ple_dim] this layer's PLE input; attend(layer, a) -> [B, T, H*D]."""
        return self.finish(x, attend(self, self.input_layernorm(x)), p)

    def finish(self, x, o, p):
        """The layer after its attention: o [B, T, H*D] through o_proj, the residuals, the MLP and the PLE gate."""
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(o))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.ple:
            g = gelu_tanh(self.per_layer_input_gate(x)) * p
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


def _rounded(x: float, dtype) -> float:
    """x rounded to dtype, in pure Python (traceable by torch.compile, no device work)."""
    if dtype == torch.float32:
        return struct.unpack("f", struct.pack("f", x))[0]
    if dtype == torch.float16:
        return struct.unpack("e", struct.pack("e", x))[0]
    if dtype == torch.bfloat16:  # round-to-nearest-even on the top 16 bits of the fp32 pattern
        b = struct.unpack("I", struct.pack("f", x))[0]
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return struct.unpack("f", struct.pack("I", b))[0]
    return x


def _visible(q_pos, kv_pos, window: int):
    """[B, T] x [B, S] -> bool [B, 1, T, S]: 0 <= kv <= q and kv > q - window."""
    q, k = q_pos[:, :, None], kv_pos[:, None, :]
    m = (k <= q) & (k >= 0) & (k > q - window)
    return m[:, None]


def sdpa(q, k, v, mask, scale: float):
    """q [B, T, H, D], k/v [B, S, Hkv, D], mask bool [B, 1, T, S] -> [B, T, H*D]."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).flatten(2)


# ---- the prompt forward's pieces: Model.forward(regions=PromptRegions(...)) -------------------------------------
def prompt_inputs(model, ids, pos):
    """A chunk's inputs before the first layer: embeddings x0, per-layer inputs (or None), RoPE by kind."""
    x, ple = model.embed(ids)
    return x, ple, model.rope(pos, x.dtype)


def layer_qkv(layer: DecoderLayer, x, cos, sin):
    """A layer's work before its cache: the input norm, then q / k / v with their norms and RoPE."""
    return layer.self_attn.project(layer.input_layernorm(x), cos, sin)


def store_ring(k_cache, v_cache, ring_pos, k, v, pos, bidx, ring_rows, ring_slots):
    """A sliding layer's chunk K/V [B, T, Hkv, D] into its ring [B, ring, Hkv, D]: returns what the chunk
    attends to, the ring as it was then the chunk (K, V and positions), and writes the chunk's last rows."""
    k_all, v_all = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
    kv_pos = torch.cat([ring_pos, pos.to(torch.int32)], 1)
    k_cache[bidx, ring_slots] = k[:, ring_rows]
    v_cache[bidx, ring_slots] = v[:, ring_rows]
    return k_all, v_all, kv_pos


def store_full(k_cache, v_cache, k, v, pos, bidx, full_len: int):
    """A full layer's chunk K/V written at its positions: returns the first full_len slots (K, V)."""
    k_cache[bidx, pos] = k
    v_cache[bidx, pos] = v
    return k_cache[:, :full_len], v_cache[:, :full_len]


def visible_sdpa(q, k, v, q_pos, kv_pos, window: int, scale: float):
    """sdpa under the mask of `_visible`."""
    return sdpa(q, k, v, _visible(q_pos, kv_pos, window), scale)


class PromptRegions(NamedTuple):
    """How the prompt forward runs: inputs(model, ids, pos) once, then each layer as qkv(layer, x, cos, sin), its
    cache writes (store_ring / store_full), attend(q, k, v, q_pos, kv_pos, window, scale), finish(layer, x, o, p).
    The defaults are the plain functions; the generator's compile_prefill="layers" compiles each once (a layer's
    once for every layer of a kind; the cache tensors are arguments, written in place), so the prompt compiles
    in seconds where the whole forward takes minutes."""
    inputs: Callable = prompt_inputs
    qkv: Callable = layer_qkv
    store_ring: Callable = store_ring
    store_full: Callable = store_full
    attend: Callable = visible_sdpa
    finish: Callable = DecoderLayer.finish


PLAIN = PromptRegions()


class Gemma4Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.specs = cfg.layer_specs()
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        if cfg.ple_dim:
            n = cfg.num_layers * cfg.ple_dim
            self.embed_tokens_per_layer = nn.Embedding(cfg.ple_vocab_size, n)  # 262144 x 10752, gather only
            self.per_layer_model_projection = nn.Linear(h, n, bias=False)
            self.per_layer_projection_norm = RMSNorm(cfg.ple_dim, cfg.rms_eps, cfg.norm_offset)
        self.layers = nn.ModuleList(DecoderLayer(cfg, s) for s in self.specs)
        self.norm = RMSNorm(h, cfg.rms_eps, cfg.norm_offset)
        register_rope_buffers(self, cfg)
        self.init_buffers()
        self.step_attention = None  # set by the builder: fn(q, k, v, q_pos, slot_pos, window, scale)
        self.logits_head = None     # optional head override: fn(hidden) -> logits (pruned / quantised)
        self.fused_decode = None    # optional one-row step: fn(model, ids, pos, cache) -> hidden (fuse=layers)
        self.fused_verify = None    # optional wider step, same signature (fuse=layers: GEMM epilogues)
        self.fuse_drafter = None    # fn(drafter) -> drafter: the same fusion for an MTP drafter (fuse=layers)
        self.draft_head = None      # fn(g, centroids, ordering, rows, top_k) -> ids: kernels/draft_head (fuse=layers)
        self.ple_from_table = False  # ple=table: embed_tokens_per_layer holds each id's whole PLE input (use_ple_table)

    def init_buffers(self):
        """(Re)compute non-persistent buffers: after building on the meta device and to_empty()."""
        c = self.config
        if self.inv_freq_sliding.is_meta:
            return
        fill_rope_buffers(self, c)
        if not c.layer_scalar:
            for layer in self.layers:
                layer.layer_scalar.fill_(1.0)

    # ---- embeddings ----------------------------------------------------------------------------
    def embed(self, ids, project=None, norm=None):
        """ids [B, T] -> x0 [B, T, hidden], ple [B, T, L, ple_dim] (or None). project / norm: what
        computes the PLE context projection and its RMSNorm (default: the model's modules; the fused
        steps' batch-invariant kernels); after use_ple_table (ple=table) the PLE input is a row gather."""
        w = self.embed_tokens.weight
        x0 = F.embedding(ids, w) * self.embed_scale()
        return x0, self.ple_inputs(ids, x0, project, norm)

    def embed_scale(self) -> float:
        """The token embedding's scale: transformers casts sqrt(hidden) to the weight dtype first (50.5 in bf16 for
        2560); a host-side rounding keeps the step free of host-to-device copies (CUDA-graph safe)."""
        return _rounded(self.config.embed_scale, self.embed_tokens.weight.dtype)

    def ple_inputs(self, ids, x0, project=None, norm=None):
        """ids [B, T], x0 their scaled embeddings -> ple [B, T, L, ple_dim] (None without PLE); project / norm as
        in embed()."""
        if not self.config.ple_dim:
            return None
        c = self.config
        wt = self.embed_tokens_per_layer.weight
        if self.ple_from_table:  # one opaque op (kernels/gather_rows.py), not inductor's per-layer slices
            from ..kernels.gather_rows import gather_rows

            return gather_rows(wt, ids).unflatten(-1, (c.num_layers, c.ple_dim))
        tok = F.embedding(ids, wt) * _rounded(c.ple_dim ** 0.5, wt.dtype)
        ctx = (project or self.per_layer_model_projection)(x0) * (c.hidden_size ** -0.5)
        ctx = (norm or self.per_layer_projection_norm)(ctx.unflatten(-1, (c.num_layers, c.ple_dim)))
        return (ctx + tok.unflatten(-1, (c.num_layers, c.ple_dim))) * (2.0 ** -0.5)

    @property
    def ple_projected(self) -> bool:
        """The PLE inputs come from the context projection (W_plm and its norm): PLE and no table (ple=project)."""
        return bool(self.config.ple_dim) and not self.ple_from_table

    def use_ple_table(self):
        """From now on embed() gathers the PLE input from embed_tokens_per_layer, whose rows the caller set to each
        id's embed() output (transforms/ple.py); the context projection and its norm are dropped."""
        self.ple_from_table = True
        self.per_layer_model_projection = None
        self.per_layer_projection_norm = None

    def rope(self, pos, dtype):
        return {True: rope_cos_sin(pos, self.inv_freq_sliding, dtype),
                False: rope_cos_sin(pos, self.inv_freq_full, dtype)}

    # ---- prompt chunks and eager decode --------------------------------------------------------
    def forward(self, ids, pos, cache, start: int, need: str = "all", regions=None):
        """ids, pos [B, T] with pos = start .. start+T-1 on every row, or (a padded prompt, start 0,
        Generator.prefill) pads in front at the position after the prompt, which no prompt row sees.
        need="all": hidden [B, T, hidden]; "last": [B, 1, hidden] (the KV-shared layers run on the
        last position only); "none": None (a prompt chunk before the last: the KV-shared layers,
        which write nothing, are skipped). regions: a `PromptRegions` whose pieces run each layer instead of
        layer(...), the same arithmetic (the generator's compile_prefill="layers" passes them compiled);
        None: each layer called as a module (its hooks run), its cache writes and attention the plain pieces."""
        c = self.config
        T = ids.shape[1]
        r = regions or PLAIN
        x, ple, rope = r.inputs(self, ids, pos)
        # the last min(T, ring) rows go to the ring, as `ring` row indices clamped at 0 (a short chunk
        # writes its row 0 several times, the same values): fixed shapes, no branch on T vs ring, so
        # one torch.compile(dynamic=True) graph serves prompts shorter and longer than the ring
        ring_rows = (torch.arange(cache.ring, device=ids.device) + (T - cache.ring)).clamp_min(0)
        ring_row_pos = pos[:, ring_rows]
        ring_slots = ring_row_pos % cache.ring
        full_len = start + T
        arange = torch.arange(full_len, device=ids.device)[None].expand(ids.shape[0], -1)
        window = cache.window
        shared = {}
        bidx = torch.arange(ids.shape[0], device=ids.device)[:, None]
        q_pos = pos

        def layer_rope(layer):
            s = layer.spec
            return rope_q[s.sliding] if not s.stores_kv else rope[s.sliding]

        def attend(layer, a):
            return attend_qkv(layer, *layer.self_attn.project(a, *layer_rope(layer)))

        def attend_qkv(layer, q, k, v):
            s = layer.spec
            if s.stores_kv:
                kc, vc = cache.k[s.index], cache.v[s.index]
                shared[s.sliding] = (r.store_ring(kc, vc, cache.ring_pos, k, v, pos, bidx, ring_rows, ring_slots)
                                     if s.sliding else (*r.store_full(kc, vc, k, v, pos, bidx, full_len), arange))
            k_all, v_all, kv_pos = shared[s.sliding]
            return r.attend(q, k_all, v_all, q_pos, kv_pos, window if s.sliding else full_len + 1, c.attn_scale)

        rope_q = rope
        for i, layer in enumerate(self.layers):
            if i == c.first_shared_layer and need != "all":
                if need == "none":
                    break
                # shared layers write no KV: only the last position matters for the next token
                x, ple, q_pos = x[:, -1:], ple[:, -1:] if ple is not None else None, pos[:, -1:]
                rope_q = {k: (cs[:, -1:], sn[:, -1:]) for k, (cs, sn) in rope.items()}
            p = ple[:, :, i] if ple is not None else None
            if regions is None:
                x = layer(x, p, attend)
            else:
                x = r.finish(layer, x, attend_qkv(layer, *r.qkv(layer, x, *layer_rope(layer))), p)
        cache.ring_pos[bidx, ring_slots] = ring_row_pos.to(torch.int32)
        if need == "none":
            return None
        if need == "last":
            x = x[:, -1:]
        return self.norm(x)

    # ---- the static step (CUDA-graph capturable) -----------------------------------------------
    def step(self, ids, pos, cache):
        """ids, pos [B, T] (T <= cache.step_rows), all on the device. Writes every store layer's
        K/V for these rows, then attends through self.step_attention. Returns hidden [B, T, hidden]."""
        if self.fused_decode is not None and ids.numel() == 1:  # a shape: settled when traced
            return self.fused_decode(self, ids, pos, cache)
        if self.fused_verify is not None:  # wider steps under fuse=layers: GEMM epilogues
            return self.fused_verify(self, ids, pos, cache)
        x, ple = self.embed(ids)
        store_attend = self.step_store_attend(ids, pos, cache)

        def attend(layer, a):
            cos, sin = store_attend.rope[layer.spec.sliding]
            return store_attend(layer, *layer.self_attn.project(a, cos, sin))

        for i, layer in enumerate(self.layers):
            x = layer(x, ple[:, :, i] if ple is not None else None, attend)
        return self.norm(x)

    def step_store_attend(self, ids, pos, cache, pdl: bool = False, merge: bool = False, per_position: bool = False,
                          start=None):
        """Marks the step's ring slots and returns fn(layer, q, k, v) -> [B, T, H*D]: writes the
        layer's K/V for these rows (store layers), then attends through self.step_attention.
        fn.rope: {sliding: (cos, sin)} for these positions; fn.attend(layer, q): the attention alone;
        fn.slots: {sliding: [B, T] cache rows of these positions}. pdl / merge / per_position: the
        attention kernel's launch options (the fused steps' `attn_pdl` / `attn_merge` /
        `batch_invariant`; the twin ignores them). start: (rope, ring slots) already computed, the slots
        already marked (kernels/step_start.py), else computed here."""
        c = self.config
        bidx = torch.arange(ids.shape[0], device=ids.device)[:, None]
        if start is None:
            slots = pos % cache.ring
            cache.ring_pos[bidx, slots] = pos.to(torch.int32)
            rope = self.rope(pos, self.embed_tokens.weight.dtype)
        else:
            rope, slots = start
        attn = self.step_attention
        window = cache.window

        def attend(layer, q):
            s = layer.spec
            src = s.kv_source
            if s.sliding:
                o = attn(q, cache.k[src], cache.v[src], pos, cache.ring_pos, window, c.attn_scale, pdl, merge,
                         per_position)
            else:
                o = attn(q, cache.k[src], cache.v[src], pos, None, 0, c.attn_scale, pdl, merge, per_position)
            return o.flatten(2)

        def store_attend(layer, q, k, v):
            s = layer.spec
            if s.stores_kv:
                idx = slots if s.sliding else pos
                cache.k[s.index][bidx, idx] = k
                cache.v[s.index][bidx, idx] = v
            return attend(layer, q)

        store_attend.rope = rope
        store_attend.attend = attend  # the attention alone, for callers that wrote K/V themselves
        store_attend.slots = {True: slots, False: pos}  # cache row of each step row, by `sliding`
        store_attend.pos = pos  # the rows' positions (the attention's q_pos)
        store_attend.options = dict(pdl=pdl, merge=merge)  # the attention kernel's launch options
        store_attend.scale = c.attn_scale
        return store_attend

    # ---- head ----------------------------------------------------------------------------------
    def compute_logits(self, hidden):
        """hidden [..., hidden] -> fp32 logits [..., V], softcapped (tanh is monotonic: argmax can skip it)."""
        if self.logits_head is not None:
            return self.logits_head(hidden)
        logits = F.linear(hidden, self.embed_tokens.weight).float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
