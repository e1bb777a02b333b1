"""fuse.batch_invariant: every row of a wider step (the verify pass) computed as the one-row step
computes it. Under the interpreter in fp32 the kernels' rows are compared bit for bit: the
attention's per-position row tiles against one-row calls, and the whole verify pass against the AR
steps over the same tokens (dense body: the skinny GEMM at every row count, the PLE path and the
last norm in kernels/residual_norm.py, one head config). On the GPU the same holds in bf16
(`bench.spec --variant ...+inv`: top-1 1.0, max abs diff 0). Refusals: the options it cannot keep
row-invariant."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fastgemma.kernels.decode_attention as da  # conftest.py set TRITON_INTERPRET=1 before this import
from conftest import TINY, Launches
from fastgemma.engine.cache import KVCache
from fastgemma.engine.generator import Generator
from fastgemma.model.config import FULL, SLIDING

SMALL = dataclasses.replace(TINY, num_layers=4, num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * 2)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("ring,S,window,splits,T,first", [
    (True, 40, 24, None, 8, 63), (False, 256, 0, None, 8, 193), (False, 256, 0, 3, 8, 193), (False, 256, 0, 3, 8, 187),
    (False, 256, 0, 5, 8, 186), (False, 256, 50, 3, 8, 189), (False, 256, 0, 3, 3, 190), (False, 256, 0, 7, 1, 101)])
def test_per_position_tiles_equal_one_row_calls(ring, S, window, splits, T, first, merge):
    """T rows at positions first..first+T-1 (their K / V in the cache, as the verify pass writes them
    first): with per_position each row's output is the one-row per_position call's at its position (the
    AR step's under the switch), bit for bit;
    both equal the twin. A tile holds the rows of 4 aligned positions (E4B's 4 heads a KV head), so
    the rows lie in 2 or 3 tiles. Full layer: the split count the one-row launch picks (4 over 256
    slots), and forced ones; from 187 the rows' split boundaries change at 192 (3 splits of 64-key
    blocks); a linear cache with a window; merge: the partials merged in the split kernel, in both."""
    gen = torch.Generator().manual_seed(0)
    B, Hkv, G, D = 1, 2, 4, 64
    last = first + T - 1
    q = torch.randn(B, T, Hkv * G, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen) * D ** -0.25
    v = torch.randn(B, S, Hkv, D, generator=gen)
    q_pos = torch.arange(last - T + 1, last + 1)[None]
    slot_pos = None
    if ring:  # a wrapped ring: slot p % S holds position p for the last S positions
        slot_pos = torch.full((B, S), -1, dtype=torch.int32)
        for p in range(last + 1):
            slot_pos[0, p % S] = p
    rows = da.decode_attention(q, k, v, q_pos, slot_pos, window, num_splits=splits, per_position=True, merge=merge)
    for t in range(T):
        one = da.decode_attention(q[:, t:t + 1], k, v, q_pos[:, t:t + 1], slot_pos, window, num_splits=splits,
                                  per_position=True, merge=merge)
        assert torch.equal(rows[:, t:t + 1], one), t
    ref = da.decode_attention_ref(q, k, v, q_pos, slot_pos, window)
    assert (rows - ref).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="per_position takes q as given or a query-only layer"):
        da._attention(q, q.stride(), (B, T, Hkv * G, D), k, v, q_pos, slot_pos, window, 1.0, None, False, False,
                      {"QKV": 2}, True)


def test_store_layers_per_position_split_like_the_query_layers(monkeypatch):
    """At E4B's shapes (132 multiprocessors, the window-188 ring of 204 slots) the batch-invariant store
    layers' per-position tiles (q as given) are the q/k/v mode's: a sliding layer's 32 keys at 8 warps in 7
    splits, as its KV-shared layers take (`_tiles`' 64 keys in 4 splits: the invariant AR step 26-28 us slower,
    runs MS, MT); a full layer's as before; the ordinary launches keep `_tiles`."""
    import fastgemma.kernels.attention_tiles as at

    monkeypatch.setattr(at, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    for D, S in ((256, 204), (512, 512)):
        store = at._plan((1, 8, 8, D), S, 2, 0, None, True, None, cpu)
        query = at._plan((1, 8, 8, D), S, 2, 1, None, True, None, cpu)
        assert store[1:4] == query[1:4], (D, store, query)
    assert at._plan((1, 8, 8, 256), 204, 2, 0, None, True, None, cpu)[2:4] == ((32, 8, 2), 7)
    assert at._plan((1, 8, 8, 256), 204, 2, 0, None, False, None, cpu)[2] == at._tiles(256, 32)


@pytest.mark.parametrize("ring,S,window,splits,first", [(True, 40, 24, None, 63), (False, 256, 0, 3, 187),
                                                     (False, 256, 0, None, 193)])
def test_query_only_qkv_mode_per_position(ring, S, window, splits, first):
    """A query-only layer's q/k/v mode (q norm + RoPE in the split kernel) with per-position tiles: each
    of 8 rows equals its one-row per-position launch bit for bit (split bounds changing inside the
    rows from 187), and the twin; a store layer's q/k/v mode is refused per position."""
    gen = torch.Generator().manual_seed(1)
    B, Hkv, G, D, T = 1, 2, 4, 64, 8
    H = Hkv * G
    last = first + T - 1
    qkv = torch.randn(B, T, H * D, generator=gen)
    q_w = torch.randn(D, generator=gen) * 0.1
    ang = torch.randn(B, T, 1, D // 2, generator=gen)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    k = torch.randn(B, S, Hkv, D, generator=gen) * D ** -0.25
    v = torch.randn(B, S, Hkv, D, generator=gen)
    q_pos = torch.arange(first, last + 1)[None]
    slot_pos = None
    if ring:
        slot_pos = torch.full((B, S), -1, dtype=torch.int32)
        for p in range(last + 1):
            slot_pos[0, p % S] = p
    kw = dict(heads=H, eps=1e-6, offset=1.0, num_splits=splits)
    rows = da.decode_attention_qkv(qkv, q_w, None, cos, sin, k, v, None, q_pos, slot_pos, window, per_position=True,
                                   **kw)
    for t in range(T):
        one = da.decode_attention_qkv(qkv[:, t:t + 1], q_w, None, cos[:, t:t + 1], sin[:, t:t + 1], k, v, None,
                                      q_pos[:, t:t + 1], slot_pos, window, per_position=True, **kw)
        assert torch.equal(rows[:, t:t + 1], one), t
    ref = da.decode_attention_qkv_ref(qkv, q_w, None, cos, sin, k, v, None, q_pos, slot_pos, window, heads=H,
                                      eps=1e-6, offset=1.0)
    assert (rows - ref).abs().max().item() < 1e-4
    qkv_store = torch.randn(B, T, (H + 2 * Hkv) * D, generator=gen)
    with pytest.raises(ValueError, match="per_position takes q as given or a query-only layer"):
        da.decode_attention_qkv(qkv_store, q_w, q_w, cos, sin, k.clone(), v.clone(), q_pos, q_pos, None, 0,
                                per_position=True, **kw)


def test_every_e4b_int4_shape_has_a_one_row_config():
    """On E4B every int4 linear of the step and the embedding's PLE projection has a tensor-core config
    that the switch uses at 1 to 8 rows (INVARIANT_CONFIGS', else the one-row entry), and none past the
    kernel's 8 rows."""
    from fastgemma.kernels.fused_w4a16 import E4B_CASES
    from fastgemma.kernels.mma_table import INVARIANT_CONFIGS, MMA_CONFIGS, mma_config

    assert {"q full", "W_plm"} <= set(E4B_CASES)
    for name, (N, K, mode) in E4B_CASES.items():
        epi = "geglu" if mode == "geglu" else "none"
        one = mma_config(N, K, 1, epi, invariant=True)
        assert one is not None and all(mma_config(N, K, m, epi, invariant=True) == one for m in range(2, 9)), name
        assert one == INVARIANT_CONFIGS.get((N, K), MMA_CONFIGS.get((N, K, False))), name
        assert mma_config(N, K, 9, epi, invariant=True) is None
    assert mma_config(10752, 2560, 1) is None  # the default path keeps W_plm off the tensor-core kernel


def _invariant_model(seed=4, attn_qkv=False, attn_merge=False):
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.weights.synthetic import synthetic_model

    model = synthetic_model(SMALL, "cpu", torch.float32, seed=seed)
    model.step_attention = da.decode_attention_op
    t = FuseLayers(backend="triton", qkv_kernel=True, batch_invariant=True, attn_qkv=attn_qkv, attn_merge=attn_merge)
    t.apply(model)
    t.validate(model)
    return model, t


@pytest.mark.parametrize("attn_qkv,attn_merge", [(False, False), (True, False), (True, True)])
def test_verify_rows_equal_the_one_row_steps(wide_tiles, attn_qkv, attn_merge, monkeypatch):
    """fp32, dense body, the Triton kernels in the interpreter: the hidden state of every row of a
    5-row step equals, bit for bit, the one-row step's at that position after the same tokens
    (context past the window: the ring wraps), and the head's logits of those rows too; the step
    still computes the ordinary step's function. attn_qkv: the KV-shared layers' q norm + RoPE in the
    attention's split kernel (per-position tiles) in both steps; attn_merge: the splits merged in the
    split kernel where a tile's partials are few (no combine launch left in this model) in both."""
    from fastgemma.transforms.sampler import FusedArgmax

    model, t = _invariant_model(attn_qkv=attn_qkv, attn_merge=attn_merge)
    assert t.describe()["batch_invariant"] and model.batch_invariant
    combines = Launches(da._combine_kernel)  # the attention combine's launches
    monkeypatch.setattr(da, "_combine_kernel", combines)
    prompt, toks = torch.tensor([list(range(5, 27))]), torch.tensor([[40, 41, 42, 43, 44]])
    caches = [KVCache(SMALL, 1, 64, dtype=torch.float32) for _ in range(3)]
    for c in caches:
        Generator(model, c, prefill_chunk=32).prefill(prompt)
    P = prompt.shape[1]
    combines.n = 0
    wide = model.step(toks, torch.arange(P, P + 5)[None], caches[0])  # [1, 5, H]
    if attn_qkv:  # the tiny model's one split layer: its combine, or none where the splits merge
        assert (combines.n == 0) == attn_merge, combines.n
    one = torch.cat([model.step(toks[:, i:i + 1], torch.tensor([[P + i]]), caches[1]) for i in range(5)], 1)
    assert torch.equal(wide, one)
    sampler = FusedArgmax("triton")
    ids_w, logits_w = sampler(model, wide.reshape(5, 1, -1))
    logits_w = logits_w.clone()
    for i in range(5):
        ids_1, logits_1 = sampler(model, one[:, i:i + 1])
        assert torch.equal(logits_1[0], logits_w[i]) and ids_1.item() == ids_w[i].item()
    model.fused_decode = model.fused_verify = None  # the ordinary step, same weights
    ref = model.step(toks, torch.arange(P, P + 5)[None], caches[2])
    assert (wide - ref).abs().max().item() < 1e-4


def test_invariant_step_on_the_twins_equals_the_ordinary_step():
    """The torch backend (the twins of every kernel the switch adds) keeps the step's function."""
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.weights.synthetic import synthetic_model

    model = synthetic_model(SMALL, "cpu", torch.float32, seed=4)
    model.step_attention = decode_attention_ref
    prompt, toks = torch.tensor([list(range(5, 27))]), torch.tensor([[40, 41, 42]])
    caches = [KVCache(SMALL, 1, 64, dtype=torch.float32) for _ in range(2)]
    for c in caches:
        Generator(model, c, prefill_chunk=32).prefill(prompt)
    P = prompt.shape[1]
    ref = model.step(toks, torch.arange(P, P + 3)[None], caches[0])
    FuseLayers(backend="torch", qkv_kernel=True, batch_invariant=True).apply(model)
    rows = torch.cat([model.step(toks[:, i:i + 1], torch.tensor([[P + i]]), caches[1]) for i in range(3)], 1)
    assert (rows - ref).abs().max().item() < 1e-4


def test_refusals():
    """Options the switch cannot keep row-invariant are refused in one line: no qkv_kernel, int4
    linears off the tensor-core kernel, an int4 head (the unfused argmax sampler: the builder's test
    below); attn_qkv (a step's own rows in a split of their own) then serves the drafter alone."""
    from fastgemma.model.drafter import synthetic_drafter
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.lm_head import Int4Head
    from fastgemma.transforms.quant import Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    with pytest.raises(ValueError, match="needs fuse.qkv_kernel=true"):
        FuseLayers(batch_invariant=True)
    model = synthetic_model(SMALL, "cpu", torch.float32, seed=4)
    FuseLayers(qkv_kernel=True, attn_qkv=True, batch_invariant=True).apply(model)
    assert model.fused_decode.keywords["attn_qkv"] is False and model.fused_verify.keywords["attn_qkv"] is False
    drafter = model.fuse_drafter(synthetic_drafter(SMALL, dtype=torch.float32, seed=0))
    assert drafter.fused_forward.keywords["attn_qkv"] is True
    model = synthetic_model(SMALL, "cpu", torch.float32, seed=4)
    t = FuseLayers(backend="triton", qkv_kernel=True, batch_invariant=True)
    t.apply(model)
    Int4Quant(group_size=32, skip=("per_layer_projection",), backend="torch").apply(model)
    with pytest.raises(ValueError, match="one-row configs .*none for layers.0.in"):
        t.validate(model)
    model = synthetic_model(SMALL, "cpu", torch.float32, seed=4)
    t.apply(model)
    Int4Head(group_size=32, backend="torch").apply(model)
    with pytest.raises(ValueError, match="an int4 head"):
        t.validate(model)


def test_builder_runs_it_and_needs_the_fused_argmax():
    """Through the real config: fuse.batch_invariant on the twins decodes the plain eager tokens;
    with sampler=argmax (full logits through F.linear) the build is refused in one line."""
    from fgcli_helpers import TINY as CLI_TINY
    from fgcli_helpers import compose_cfg
    from hydra.core.hydra_config import HydraConfig

    from fastgemma.build import BuildError, build_context
    from fastgemma.engine.steps import EagerStep

    def ctx_for(*over):
        cfg = compose_cfg([*CLI_TINY, "graphs=static", "fuse=layers", "fuse.backend=torch", "fuse.qkv_kernel=true",
                           "fuse.batch_invariant=true", *over])
        HydraConfig.instance().set_config(cfg)
        return build_context(cfg, dict(cfg.hydra.runtime.choices), "/tmp")

    ctx = ctx_for("sampler=fused_argmax", "sampler.backend=torch")
    prompt = list(range(7, 27))
    out = ctx.factory.engine(64).generator.generate(prompt, 6)
    m = ctx.factory.model
    assert m.batch_invariant and ctx.factory.parts.fuse.describe()["batch_invariant"]
    cache = KVCache(m.config, 1, 64, dtype=m.embed_tokens.weight.dtype)
    assert out.tokens == Generator(m, cache, EagerStep(m, cache)).generate(prompt, 6).tokens
    with pytest.raises(BuildError, match="batch_invariant needs sampler=fused_argmax"):
        ctx_for("sampler=argmax").factory.model


def test_verify_rows_limit_refuses_a_deeper_speculation(monkeypatch):
    """Under fuse.batch_invariant the int4 linears run one tensor-core config at every row count, at most the
    kernel's 8 rows: FuseLayers records that limit once a linear holds the kernel's copy, and the speculative
    generator refuses depth 8 (9 verify rows) in one line before any drafter is built or graph captured,
    instead of failing while tracing the verify pass. Without int4 linears on the kernel there is no limit."""
    from fastgemma.engine.generator import GenerationError
    from fastgemma.engine.speculative import SpecGenerator
    from fastgemma.kernels.mma_table import MAX_ROWS, MMA_CONFIGS, MmaConfig, set_table
    from fastgemma.transforms import fuse_layers
    from fastgemma.transforms.quant import Int4Linear

    target, _ = _invariant_model()  # dense body: no int4 linear, no limit
    assert target.max_verify_rows is None
    lin = Int4Linear.from_linear(torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16), 64, backend="torch")
    layer = torch.nn.Linear(2, 2)
    model = torch.nn.Linear(2, 2)  # a CPU module holding one int4 linear in one layer, no PLE projection
    model.layers, model.ple_projected = [layer], False
    monkeypatch.setattr(fuse_layers, "_layer_linears", lambda i, layer: {"in": lin})
    saved = dict(MMA_CONFIGS)
    try:
        set_table({**saved, (64, 128, False): MmaConfig(1, 1), (64, 128): MmaConfig(1, 1)})  # the small shape
        fuse_layers.FuseLayers(backend="triton", int4_mma=True)._enable_mma(model)
        assert lin.mma and model.max_verify_rows is None  # the default path: each row count its own config
        fuse_layers.FuseLayers(backend="triton", int4_mma=True, qkv_kernel=True,
                               batch_invariant=True)._enable_mma(model)
        assert model.max_verify_rows == MAX_ROWS == 8
    finally:
        set_table(saved)
    target.max_verify_rows = MAX_ROWS  # as on the GPU, where the int4 body's linears hold the kernel's copy
    cache = KVCache(SMALL, 1, 64, dtype=torch.float32)
    with pytest.raises(GenerationError, match=r"depth 8: .*at most 8 rows, so depth <= 7"):
        SpecGenerator(target, cache, drafter=None, depth=8)
    assert SpecGenerator(target, cache, drafter=None, depth=7).k == 7


def test_auto_follows_the_speculation_and_the_body(caplog):
    """fuse.batch_invariant=auto (the group's default) turns the switch on only where speculative decoding
    verifies on the int4 tensor-core body (the measured recipe: `experiment=frontier spec=replay
    spec.depth=7`), turning the fold and the start kernel off with it, and leaves it off with a logged reason
    otherwise: plain AR, a depth past the kernel's rows, another body or sampler, an int4 head, the twins. An
    explicit true / false is kept; another word is refused in one line."""
    import logging

    from fgcli_helpers import TINY as CLI_TINY
    from fgcli_helpers import compose_cfg

    from fastgemma.build import BuildError, build_parts

    def fuse_for(*over):
        cfg = compose_cfg([*CLI_TINY, "experiment=frontier", *over])
        return build_parts(cfg, dict(cfg.hydra.runtime.choices)).fuse

    with caplog.at_level(logging.INFO, logger="fastgemma.transforms.fuse_layers"):
        on = fuse_for("spec=replay", "spec.depth=7")
    assert on.auto_invariant and on.batch_invariant and on._auto_pending  # the model confirms it (test below)
    assert not (on.norm_fold or on.attn_fold or on.start_kernel) and on.describe()["batch_invariant_auto"]
    assert "fuse.batch_invariant=auto" not in caplog.text  # said once the model confirms it
    assert fuse_for("spec=mtp", "spec.depth=1").batch_invariant
    assert fuse_for("spec=replay", "quant=bf16")._auto_pending  # a checkpoint may hold the int4 body
    for over, why in [((), "no speculative decoding"), (("spec=mtp", "spec.depth=8"), "9 verify rows"),
                      (("spec=replay", "quant=int8"), "measured on the int4 body"),
                      (("spec=replay", "fuse.int4_mma=false", "fuse.norm_fold=false", "fuse.attn_fold=false"),
                       "measured on the int4 body"),
                      (("spec=replay", "sampler=argmax"), "sampler=fused_argmax"),
                      (("spec=replay", "lm_head=int4", "~lm_head.dtype", "~lm_head.source"), "an int4 head"),
                      (("spec=replay", "fuse.backend=torch"), "the twins")]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fastgemma.transforms.fuse_layers"):
            off = fuse_for(*over)
        assert not (off.batch_invariant or off._auto_pending) and off.start_kernel, over
        assert off.norm_fold == off.int4_mma, over
        assert "fuse.batch_invariant=auto: off (" in caplog.text and why in caplog.text, (over, caplog.text)
    kept = fuse_for("spec=replay", "fuse.batch_invariant=false")
    assert not kept.batch_invariant and not kept.auto_invariant and kept.norm_fold
    assert fuse_for("fuse.batch_invariant=true").batch_invariant  # AR too, as asked
    with pytest.raises(BuildError, match="fuse.batch_invariant is true, false or auto, got 'maybe'"):
        fuse_for("fuse.batch_invariant=maybe")


def test_auto_is_confirmed_by_the_model(caplog):
    """Where the groups leave fuse.batch_invariant=auto on, the built model decides (`FuseLayers.validate`): on, with
    the steps installed so and its log lines, where every int4 linear of the body has a one-row tensor-core config
    (quantized here, or loaded in int4 under quant=bf16); off again, the steps installed without it and the folds
    back, where the body has no int4 linear on the kernel (bf16) or one lacks a config (another model's shapes, a
    group size the kernel does not take), instead of the build failing as the explicit switch does."""
    import logging

    from fgcli_helpers import TINY as CLI_TINY
    from fgcli_helpers import compose_cfg

    from fastgemma.build import build_parts
    from fastgemma.kernels import mma_table
    from fastgemma.kernels.mma_table import MmaConfig, set_table
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.fused_layer_ops import _layer_linears
    from fastgemma.transforms.quant import Int4Linear, Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    SKIP = ("per_layer_projection", "per_layer_input_gate")  # K = 16 in the tiny model; quant=int4's own

    def int4_body(group_size=64):
        model = synthetic_model(SMALL, "cpu", torch.bfloat16, seed=3)
        Int4Quant(group_size=group_size, skip=SKIP, backend="torch").apply(model)
        return model

    def built(group_size, *over, table="all", loaded=False):
        """(the fuse object, the model) after fuse, quant and validate, as the build runs them. group_size: the
        int4 body's (None: bf16); loaded: its layers int4 before fuse applies (a checkpoint's); table: the int4
        shapes given a one-row entry ("all": every one the body holds)."""
        cfg = compose_cfg([*CLI_TINY, "experiment=frontier", "spec=replay", "spec.depth=3", *over])
        fuse = build_parts(cfg, dict(cfg.hydra.runtime.choices)).fuse
        model = int4_body(group_size) if loaded else synthetic_model(SMALL, "cpu", torch.bfloat16, seed=3)
        model = fuse.apply(model) or model
        if group_size and not loaded:
            Int4Quant(group_size=group_size, skip=SKIP, backend="torch").apply(model)
        gate_up = {id(_layer_linears(i, layer)["gate_up"]) for i, layer in enumerate(model.layers)}
        entries = {(m.out_features, m.in_features): MmaConfig(2 if id(m) in gate_up else 1, 1)
                   for m in model.modules() if isinstance(m, Int4Linear)}
        set_table({**saved, **{k: c for k, c in entries.items() if table == "all" or k in table}})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fastgemma.transforms.fuse_layers"):
            fuse.validate(model)
        return fuse, model

    saved = dict(mma_table.MMA_CONFIGS)
    try:
        fuse, model = built(64)
        assert fuse.batch_invariant and model.batch_invariant and not fuse._auto_pending
        assert model.fused_decode.keywords["batch_invariant"] and not model.fused_decode.keywords["norm_fold"]
        assert model.max_verify_rows == 8 and "fuse.batch_invariant=auto: on (speculative depth 3" in caplog.text
        assert "norm_fold is off" in caplog.text
        assert not any(r.levelno >= logging.WARNING and "batch_invariant" in r.getMessage() for r in caplog.records)
        fuse, model = built(64, "quant=bf16", loaded=True)  # a checkpoint's int4 layers under quant=bf16: the same
        assert fuse.batch_invariant and model.fused_verify.keywords["batch_invariant"]

        down = (SMALL.hidden_size, SMALL.intermediate_size)
        for group_size, over, table, why in [
                (None, ("quant=bf16",), "all", "the body has no int4 linear on the tensor-core kernel"),
                (64, (), (), "the body has no int4 linear"),  # shapes outside the table (another model's)
                (32, (), "all", "the body has no int4 linear"),  # a group size the kernel does not take
                (64, (), (down,), "one-row configs (fuse.int4_mma=true, kernels/mma_table.MMA_CONFIGS); none for")]:
            fuse, model = built(group_size, *over, table=table)
            assert not (fuse.batch_invariant or model.batch_invariant or fuse._auto_pending), why
            assert "fuse.batch_invariant=auto: off (" in caplog.text and why in caplog.text, (why, caplog.text)
            dec = model.fused_decode.keywords
            assert not dec["batch_invariant"] and dec["norm_fold"] and dec["start_kernel"] and dec["attn_fold"]
            assert not model.fused_verify.keywords["batch_invariant"] and model.max_verify_rows is None
        # the copies made for the switch's one-row configs (down's here) are dropped with it
        assert not any(m.mma for m in model.modules() if isinstance(m, Int4Linear))

        explicit = FuseLayers(backend="triton", qkv_kernel=True, int4_mma=True, batch_invariant=True)
        model = synthetic_model(SMALL, "cpu", torch.bfloat16, seed=3)
        explicit.apply(model)
        Int4Quant(group_size=64, skip=SKIP, backend="torch").apply(model)
        set_table(saved)
        with pytest.raises(ValueError, match="one-row configs"):  # the explicit switch is refused, as before
            explicit.validate(model)
    finally:
        set_table(saved)
