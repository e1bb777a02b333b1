"""The norm fold (kernels/norm_fold.py, kernels/mma_fold.py): a residual update + RMSNorm between two
one-row tensor-core int4 GEMVs folded into them. Under TRITON_INTERPRET=1 (mma emulated): the
producer's store and the consumer's combine against float64 sums and their twins, h as
kernels/residual_norm.py's kernel writes it, refusals, and the fused step with `fuse.norm_fold`."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton

from fastgemma.kernels.int4_pack import dequantize_int4, pack_int4, quantize_int4
from fastgemma.kernels.mma_table import MmaConfig
from fastgemma.kernels.mma_w4a16 import MmaWeight

INTERPRET = bool(triton.knobs.runtime.interpret)
pytestmark = pytest.mark.skipif(not INTERPRET, reason="the kernels run under TRITON_INTERPRET=1 on a CPU")


def _weights(N, K, G, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_int4((torch.randn(N, K, generator=g) * 0.05).bfloat16(), G)


def _inputs(N, K, seed, scale: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=g).bfloat16()
    a = (torch.randn(1, N, generator=g) * 2).bfloat16()
    post, pre = (torch.randn(N, generator=g) * 0.3).bfloat16(), (torch.randn(N, generator=g) * 0.3).bfloat16()
    return x, a, post, pre, (torch.tensor([0.7]).bfloat16() if scale else None)


def _exact(x, q0, s0, z0, a, post, pre, scale, q1, s1, z1, G, eps, off, epilogue):
    """y = x W0^T (bf16, as the producer stores it), then h and the consumer's output in float64."""
    y = (x.double() @ dequantize_int4(pack_int4(q0), s0, z0, G, dtype=torch.float64).T)
    yb = y.bfloat16().double()
    h = a.double() + yb * torch.rsqrt(yb.pow(2).mean(-1, keepdim=True) + eps) * (post.double() + off)
    h = h * scale.double() if scale is not None else h
    xin = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (pre.double() + off)
    out = xin @ dequantize_int4(pack_int4(q1), s1, z1, G, dtype=torch.float64).T
    if epilogue == "geglu":
        gate, up = out.chunk(2, dim=-1)
        out = F.gelu(gate, approximate="tanh") * up
    return y, h, out


@pytest.mark.parametrize("N0,K0,N1,G,cfg0,cfg1,epilogue,scale", [
    # the producer on the persistent kernel (8 tiles on 2 programs), the consumer's 12 tiles on 2
    (128, 256, 192, 64, MmaConfig(1, 1, 2, persist=1), MmaConfig(1, 1, 2, persist=1, fresh=True), "none", True),
    # the producer on the one-tile kernel (2-tile programs), the consumer GeGLU, one tile per program
    (128, 256, 192, 64, MmaConfig(2, 1), MmaConfig(2, 1, 2, persist=9, fresh=True), "geglu", False),
    # group 128, 2 warps splitting K in both; 5 consumer pairs on 2 programs, one step masked
    (256, 512, 160, 128, MmaConfig(2, 2, 2, persist=9, fresh=True), MmaConfig(2, 2, 1, persist=1), "geglu", True),
    # the consumer's GeGLU on the paired layout, one tile per program
    (128, 256, 192, 64, MmaConfig(2, 1), MmaConfig(1, 1, 2, persist=9, fresh=True, pairs=True), "geglu", True),
])
def test_producer_and_consumer_match_exact_sums(N0, K0, N1, G, cfg0, cfg1, epilogue, scale):
    from fastgemma.kernels.mma_fold import mma_fold, mma_fold_ref, mma_rows, mma_rows_ref, rows_tiles
    from fastgemma.kernels.residual_norm import residual_norm

    q0, s0, z0 = _weights(N0, K0, G, seed=N0 + K0)
    q1, s1, z1 = _weights(N1, N0, G, seed=N1)
    x, a, post, pre, sc = _inputs(N0, K0, N1, scale)
    eps, off = 1e-6, 1.0 if scale else 0.0
    y, rows, parts = mma_rows(x, MmaWeight.from_codes(q0, s0, z0, G), a, post, pre, offset=off, config=cfg0)
    out, h = mma_fold(rows, parts, MmaWeight.from_codes(q1, s1, z1, G, pairs=cfg1.pairs), a, y, post, sc, eps=eps,
                      offset=off, epilogue=epilogue, config=cfg1)
    y64, h64, want = _exact(x, q0, s0, z0, a, post, pre, sc, q1, s1, z1, G, eps, off, epilogue)
    assert parts.shape == (rows_tiles(N0, cfg0), 4) and rows.shape == (2, N0)
    # the producer: its y as the plain kernel's, its rows and partials as the twin's from that y
    assert (y.double() - y64).abs().max().item() <= 2 ** -7 * y64.abs().max().item()
    _, rows_t, parts_t = mma_rows_ref(x, pack_int4(q0), s0, z0, G, a, post, pre, offset=off, tile_rows=16 * cfg0.tiles)
    yf, af = y.double().reshape(-1), a.double().reshape(-1)
    u = yf * (post.double() + off)
    sums = torch.stack([yf * yf, af * af, af * u, u * u], -1).reshape(-1, 16 * cfg0.tiles, 4).sum(1)
    assert torch.allclose(parts.double(), sums, rtol=1e-5, atol=1e-4)
    p = pre.double() + off
    # the interpreter truncates the bf16 stores toward zero: within one bf16 step of the exact rows
    assert ((rows.double() - torch.stack([af * p, u * p])).abs() <= torch.stack([af * p, u * p]).abs() * 2 ** -7).all()
    assert rows_t.shape == rows.shape and parts_t.shape == parts.shape
    # the consumer: within bf16 rounding of float64 and of its twin; h as the norm kernel writes it
    tol = (2 ** -6 if epilogue == "none" else 2 ** -5) * want.abs().max().item()
    assert out.shape == want.shape and (out.double() - want).abs().max().item() <= tol
    ref, href = mma_fold_ref(rows, parts, pack_int4(q1), s1, z1, G, a, y, post, sc, eps=eps, offset=off,
                             epilogue=epilogue)
    assert (out.double() - ref.double()).abs().max().item() <= tol
    hk, _ = residual_norm(a, y, post, sc, pre, eps=eps, offset=off)
    assert h.shape == a.shape and (h != hk).sum().item() <= max(2, N0 // 64)  # sums in another order
    assert (h.double() - h64).abs().max().item() <= 2 ** -6 * h64.abs().max().item()
    assert (href.double() - h64).abs().max().item() <= 2 ** -7 * h64.abs().max().item()


def test_refusals():
    from fastgemma.kernels.mma_fold import mma_fold, mma_rows

    q, s, z = _weights(64, 256, 128, 1)
    w = MmaWeight.from_codes(q, s, z, 128)
    x, a, post, pre, _ = _inputs(64, 256, 1, False)
    with pytest.raises(ValueError, match="one bf16 row"):
        mma_rows(torch.cat([x, x]), w, a, post, pre, config=MmaConfig(1, 1))
    with pytest.raises(ValueError, match="K split"):
        mma_rows(x, w, a, post, pre, config=MmaConfig(1, 1, splits=2))
    with pytest.raises(ValueError, match="pre must hold 64"):
        mma_rows(x, w, a, post, pre[:32], config=MmaConfig(1, 1))
    y, rows, parts = mma_rows(x, w, a, post, pre, config=MmaConfig(1, 1))
    w1 = MmaWeight.from_codes(*_weights(32, 64, 64, 2), 64)
    with pytest.raises(ValueError, match="persist > 0"):
        mma_fold(rows, parts, w1, a, y, post, eps=1e-6, config=MmaConfig(1, 1))
    with pytest.raises(ValueError, match="rows"):
        mma_fold(rows[:1], parts, w1, a, y, post, eps=1e-6, config=MmaConfig(1, 1, persist=1))
    with pytest.raises(ValueError, match="parts"):
        mma_fold(rows, parts.double(), w1, a, y, post, eps=1e-6, config=MmaConfig(1, 1, persist=1))
    with pytest.raises(ValueError, match="scale"):
        mma_fold(rows, parts, w1, a, y, post, torch.ones(2), eps=1e-6, config=MmaConfig(1, 1, persist=1))


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
def test_fused_step_with_the_norms_folded(family, monkeypatch, wide_tiles):
    """fuse.norm_fold: bf16 tiny models, int4 g64, one-row configs for the tiny shapes (o on the one-tile
    kernel, the rest persistent). Gemma 4 (PLE width 64, 12 layers): every o / gate|up pair and every PLE
    projection / next q|k|v pair takes the fold; Gemma 3 (no PLE, 6 layers): down / next q|k|v instead.
    The only norm launch left is layer 0's input norm, and the hidden states match the step with the
    norm launches (its torch twins) to bf16 rounding over two positions (the cache carries each step's
    K / V, so a wrong residual would grow); without int4_mma it is refused, under batch_invariant off."""
    import fastgemma.kernels.mma_fold as fold_mod
    import fastgemma.kernels.mma_table as mma_table
    import fastgemma.kernels.residual_norm as rn_mod
    from fastgemma.engine.cache import KVCache
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.fused_layer_ops import _layer_linears
    from fastgemma.transforms.quant import Int4Linear, Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    if family == "gemma4":  # the PLE projection int4 at group 64 too
        cfg_model, positions = dataclasses.replace(GEMMA4_TINY, ple_dim=64), (7, 3)
    else:
        cfg_model, positions = dataclasses.replace(
            GEMMA4_TINY, name="gemma3_tiny", family="gemma3", ple_dim=0, num_kv_shared_layers=0, norm_offset=1.0,
            v_norm=False, layer_scalar=False, attn_scale=32 ** -0.5, num_layers=6,
            layer_types=GEMMA4_TINY.layer_types[:5] + GEMMA4_TINY.layer_types[-1:]), (7, 3)
    model = synthetic_model(cfg_model, "cpu", torch.bfloat16, seed=3)
    model.step_attention = decode_attention_ref
    FuseLayers(backend="triton").apply(model)
    Int4Quant(group_size=64, skip=("per_layer_input_gate",), backend="triton").apply(model)
    for i, layer in enumerate(model.layers):
        for name, m in _layer_linears(i, layer).items():
            if isinstance(m, Int4Linear):
                cfg = MmaConfig(1, 1) if name == "o" else MmaConfig(2 if name == "gate_up" else 1, 1, 2, persist=1,
                                                                    fresh=True)
                monkeypatch.setitem(mma_table.MMA_CONFIGS, (m.out_features, m.in_features, False), cfg)
    steps = {}
    for fold in (False, True):  # the reference: the step with the norm launches, as their twins (the torch backend)
        t = FuseLayers(backend="triton" if fold else "torch", int4_mma=True, norm_fold=fold)
        t.apply(model)
        t.validate(model)
        assert t.describe()["norm_fold"] is fold
        steps[fold] = model.fused_decode
    calls = {"rows": [], "fold": [], "residual_norm": 0}
    real_rows, real_fold, real_rn = fold_mod.mma_rows, fold_mod.mma_fold, rn_mod.residual_norm
    monkeypatch.setattr(fold_mod, "mma_rows",
                        lambda x, w, *r, **k: calls["rows"].append(w.N) or real_rows(x, w, *r, **k))
    monkeypatch.setattr(fold_mod, "mma_fold", lambda rows, parts, w, *r, **k: calls["fold"].append(
        (w.N, k.get("epilogue"), r[3] is not None if len(r) > 3 else False)) or real_fold(rows, parts, w, *r, **k))
    monkeypatch.setattr(rn_mod, "residual_norm", lambda *a, **k: calls.__setitem__(
        "residual_norm", calls["residual_norm"] + 1) or real_rn(*a, **k))
    outs = {}
    for fold, step in steps.items():
        model.fused_decode = step
        cache = KVCache(cfg_model, 1, 64, window=4, device="cpu", dtype=torch.bfloat16)
        outs[fold] = [model.step(torch.tensor([[t]]), torch.tensor([[p]]), cache).float()
                      for p, t in enumerate(positions)]
        if not fold:
            assert not calls["residual_norm"] and not calls["rows"] and not calls["fold"]
    L = cfg_model.num_layers
    assert calls["residual_norm"] == len(positions)  # layer 0's input norm, nothing else
    # o per layer, and the GEMV that ends each layer but the last (the PLE projection, or down)
    assert len(calls["rows"]) == len(positions) * (2 * L - 1)
    assert len(calls["fold"]) == len(positions) * (2 * L - 1)
    assert sum(1 for _, epi, _ in calls["fold"][:2 * L - 1] if epi == "geglu") == L
    assert sum(1 for _, _, scaled in calls["fold"][:2 * L - 1] if scaled) == L - 1  # the layer scalar (ones in Gemma 3)
    # two valid bf16 roundings of this tiny random model drift apart by up to ~8% of the largest value over
    # a few steps (run FV's test: the two launches' twin in round-to-nearest against the interpreter's kernels,
    # which truncate their bf16 stores)
    errs = [((got - want).abs().max() / want.abs().max()).item() for got, want in zip(outs[True], outs[False])]
    assert max(errs) <= 0.1, errs
    with pytest.raises(ValueError, match="int4_mma"):
        FuseLayers(backend="triton", norm_fold=True)
    # the exact-tokens switch wins over the fold (a recipe with it + batch_invariant)
    t = FuseLayers(backend="triton", int4_mma=True, qkv_kernel=True, batch_invariant=True, norm_fold=True)
    assert t.describe()["norm_fold"] is False and t.describe()["batch_invariant"] is True


def test_bench_fold_checks_each_consumer_against_the_twin(capsys):
    """bench_fold on small shapes: the table's entry (none here: skipped with the reason), a Triton consumer checked
    and timed, a CUDA one reported as not runnable here."""
    from fastgemma.kernels.mma_fold import bench_fold
    from fastgemma.kernels.mma_table import parse_config

    cases = {"small": (128, 256, 192, "geglu", True)}
    rows = bench_fold(cases, configs=[MmaConfig(1, 1, 2, persist=9, fresh=True, pairs=True), parse_config("cuda2x4g")],
                      timer=lambda fn: (fn(), 2.0)[1], device="cpu", producer=MmaConfig(2, 1), plain=True)
    out = capsys.readouterr().out
    assert len(rows) == 2 and rows[0]["ok"] and rows[0]["config"] == "1x1d2p9fg" and rows[0]["us"] == 2.0
    assert rows[1] == dict(case="small", config="1x1d2p9fg", us=2.0, plain=True)  # the plain launch, same rows
    assert rows[0]["max_rel_err"] < 2e-2 and rows[0]["h_rel_err"] < 2e-2
    assert "none" in out and "skipped" in out and "cuda2x4g" in out and "CUDA" in out
