"""Fused one-row GEMV (norm / residual prologues, GeGLU / PLE-gate epilogues) against its torch
twin under the CPU interpreter, and the fused decode step (fuse=layers) against the ordinary one."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses
import functools

import pytest
import torch

from fastgemma.kernels.fused_gemv import fused_gemv, fused_gemv_op, fused_gemv_ref
from fastgemma.kernels.gemv import GemvConfig

CASES = {  # name: (kwargs builder, epilogue)
    "plain": (lambda t: {}, "none"),
    "input_norm": (lambda t: dict(pre=t["pre"]), "none"),
    "residual_scale_norm": (lambda t: dict(y=t["y"], post=t["post"], scale=t["scale"], pre=t["pre"]), "none"),
    "residual_no_norm": (lambda t: dict(y=t["y"], post=t["post"]), "none"),
    "ple_gate": (lambda t: dict(y=t["y"], post=t["post"], aux=t["aux"]), "gelu_mul"),
    "geglu": (lambda t: dict(y=t["y"], post=t["post"], pre=t["pre"]), "geglu"),
    "geglu_plain": (lambda t: {}, "geglu"),
}


def _tensors(N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dtype)  # noqa: E731
    w_big = r(N, K + 24, sc=K ** -0.5)
    return dict(a=r(K), y=r(K, sc=3.0), post=(torch.rand(K, generator=g) + 0.5).to(dtype),
                pre=(torch.rand(K, generator=g) + 0.5).to(dtype), scale=torch.tensor([0.75]).to(dtype),
                aux=r(N), w=w_big[:, :K])  # w: row stride K + 24


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("N,K,cfg", [
    (38, 300, GemvConfig(4, 64, 2)),   # K tail (300 = 4 x 64 + 44); N and N/2 not multiples of the tile
    (64, 128, GemvConfig(1, 128, 1)),  # one K block; geglu bumps BLOCK_N 1 -> 2
    (22, 1024, GemvConfig(8, 64, 4)),  # 16 K blocks: every prefetch register slot
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_gemv_matches_twin(case, N, K, cfg, dtype):
    """16-bit rounding points are checked in fp16: the interpreter truncates fp32 -> bf16 casts
    (a GPU rounds to nearest even), while numpy rounds fp16 to nearest like the GPU."""
    t = _tensors(N, K, dtype)
    build, epi = CASES[case]
    kw = dict(build(t), eps=1e-6, epilogue=epi)
    out, h = fused_gemv(t["a"], t["w"], config=cfg, **kw)
    ref, href = fused_gemv_ref(t["a"], t["w"], **kw)
    assert out.dtype == dtype and out.shape == ref.shape == (1, N // 2 if epi == "geglu" else N)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp16: a rounding flip of an intermediate
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < tol
    if "y" in kw:
        assert h.shape == (1, K)
        assert ((h.float() - href.float()).abs().max() / href.float().abs().max()).item() < tol
        if dtype == torch.float32:
            assert torch.allclose(h, href, atol=1e-6)
    else:
        assert h is None and href is None


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("words", [False, True])
def test_fused_w4a16_matches_twin(case, group, dtype, words):
    """The int4 kernel (factored GEMV, byte and word loops) against dequantize + the dense twin;
    N = 38 (and 19 GeGLU pairs) not a multiple of the tile, K = 512 in blocks of 256: two unrolled
    blocks. fp16 takes the word loop's inexact pair (the GPU's arithmetic), fp32 its exact one."""
    from fastgemma.kernels.fused_w4a16 import fused_w4a16, fused_w4a16_ref
    from fastgemma.kernels.int4_pack import pack_int4, quantize_int4
    from fastgemma.kernels.w4a16_table import W4A16Config

    N, K = 38, 512
    t = _tensors(N, K, dtype, seed=4)
    q, sc, zr = quantize_int4(t["w"].float(), group)
    qw, sc, zr = pack_int4(q), sc.to(dtype), zr.to(dtype)
    build, epi = CASES[case]
    kw = dict(build(t), eps=1e-6, epilogue=epi)
    out, h = fused_w4a16(t["a"], qw, sc, zr, group, config=W4A16Config(4, 256, 1, 2, words=words), **kw)
    ref, href = fused_w4a16_ref(t["a"], qw, sc, zr, group, **kw)
    assert out.shape == ref.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < tol
    if "y" in kw:
        assert ((h.float() - href.float()).abs().max() / href.float().abs().max()).item() < tol


def test_default_tiles_fit_a_long_k():
    """A shape outside the tile tables with K past 16 default blocks of 512 (E2B's down: K = 12,288) gets wider K
    blocks instead of a refusal: the int4 fused GEMV (the geglu-free residual prologue, against its twin) and the
    dense GEMV's default config; a config given by hand is still refused."""
    from fastgemma.kernels.fused_w4a16 import fused_w4a16, fused_w4a16_ref
    from fastgemma.kernels.gemv import MAX_KB, default_config
    from fastgemma.kernels.int4_pack import pack_int4, quantize_int4
    from fastgemma.kernels.w4a16_table import W4A16Config

    N, K = 16, 12288
    t = _tensors(N, K, torch.float32, seed=6)
    q, sc, zr = quantize_int4(t["w"].float(), 128)
    qw = pack_int4(q)
    kw = dict(y=t["y"], post=t["post"], pre=t["pre"], eps=1e-6)
    out, h = fused_w4a16(t["a"], qw, sc, zr, 128, **kw)
    ref, href = fused_w4a16_ref(t["a"], qw, sc, zr, 128, **kw)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5 and torch.allclose(h, href, atol=1e-6)
    with pytest.raises(ValueError, match="unrolls at most 16 K blocks; K=12288 needs block_k >= 768"):
        fused_w4a16(t["a"], qw, sc, zr, 128, config=W4A16Config(4, 512, 1, 2), **kw)
    assert all(-(-k // default_config(1536, k).block_k) <= MAX_KB for k in (2560, 10240, 12288, 24576))
    assert default_config(1536, 2560).block_k == 512 and default_config(1536, 12288).block_k == 1024


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("words", [True, False])
def test_fused_w8a16_matches_twin(case, dtype, words):
    """The int8 kernel (codes as int32 words or bytes and row scales loaded before the wait, F.linear on the
    codes, then the scale) against the dense twin's prologue / epilogue around kernels/w8a16.py's twin; N = 38
    (19 GeGLU pairs) not a multiple of the tile, K = 300: a masked tail block. The op passes torch's schema
    and fake checks."""
    from fastgemma.kernels.fused_w8a16 import fused_w8a16, fused_w8a16_op, fused_w8a16_ref
    from fastgemma.kernels.w8a16 import quantize_int8_rows

    N, K = 38, 300
    t = _tensors(N, K, dtype, seed=5)
    q, s = quantize_int8_rows(t["w"])
    build, epi = CASES[case]
    kw = dict(build(t), eps=1e-6, epilogue=epi)
    out, h = fused_w8a16(t["a"], q, s, config=GemvConfig(4, 64, 2), words=words, **kw)
    ref, href = fused_w8a16_ref(t["a"], q, s, **kw)
    assert out.dtype == dtype and out.shape == ref.shape == (1, N // 2 if epi == "geglu" else N)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < tol
    if "y" in kw:
        assert ((h.float() - href.float()).abs().max() / href.float().abs().max()).item() < tol
    else:
        assert h is None and href is None
    if case == "residual_scale_norm" and words:
        # K = 302: rows not 4-byte aligned, so the bytes even where words are asked for
        t2 = _tensors(N, 302, dtype, seed=6)
        q2, s2 = quantize_int8_rows(t2["w"])
        kw2 = dict(build(t2), eps=1e-6, epilogue=epi)
        o2 = fused_w8a16(t2["a"], q2, s2, config=GemvConfig(4, 64, 2), **kw2)[0]
        r2 = fused_w8a16_ref(t2["a"], q2, s2, **kw2)[0]
        assert ((o2.float() - r2.float()).abs().max() / r2.float().abs().max()).item() < tol
        args = (t["a"], q, s, t["y"], t["post"], t["scale"], t["pre"], None, 1e-6, 0.0, "none", False)
        torch.library.opcheck(fused_w8a16_op, args, test_utils=("test_schema", "test_faketensor"))
        with pytest.raises(ValueError, match="streamed config"):
            fused_w8a16(t["a"], q, s, config=GemvConfig(4, 64, 2, per_sm=2, depth=4), **kw)
        with pytest.raises(ValueError, match="must be int8"):
            fused_w8a16(t["a"], t["w"], s, **kw)


def test_fused_gemv_gemma3_offset_and_op():
    t = _tensors(16, 96, torch.float32, seed=3)
    kw = dict(eps=1e-6, offset=1.0, epilogue="none")
    out, h = fused_gemv(t["a"], t["w"], t["y"], t["post"], None, t["pre"], config=GemvConfig(4, 32, 1), **kw)
    ref, href = fused_gemv_ref(t["a"], t["w"], t["y"], t["post"], None, t["pre"], **kw)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(h, href, atol=1e-6)
    o2, h2 = fused_gemv_op(t["a"], t["w"].contiguous(), None, None, None, t["pre"], None, 1e-6, 0.0, "none", False)
    r2, _ = fused_gemv_ref(t["a"], t["w"], pre=t["pre"], eps=1e-6)
    assert torch.allclose(o2, r2, atol=1e-5) and h2.numel() == 0


def test_fused_table_tiles_are_the_launch_config(monkeypatch):
    """FUSED_CONFIGS' entry for (N, K, prologue, epilogue) is the launch's config where the table applies
    (sm_90, or a table set by bench.stack --fused-table), with the same outputs as the default tiles;
    elsewhere (this CPU) the shipped table is not read."""
    import fastgemma.kernels.fused_gemv as fg

    seen = []
    real = fg.resolve_config
    monkeypatch.setattr(fg, "resolve_config", lambda N, K, config=None: seen.append(config) or real(N, K, config))
    t = _tensors(48, 96, torch.float32)
    kw = dict(y=t["y"], post=t["post"], pre=t["pre"], eps=1e-6)
    base = fused_gemv(t["a"], t["w"], **kw)
    assert seen[-1] is None
    cfg = GemvConfig(4, 32, 2)
    monkeypatch.setitem(fg.FUSED_CONFIGS, (48, 96, True, "none"), cfg)
    fused_gemv(t["a"], t["w"], **kw)
    assert seen[-1] is None  # the shipped table: sm_90 only
    monkeypatch.setattr(fg, "_FORCED", [True])
    out = fused_gemv(t["a"], t["w"], **kw)
    assert seen[-1] == cfg
    fused_gemv(t["a"], t["w"], eps=1e-6)  # no prologue: another key, no entry
    assert seen[-1] is None
    for got, want in zip(out, base):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_gemv_bad_inputs():
    t = _tensors(9, 64, torch.float32)
    with pytest.raises(ValueError, match="epilogue must be one of"):
        fused_gemv(t["a"], t["w"], eps=1e-6, epilogue="silu")
    with pytest.raises(ValueError, match="even row count"):
        fused_gemv(t["a"], t["w"], eps=1e-6, epilogue="geglu")
    with pytest.raises(ValueError, match="gelu_mul needs aux"):
        fused_gemv(t["a"], t["w"], eps=1e-6, epilogue="gelu_mul")
    with pytest.raises(ValueError, match="y and post come together"):
        fused_gemv(t["a"], t["w"], t["y"], eps=1e-6)
    with pytest.raises(ValueError, match="one row"):
        fused_gemv(t["a"][:32], t["w"], eps=1e-6)
    with pytest.raises(ValueError, match="scale is one value"):
        fused_gemv(t["a"], t["w"], scale=t["scale"], eps=1e-6)


# ---- the fused decode step -------------------------------------------------------------------

def _decode(model, cfg, prompt, new):
    from fastgemma.engine.cache import KVCache
    from fastgemma.engine.generator import Generator
    from fastgemma.engine.steps import StaticStep

    cache = KVCache(cfg, 1, 64, device="cpu", dtype=torch.float32)
    gen = Generator(model, cache, StaticStep(model, cache))
    out = gen.generate(prompt, new)
    return out.tokens, gen.step.last_logits.clone()


@pytest.mark.parametrize("family,quant", [("gemma4", "bf16"), ("gemma3", "bf16"), ("gemma4", "int4"),
                                          ("gemma4", "int8")])
def test_fuse_layers_step_equals_ordinary_step(family, quant, monkeypatch):
    """fp32 on the tiny model (sliding and full layers, KV sharing, PLE; a Gemma 3 variant without
    PLE, with the +1 norm offset): the fused step (twins, then the Triton kernels under the
    interpreter, then with tail_norm) gives the ordinary step's tokens and logits over 3 new tokens, with dense,
    int4 and int8 linears. The window (16) is shorter than the context, so ring-buffer slots wrap."""
    import fastgemma.kernels.gemv as gemv_mod
    import fastgemma.kernels.w4a16_table as w4a16_table
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.weights.synthetic import synthetic_model

    cfg = GEMMA4_TINY if family == "gemma4" else dataclasses.replace(
        GEMMA4_TINY, name="gemma3_tiny", family="gemma3", ple_dim=0, num_kv_shared_layers=0, norm_offset=1.0,
        v_norm=False, layer_scalar=False, attn_scale=32 ** -0.5)
    prompt = list(range(5, 25))
    model = synthetic_model(cfg, "cpu", torch.float32, seed=1)
    model.step_attention = decode_attention_ref
    t = FuseLayers(backend="torch")
    if quant != "bf16":  # fuse (merge) first, then quantise, as the builder orders them
        from fastgemma.transforms.quant import Int4Quant
        from fastgemma.transforms.quant_int8 import Int8Quant

        t.apply(model)
        fused = model.fused_decode, model.fused_verify
        model.fused_decode = model.fused_verify = None
        # int4: the PLE projection (K=16) stays dense; int8 takes every linear
        (Int4Quant(group_size=32, skip=("per_layer_projection",), backend="torch") if quant == "int4"
         else Int8Quant(backend="torch")).apply(model)
        t.validate(model)
        ref_tokens, ref_logits = _decode(model, cfg, prompt, 3)
        model.fused_decode, model.fused_verify = fused
    else:
        ref_tokens, ref_logits = _decode(model, cfg, prompt, 3)
        t.apply(model)
    assert model.fused_decode is not None and t.describe()["fused_layers"]
    tokens, logits = _decode(model, cfg, prompt, 3)
    assert tokens == ref_tokens and torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # wide tiles: a handful of programs per launch keeps the interpreter fast
    monkeypatch.setattr(gemv_mod, "default_config", lambda N, K: GemvConfig(64, 64, 4))
    monkeypatch.setattr(w4a16_table, "default_config", lambda M, N, K: w4a16_table.W4A16Config(64, 64, 1, 4))
    FuseLayers(backend="triton").apply(model)  # already merged: merging again is a no-op
    tokens, logits = _decode(model, cfg, prompt, 3)
    assert tokens == ref_tokens and torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # fuse.tail_norm: the last update and the final norm in kernels/residual_norm.py (kept on below)
    model.fused_decode = functools.partial(model.fused_decode, tail_norm=True)
    tokens, logits = _decode(model, cfg, prompt, 3)
    assert tokens == ref_tokens and torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    if quant == "bf16":  # q/k/v norms, RoPE and the cache writes in kernels/qkv_finish.py (Gemma 3: no v norm)
        model.fused_decode = functools.partial(model.fused_decode, qkv_kernel=True)
        tokens, logits = _decode(model, cfg, prompt, 3)
        assert tokens == ref_tokens and torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
        # + the attention kernel itself, 3 splits whose partials the split kernel merges (attn_merge),
        # and the attention's PDL option
        import fastgemma.kernels.attention_tiles as at
        import fastgemma.kernels.decode_attention as da

        monkeypatch.setattr(at, "pick_num_splits", lambda *a: 3)
        model.step_attention = da.decode_attention_op
        model.fused_decode = functools.partial(model.fused_decode, attn_merge=True, attn_pdl=True)
        tokens, logits = _decode(model, cfg, prompt, 3)
        assert tokens == ref_tokens and torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
        if family == "gemma4":  # q/k/v norms, RoPE and the cache writes inside the attention's split kernel
            # (its q/k/v mode; Gemma 3's layers without a v norm: tests/test_attention_qkv.py)
            model.fused_decode = functools.partial(model.fused_decode, qkv_kernel=False, attn_qkv=True)
            tokens, logits = _decode(model, cfg, prompt, 3)
            assert tokens == ref_tokens and torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
            # fuse.attn_tiles: each layer kind's launches take that kind's tiles (and split count, early block),
            # same tokens
            tiles = at.parse_qkv_tiles("full_store:16x2s1,full_query:32x2s2,sliding_store:32x4s1p2e1,"
                                       "sliding_query:16x4s2e0")
            seen, real = set(), da.decode_attention_qkv

            def spy(qkv, q_w, k_w, *args, **kw):
                seen.add(("store" if k_w is not None else "query", args[-1] > 0, kw["tiles"], kw["num_splits"],
                          kw["early"]))
                return real(qkv, q_w, k_w, *args, **kw)

            monkeypatch.setattr(da, "decode_attention_qkv", spy)
            model.fused_decode = functools.partial(model.fused_decode, attn_tiles=tiles)
            tokens, logits = _decode(model, cfg, prompt, 3)
            assert tokens == ref_tokens and torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
            assert seen == {("store", False, (16, 2, 1), None, None), ("query", False, (32, 2, 2), None, None),
                            ("store", True, (32, 4, 1), 2, True), ("query", True, (16, 4, 2), None, False)}, seen


@pytest.mark.parametrize("quant", ["bf16", "int4", "int8"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_verify_step_equals_the_ordinary_step(quant, backend, monkeypatch):
    """fuse=layers' wider step (5 rows: a verify pass) with GeGLU and the PLE gate's gelu * input in
    GEMM stores (the int4 per-group kernel, the dense rows GEMV; int8: its own matmul, then the
    epilogue; twins, then the Triton kernels under the interpreter) gives the ordinary step's hidden
    states and cache writes, fp32."""
    from fastgemma.engine.cache import KVCache
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.quant import Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    import fastgemma.kernels.rows_gemv as rows_mod
    import fastgemma.kernels.skinny_gemm as skinny_mod
    import fastgemma.kernels.w4a16_table as w4a16_table

    # wide tiles: a handful of programs per launch keeps the interpreter fast
    monkeypatch.setattr(w4a16_table, "default_config", lambda M, N, K: w4a16_table._grp(64, 1, 4))
    monkeypatch.setattr(skinny_mod, "default_config", lambda N, K: skinny_mod.SkinnyConfig(64, 64, 1, 4))
    monkeypatch.setattr(rows_mod, "DEFAULT_CONFIG", rows_mod.GemvConfig(64, 128, 4))
    model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=2)
    model.step_attention = decode_attention_ref
    t = FuseLayers(backend=backend)
    t.apply(model)
    if quant == "int4":  # the PLE gate quantised too (skip only the K=16 projection): int4 gelu_mul
        Int4Quant(group_size=32, skip=("per_layer_projection",), backend=backend).apply(model)
    elif quant == "int8":
        from fastgemma.transforms.quant_int8 import Int8Quant

        Int8Quant(backend=backend).apply(model)
    assert model.fused_verify is not None and t.describe()["verify_epilogues"]
    fused_verify = model.fused_verify
    qkv = functools.partial(fused_verify, qkv_kernel=True)  # + kernels/qkv_finish.py (triton backend)
    attn_qkv = functools.partial(fused_verify, attn_qkv=True)  # the attention's q/k/v mode (triton backend)
    # 5 rows of one sequence (a verify pass), then a batch of 2 at one row each (the PLE input's
    # rows then come from two sequences: aux's row stride is not the hidden's)
    for ids, pos in ((torch.tensor([[3, 4, 5, 6, 7]]), torch.arange(5)[None]),
                     (torch.tensor([[3], [9]]), torch.tensor([[0], [0]]))):
        outs = []
        for verify in ((qkv, attn_qkv, fused_verify, None) if backend == "triton" else (fused_verify, None)):
            model.fused_verify = verify
            cache = KVCache(GEMMA4_TINY, ids.shape[0], 64, window=4, device="cpu", dtype=torch.float32)
            last = max(cache.k)  # the last store layer (cache.k / v: by layer index)
            outs.append((model.step(ids, pos, cache), cache.k[0].clone(), cache.v[last].clone()))
        h_ref, k_ref, v_ref = outs[-1]
        for h, k, v in outs[:-1]:
            assert h.shape == h_ref.shape and (h - h_ref).abs().max().item() < 1e-4
            assert torch.allclose(k, k_ref, atol=1e-5) and torch.allclose(v, v_ref, atol=1e-5)


def test_attn_qkv_is_the_one_row_steps_option():
    """fuse.attn_qkv reaches the one-row step and the drafter's step, not the verify pass (which keeps
    qkv_finish), and only on the Triton backend."""
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.weights.synthetic import synthetic_model

    for backend, on in (("triton", True), ("torch", False)):
        model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=0)
        t = FuseLayers(backend=backend, attn_qkv=True)
        t.apply(model)
        assert model.fused_decode.keywords["attn_qkv"] is on and model.fuse_drafter.keywords["attn_qkv"] is on
        assert model.fused_verify.keywords["attn_qkv"] is False and t.describe()["attn_qkv"] is True
    # fuse.attn_tiles: per layer kind, checked; it reaches the one-row step and the drafter's; refused
    # without attn_qkv and with a bad entry
    model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=0)
    t = FuseLayers(attn_qkv=True, attn_tiles=" sliding_query:32x4s2p3, full_store:32x16s2 ")
    t.apply(model)
    assert model.fused_decode.keywords["attn_tiles"] == {"sliding_query": "32x4s2p3", "full_store": "32x16s2"}
    assert model.fuse_drafter.keywords["attn_tiles"] == model.fused_decode.keywords["attn_tiles"]
    assert t.describe()["attn_tiles"] == "sliding_query:32x4s2p3,full_store:32x16s2"
    assert FuseLayers(attn_qkv=True).describe()["attn_tiles"] == ""
    # as the command line gives a list (fuse.attn_tiles=[full_store:32x16s2,sliding_store:32x8s2])
    assert FuseLayers(attn_qkv=True, attn_tiles=["full_store:32x16s2", "sliding_store:32x8s2"]).attn_tiles == {
        "full_store": "32x16s2", "sliding_store": "32x8s2"}
    with pytest.raises(ValueError, match="needs fuse.attn_qkv=true"):
        FuseLayers(attn_tiles="full_store:32x16s2")
    for bad, what in (("full:32x16s2", "KIND:BLOCKNxWARPSsSTAGES"), ("full_store:32x3s2", "num_warps"),
                      ("full_store", "KIND:"), ("full_store=32x4s2", "KIND:"),
                      ("full_store:32x4s2,full_store:16x8s2", "twice"), ("sliding_store:32x8s2p0", "split count"),
                      ("sliding_store:32x8s2x3", "pSPLITS")):
        with pytest.raises(ValueError, match=what):
            FuseLayers(attn_qkv=True, attn_tiles=bad)


def test_fuse_layers_wide_steps_and_refusals():
    from fastgemma.engine.cache import KVCache
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.weights.synthetic import synthetic_model

    model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=0)
    model.step_attention = decode_attention_ref
    FuseLayers(backend="torch").apply(model)
    called = []
    inner = model.fused_decode
    model.fused_decode = lambda *a: called.append(1) or inner(*a)
    cache = KVCache(GEMMA4_TINY, 1, 64, device="cpu", dtype=torch.float32)
    ids = torch.tensor([[3, 4]])
    model.step(ids, torch.tensor([[0, 1]]), cache)  # two rows (a verify pass): fused_verify's path
    assert not called
    model.step(ids[:, :1], torch.tensor([[2]]), cache)
    assert called == [1]
    model.layers[2].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match=r"runs bias-free dense, int4 or int8 .* layers.2.self_attn.o_proj"):
        model.step(ids[:, :1], torch.tensor([[3]]), cache)
    with pytest.raises(ValueError, match="backend must be triton or torch"):
        FuseLayers(backend="cuda")


def test_fuse_layers_from_the_config():
    """fuse=layers from the real config on a CPU (twins): the engine's tokens equal eager decode of
    the same weights, dense and int4; with quant=nf4 the build refuses in one line; the Triton
    backend asks for a GPU."""
    from fgcli_helpers import TINY, compose_cfg
    from hydra.core.hydra_config import HydraConfig

    from fastgemma.build import BuildError, build_context
    from fastgemma.engine.cache import KVCache
    from fastgemma.engine.generator import Generator
    from fastgemma.engine.steps import EagerStep

    def ctx_for(*over):
        cfg = compose_cfg([*TINY, "graphs=static", *over])
        HydraConfig.instance().set_config(cfg)
        return build_context(cfg, dict(cfg.hydra.runtime.choices), "/tmp")

    ctx = ctx_for("fuse=layers", "fuse.backend=torch")
    eng = ctx.factory.engine(64)
    prompt = list(range(7, 27))
    out = eng.generator.generate(prompt, 8)
    m = ctx.factory.model
    assert m.fused_decode is not None and ctx.factory.parts.fuse.describe()["fused_backend"] == "torch"
    cache = KVCache(m.config, 1, 64, dtype=m.embed_tokens.weight.dtype)
    assert out.tokens == Generator(m, cache, EagerStep(m, cache)).generate(prompt, 8).tokens
    ctx = ctx_for("fuse=layers", "fuse.backend=torch", "quant=int4", "quant.backend=torch", "quant.group_size=32",
                  "quant.skip=[per_layer_input_gate,per_layer_projection]")
    out = ctx.factory.engine(64).generator.generate(prompt, 8)
    m = ctx.factory.model
    cache = KVCache(m.config, 1, 64, dtype=m.embed_tokens.weight.dtype)
    assert out.tokens == Generator(m, cache, EagerStep(m, cache)).generate(prompt, 8).tokens
    with pytest.raises(BuildError, match="fuse=layers with quant=nf4: .* Linear4bit: use fuse=merged"):
        ctx_for("fuse=layers", "fuse.backend=torch", "quant=nf4").factory.model
    with pytest.raises(BuildError, match="fuse.backend=torch"):
        ctx_for("fuse=layers").factory.model


def test_fused_int4_tile_bench_and_table(monkeypatch, capsys):
    """bench_tiles on tiny cases (interpreter, a stub timer): every candidate's output is checked
    against the twin, the fastest becomes a TILES line, and a TILES entry is what a launch then uses."""
    from fastgemma.kernels import fused_w4a16 as f4
    from fastgemma.kernels.int4_pack import pack_int4, quantize_int4
    from fastgemma.kernels.w4a16_table import W4A16Config

    cands = [W4A16Config(4, 128, 1, 2), W4A16Config(8, 256, 1, 4, words=True)]
    times = iter([3.0, 2.0, 1.0, 4.0, 5.0, 6.0])
    rows = f4.bench_tiles({"r": (16, 256, "residual"), "g": (16, 256, "geglu"), "p": (8, 256, "plain")}, cands,
                          dtype=torch.float32, timer=lambda fn: (fn(), next(times))[1], device="cpu")
    assert len(rows) == 6 and all(r["ok"] for r in rows)
    out = capsys.readouterr().out
    assert "(16, 256, 2, 0): W4A16Config(8, 256, 1, 4, words=True)" in out  # residual: the 2.0 us one
    assert "(16, 256, 2, 1): W4A16Config(4, 128, 1, 2)" in out  # geglu: 1.0 us
    assert "(8, 256, 0, 0): W4A16Config(4, 128, 1, 2)" in out   # plain: 5.0 us
    seen = []
    real = f4.resolve_config
    monkeypatch.setattr(f4, "resolve_config", lambda M, N, K, G, cfg=None: seen.append(cfg) or real(M, N, K, G, cfg))
    monkeypatch.setitem(f4.TILES, (8, 256, 0, 0), W4A16Config(4, 128, 1, 2))
    q, s, z = quantize_int4(torch.randn(8, 256), 128)
    f4.fused_w4a16(torch.randn(1, 256), pack_int4(q), s, z, 128, eps=1e-6)
    assert seen == [W4A16Config(4, 128, 1, 2)]


def test_fused_verify_honours_an_int4_tile_override(monkeypatch):
    """An Int4Linear's `config` (its tile override, which its forward honours) also holds when the
    wider fused step launches the layer's GEMMs itself."""
    from fastgemma.engine.cache import KVCache
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.quant import Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    import fastgemma.kernels.rows_gemv as rows_mod
    import fastgemma.kernels.skinny_gemm as skinny_mod
    import fastgemma.kernels.w4a16 as w4a16_mod
    import fastgemma.kernels.w4a16_table as w4a16_table

    monkeypatch.setattr(w4a16_table, "default_config", lambda M, N, K: w4a16_table._grp(64, 1, 4))
    monkeypatch.setattr(skinny_mod, "default_config", lambda N, K: skinny_mod.SkinnyConfig(64, 64, 1, 4))
    monkeypatch.setattr(rows_mod, "DEFAULT_CONFIG", rows_mod.GemvConfig(64, 128, 4))
    model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=2)
    model.step_attention = decode_attention_ref
    FuseLayers(backend="triton").apply(model)
    Int4Quant(group_size=32, skip=("per_layer_projection",), backend="triton").apply(model)
    override = w4a16_table._grp(32, 2, 2)
    model.layers[0].self_attn.o_proj.config = override
    seen, launch = [], w4a16_mod.w4a16_matmul

    def spy(x, qweight, scales, zeros, group_size, config=None, *args, **kw):
        seen.append(config)
        return launch(x, qweight, scales, zeros, group_size, config, *args, **kw)

    monkeypatch.setattr(w4a16_mod, "w4a16_matmul", spy)
    cache = KVCache(GEMMA4_TINY, 1, 64, window=4, device="cpu", dtype=torch.float32)
    h = model.step(torch.tensor([[3, 4]]), torch.arange(2)[None], cache)
    assert override in seen and torch.isfinite(h).all()
