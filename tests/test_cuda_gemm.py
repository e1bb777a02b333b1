"""The CUDA W4A16 kernel (kernels/cuda_gemm.py, `MmaConfig.cuda`): its config text, refusals, build command and
errors, and the table's fallback to the Triton entry where it cannot run. The kernel itself needs nvcc and
an sm_90 GPU: bench_mma (`MMA_TRY=cuda5x8g`, `MMA_TRY=cuda5x10c8`) checks it against the twin, bench_fold (`bash
sweeps/h200.sh fold`) the norm fold's consumer on it, and bench.invariance (`--mma-table +ENTRIES`) its rows against
one-row launches (docs/results.md, runs JC-JJ, JL-JY)."""
import os
import stat
from types import SimpleNamespace

import pytest
import torch

from fastgemma.kernels import cuda_gemm
from fastgemma.kernels.int4_pack import quantize_int4
from fastgemma.kernels.mma_fold import consumer_problem
from fastgemma.kernels.mma_table import (CUDA_FALLBACKS, INVARIANT_CONFIGS, MMA_CONFIGS, MmaConfig, config_problem,
                                         format_config, mma_config, parse_config, parse_table, set_table,
                                         settle_cuda_entries)
from fastgemma.kernels.mma_w4a16 import MmaWeight, mma_w4a16 as run_mma

GATE_UP = (20480, 2560)


def test_config_text_round_trips_and_reads_the_paired_layout():
    cfg = parse_config("cuda5x8g")
    assert cfg == MmaConfig(1, 5, 8, pairs=True, cuda=True)
    assert format_config(cfg) == "cuda5x8g"
    assert parse_config(format_config(MmaConfig(1, 10, 12, pairs=True, cuda=True))).warps == 10
    table = parse_table("gate|up@1=cuda5x8g,gate|up@8=cuda10x8g,down@8=1x1s8,down@1=cuda5x10c8")
    assert table[(*GATE_UP, False)] == cfg and table[(*GATE_UP, True)].warps == 10
    assert table[(2560, 10240, True)] == MmaConfig(1, 1, splits=8)
    # down's plain store on the natural layout, K over a cluster of 8 CTAs
    assert table[(2560, 10240, False)] == MmaConfig(1, 5, 10, splits=8, cuda=True)
    for text in ("cuda5x10c8", "cuda4x6c2g", "cuda8x4"):
        assert format_config(parse_config(text)) == text
    with pytest.raises(ValueError, match="cudaWxS"):
        parse_config("cuda5")
    # '@inv': fuse.batch_invariant's entry (INVARIANT_CONFIGS), over the shipped ones, until the next set_table
    inv = parse_table("down@inv=cuda5x10c8")
    assert inv == {(2560, 10240): MmaConfig(1, 5, 10, splits=8, cuda=True)}
    from fastgemma.kernels.mma_table import SHIPPED_INVARIANT as shipped
    saved = dict(MMA_CONFIGS)
    try:
        set_table({**saved, **inv})
        assert MMA_CONFIGS == saved and mma_config(2560, 10240, 8, invariant=True) == inv[(2560, 10240)]
        assert all(INVARIANT_CONFIGS[k] == c for k, c in shipped.items() if k != (2560, 10240))
    finally:
        set_table(saved)
    assert INVARIANT_CONFIGS == shipped
    with pytest.raises(ValueError, match="inv"):
        parse_table("down@0=cuda5x10c8")
    # the shipped INVARIANT_CONFIGS entry reads the paired words the one-row and 8-row Triton entries read
    from fastgemma.kernels.mma_table import table_pairs
    assert table_pairs(*GATE_UP)


def test_refusals_say_what_the_kernel_takes():
    cfg = parse_config("cuda5x8g")
    N, K = GATE_UP
    assert config_problem(cfg, N, K, 128, "geglu") is None
    # the GeGLU reads the paired layout, the plain store the natural one
    assert "paired" in config_problem(cfg, N, K, 128, "none")
    assert "paired" in config_problem(parse_config("cuda5x8"), N, K, 128, "geglu")
    assert config_problem(parse_config("cuda5x10c8"), 2560, 10240, 128, "none") is None
    assert "epilogues" in config_problem(parse_config("cuda5x8"), 2560, 2048, 128, "relu")
    assert "groups of 128" in config_problem(cfg, N, K, 64, "geglu")
    assert "1..8 CTAs" in config_problem(parse_config("cuda5x10c16"), 2560, 10240, 128, "none")
    assert "slices" in config_problem(parse_config("cuda5x10c3"), 2560, 10240, 128, "none")  # 80 groups over 3
    assert "slices" in config_problem(parse_config("cuda5x8"), 2552, 2048, 128, "none")  # N not whole tiles
    assert "shared memory" in config_problem(parse_config("cuda10x16g"), N, K, 128, "geglu")
    assert "more splits" in config_problem(parse_config("cuda10x8"), 2560, 10240, 128, "none")  # x: 164 KB
    assert "warps and stages" in config_problem(parse_config("cuda5x0g"), N, K, 128, "geglu")
    # the norm fold's consumer takes the CUDA kernel with all of K in a CTA, not a cluster split
    assert consumer_problem(cfg, N, K, 128, "geglu") is None
    assert consumer_problem(parse_config("cuda5x16"), 3072, 2560, 128, "none") is None
    assert "all of K" in consumer_problem(parse_config("cuda5x16c5"), 3072, 2560, 128, "none")
    assert "paired" in consumer_problem(parse_config("cuda5x8"), N, K, 128, "geglu")
    assert "too few" in consumer_problem(parse_config("cuda2x8"), 256, 2560, 128, "none")  # 16 tiles, h of 2,560


def test_smem_bytes_match_the_kernel_layout():
    # rings: 2 uint4 + 1 uint2 a lane a stage; x: 8 rows of K / 2 + 4 words; sums: K / 128 x 8 floats
    assert cuda_gemm.smem_bytes(5, 8, 2560) == 5 * 8 * (1024 + 256) + 8 * 1284 * 4 + 20 * 8 * 4
    assert cuda_gemm.smem_bytes(5, 10, 1280) == 5 * 10 * (1024 + 256) + 8 * 644 * 4 + 10 * 8 * 4  # down's slice
    src = cuda_gemm.SOURCE.read_text()
    assert "NW * S * 2 * 32 * 16 + NW * S * 32 * 8 + 8 * (KS / 2 + 4) * 4 + (KS / 128) * 8 * 4" in src


def test_table_falls_back_to_the_triton_entry_where_cuda_cannot_run(monkeypatch):
    saved, saved_inv = dict(MMA_CONFIGS), dict(INVARIANT_CONFIGS)
    INVARIANT_CONFIGS[GATE_UP] = parse_config("cuda5x8g")  # as shipped (another test's build may have settled it)
    try:
        set_table({**saved, **parse_table("gate|up@1=cuda5x8g,gate|up@8=cuda5x8g,down@8=cuda5x10c8")})
        monkeypatch.setattr(cuda_gemm, "device_problem", lambda device: None)
        built = []
        monkeypatch.setattr(cuda_gemm, "prebuild", lambda variants: built.append(set(variants)) or {})
        assert settle_cuda_entries("cuda") == []  # a device that runs it: the entries stay, built at once
        assert built == [{(5, 8, 2560, 1, 1), (5, 10, 1280, 8, 0)}]  # gate|up's GeGLU, down's plain store
        monkeypatch.setattr(cuda_gemm, "prebuild", lambda variants: {(5, 8, 2560, 1, 1): "nvcc failed: planted"})
        with pytest.raises(RuntimeError, match="planted"):
            settle_cuda_entries("cuda")
        assert mma_config(*GATE_UP, 8, "geglu").cuda and mma_config(*GATE_UP, 1, "geglu", invariant=True).cuda
        monkeypatch.setattr(cuda_gemm, "device_problem", lambda device: "no nvcc here")
        lines = settle_cuda_entries("cuda")
        # the three table entries given here and the shipped INVARIANT_CONFIGS ones
        shipped = sum(c.cuda for c in saved_inv.values())
        assert len(lines) == 3 + shipped and all("no nvcc here" in x for x in lines)
        fallback = CUDA_FALLBACKS[GATE_UP]
        assert sum("2x4d5p9fg" in x for x in lines) == 3
        assert INVARIANT_CONFIGS[GATE_UP] == fallback
        assert mma_config(*GATE_UP, 1, "geglu") == fallback
        assert mma_config(*GATE_UP, 8, "geglu", invariant=True) == fallback
        assert fallback.pairs  # the same words serve both
        # every shipped CUDA entry has its Triton entry; one given for a shape without one leaves the table
        assert all(k in CUDA_FALLBACKS for k, c in saved_inv.items() if c.cuda)
        assert all(k[:2] in CUDA_FALLBACKS for k, c in saved.items() if c.cuda)
        down = (2560, 10240)
        if down not in CUDA_FALLBACKS:
            assert (*down, True) not in MMA_CONFIGS and any("no table entry" in x for x in lines)
        assert not any(c.cuda for c in [*MMA_CONFIGS.values(), *INVARIANT_CONFIGS.values()])
    finally:
        set_table(saved)
        INVARIANT_CONFIGS.clear()
        INVARIANT_CONFIGS.update(saved_inv)


def test_fuse_layers_settles_the_table_at_build_time():
    """FuseLayers reads the device before any step is traced: a CUDA entry on a device that cannot run it (here
    the CPU) becomes the Triton entry, so the traced step looks up a plain table."""
    from fastgemma.transforms.fuse_layers import FuseLayers

    saved = dict(MMA_CONFIGS)
    try:
        set_table({**saved, **parse_table("gate|up@1=cuda5x8g")})
        model = torch.nn.Linear(2, 2)  # a module on the CPU with no decoder layers and no PLE: its device is read
        model.layers, model.config, model.ple_projected = [], SimpleNamespace(ple_dim=0), False
        FuseLayers(backend="triton", int4_mma=True)._enable_mma(model)
        assert MMA_CONFIGS[(*GATE_UP, False)] == CUDA_FALLBACKS[GATE_UP]
    finally:
        set_table(saved)


def test_build_command_targets_sm90a_with_the_variant_macros(tmp_path):
    cmd = cuda_gemm.build_command("nvcc", 5, 10, 1280, 8, 0, cuda_gemm.SOURCE, tmp_path / "x.so")
    assert cmd[0] == "nvcc" and "-gencode=arch=compute_90a,code=sm_90a" in cmd and "-shared" in cmd
    assert {"-DFG_NW=5", "-DFG_S=10", "-DFG_KS=1280", "-DFG_C=8", "-DFG_EPI=0"} <= set(cmd)
    # the kernel's own trigger points (the source's defaults: one row once the last group is asked for, several at
    # the start), or those given
    assert not any(a.startswith("-DFG_TRIG") for a in cmd)
    cmd = cuda_gemm.build_command("nvcc", 5, 8, 2560, 1, 1, cuda_gemm.SOURCE, tmp_path / "x.so", (12, 4))
    assert {"-DFG_TRIG1=12", "-DFG_TRIGN=4"} <= set(cmd)
    src = cuda_gemm.SOURCE.read_text()
    assert "extern \"C\" int fg_w4_gemm" in src
    assert "#define FG_TRIG1 (FG_KS / 128 > FG_S ? FG_KS / 128 - FG_S : 1)" in src and "#define FG_TRIGN 0" in src


def test_trigger_points_parse_and_refuse_what_is_not_two_counts():
    assert cuda_gemm.parse_trigger("9999,0") == (cuda_gemm.AFTER_LOOP, 0)
    assert cuda_gemm.parse_trigger("") is None  # the kernel's own points
    assert cuda_gemm.parse_trigger(" 12, 8") == (12, 8)
    for bad in ("12", "12,8,4", "-1,0", "a,0", ","):
        with pytest.raises(ValueError, match="ONE,ROWS"):
            cuda_gemm.parse_trigger(bad)
    assert cuda_gemm.TRIGGER == cuda_gemm.parse_trigger(os.environ.get(cuda_gemm.TRIGGER_ENV, ""))


def test_no_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_gemm, "nvcc", lambda: None)
    cuda_gemm.library.cache_clear()
    with pytest.raises(RuntimeError, match="nvcc"):
        cuda_gemm.library(5, 8, 2560, 1, 1)


def test_a_failing_build_reports_nvcc_output(monkeypatch, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'w4_gemm.cu(1): error: planted' >&2\nexit 2\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    monkeypatch.setattr(cuda_gemm, "nvcc", lambda: str(fake))
    monkeypatch.setenv("FASTGEMMA_CUDA_CACHE", str(tmp_path / "cache"))
    cuda_gemm.library.cache_clear()
    with pytest.raises(RuntimeError, match="planted"):
        cuda_gemm.library(5, 8, 2560, 1, 1)
    assert not any(p.suffix == ".so" for p in (tmp_path / "cache").iterdir())  # nothing half-built is cached
    cuda_gemm.library.cache_clear()


def test_nvcc_found_from_cuda_home(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    exe = tmp_path / "bin" / "nvcc"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert cuda_gemm.nvcc() == os.path.join(str(tmp_path), "bin", "nvcc")


def test_launch_off_a_cuda_device_is_refused():
    N, K, G = 64, 1280, 128
    q, sc, zr = quantize_int4(torch.randn(N, K) * 0.02, G)
    sc, zr = sc.to(torch.bfloat16), zr.to(torch.bfloat16)
    w = MmaWeight.from_codes(q, sc, zr, G, pairs=True)
    x = torch.randn(2, K, dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match="CUDA"):
        run_mma(x, w, "geglu", parse_config("cuda5x8g"))


def test_the_fold_consumer_on_a_cuda_entry_launches_the_cuda_fold(monkeypatch):
    """mma_fold hands a CUDA config's consumer to cuda_fold with the producer's rows and partials, its a, y, post,
    the layer scalar and the words in the config's layout; the fused step pairs o with a CUDA gate|up."""
    from fastgemma.kernels import mma_fold as mf

    N, K, G = 256, 256, 128  # 16 tiles on 8 CTAs of 2 warps: 512 threads for h's 256 entries
    q, sc, zr = quantize_int4(torch.randn(N, K) * 0.02, G)
    w = MmaWeight.from_codes(q, sc.to(torch.bfloat16), zr.to(torch.bfloat16), G, pairs=True)
    rows, parts = torch.randn(2, K, dtype=torch.bfloat16), torch.randn(16, 4)
    a, y, post = (torch.randn(K, dtype=torch.bfloat16) for _ in range(3))
    scale = torch.tensor([0.5], dtype=torch.bfloat16)
    seen = {}

    def fake(*args):
        seen["args"] = args
        return "out", "h"

    monkeypatch.setattr(mf, "_cuda_or_interpret", lambda t, name: None)
    monkeypatch.setattr(cuda_gemm, "cuda_fold", fake)
    cfg = parse_config("cuda2x4g")
    assert mf.mma_fold(rows, parts, w, a, y, post, scale, eps=1e-6, offset=1.0, epilogue="geglu", config=cfg,
                       pdl=True) == ("out", "h")
    got = seen["args"]
    assert got[0] is rows and got[1] is parts and got[2] is w.words and got[3] is w.sz
    assert got[4:8] == (N, 2, 4, "geglu") and got[11] is scale and got[12:] == (1e-6, 1.0, True)
    assert [t.data_ptr() for t in got[8:11]] == [a.data_ptr(), y.data_ptr(), post.data_ptr()]
    with pytest.raises(ValueError, match="all of K"):
        mf.mma_fold(rows, parts, MmaWeight.from_codes(q, sc.to(torch.bfloat16), zr.to(torch.bfloat16), G), a, y, post,
                    eps=1e-6, config=parse_config("cuda2x4c2"))


def test_the_cuda_fold_refuses_what_it_cannot_take():
    K = 2560
    rows, parts = torch.randn(2, K, dtype=torch.bfloat16), torch.randn(80, 4)
    a = torch.randn(K, dtype=torch.bfloat16)
    words, sz = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="CUDA device"):  # off a CUDA device
        cuda_gemm.cuda_fold(rows, parts, words, sz, 20480, 5, 8, "geglu", a, a, a, None, 1e-6, 1.0, True)
    assert cuda_gemm.SCALE_KINDS == {None: 0, torch.bfloat16: 1, torch.float32: 2}
    import unittest.mock as mock
    with mock.patch.object(cuda_gemm, "device_problem", lambda device: None):
        with pytest.raises(ValueError, match="two partial rows"):  # 5 warps: 320 rows at most
            cuda_gemm.cuda_fold(rows, torch.randn(321, 4), words, sz, 20480, 5, 8, "geglu", a, a, a, None, 1e-6, 1.0,
                                True)
        with pytest.raises(ValueError, match="too few"):  # 16 tiles on one CTA of 5 warps for 2,560 entries of h
            cuda_gemm.cuda_fold(rows, parts, words, sz, 256, 5, 8, "geglu", a, a, a, None, 1e-6, 1.0, True)
        with pytest.raises(ValueError, match="layer scalar"):
            cuda_gemm.cuda_fold(rows, parts, words, sz, 20480, 5, 8, "geglu", a, a, a, torch.ones(1, dtype=torch.half),
                                1e-6, 1.0, True)
    src = cuda_gemm.SOURCE.read_text()
    assert 'extern "C" int fg_w4_fold' in src and "scale_kind == 1 ? bf_lo" in src


def test_the_norm_before_a_cuda_gemm_lets_it_launch_first(monkeypatch, wide_tiles):
    """bf16, int4 g128 body, gate|up on a CUDA entry of the table (its launch faked by the Triton entry on the same
    paired words): in the one-row step and the 5-row verify pass the residual norm before gate|up launches with
    `early` (the GEMM after it launches first, runs MG-MH), every other norm without it; the tokens' hidden states
    are those of the Triton entry itself."""
    import dataclasses

    import fastgemma.kernels.w4a16 as w4a16_mod
    import fastgemma.kernels.w4a16_table as w4a16_table
    import fastgemma.transforms.fused_layer_ops as ops
    from fastgemma.engine.cache import KVCache
    from fastgemma.kernels import mma_table
    from fastgemma.kernels.decode_attention import decode_attention_ref
    from fastgemma.model.config import FULL, GEMMA4_TINY, SLIDING
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.fused_layer_ops import _layer_linears
    from fastgemma.transforms.quant import Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    cfg = dataclasses.replace(GEMMA4_TINY, hidden_size=128, intermediate_size=256, num_layers=4,
                              num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * 2)
    monkeypatch.setattr(w4a16_table, "default_config", lambda M, N, K: w4a16_table._grp(64, 1, 4))
    monkeypatch.setattr(w4a16_mod, "w4a16_epilogue_op", lambda x, qw, s, z, g, epi, aux, sz, pdl: w4a16_mod.w4a16_torch(
        x, qw, s, z, g, epilogue=epi, aux=aux))
    triton_entry = MmaConfig(1, 1, pairs=True)
    monkeypatch.setattr(cuda_gemm, "cuda_gemm", lambda x, words, sz, N, *rest: run_mma(
        x, MmaWeight(words, sz, N, x.shape[1], 128, True), rest[-2], triton_entry))
    monkeypatch.setattr(cuda_gemm, "device_problem", lambda device: None)  # the table's CUDA entries kept
    monkeypatch.setattr(cuda_gemm, "prebuild", lambda variants: {})
    model = synthetic_model(cfg, "cpu", torch.bfloat16, seed=3)
    model.step_attention = decode_attention_ref
    FuseLayers(backend="triton").apply(model)
    Int4Quant(group_size=128, skip=("per_layer_projection", "per_layer_input_gate"), backend="triton").apply(model)
    gu = _layer_linears(0, model.layers[0])["gate_up"]
    norms, real = [], ops._residual_norm

    def seen(a, y, post, scale, pre, eps, off, triton_ops, pdl, early=False):
        norms.append((a.shape[0], pre is not None and y is not None and post is not None and scale is None, early))
        return real(a, y, post, scale, pre, eps, off, triton_ops, pdl, early)

    monkeypatch.setattr(ops, "_residual_norm", seen)
    import fastgemma.transforms.fused_steps as steps
    monkeypatch.setattr(steps, "_residual_norm", seen)
    outs = {}
    for entry in (triton_entry, parse_config("cuda2x4g")):
        for multi in (False, True):
            monkeypatch.setitem(mma_table.MMA_CONFIGS, (gu.out_features, gu.in_features, multi), entry)
        t = FuseLayers(backend="triton", int4_mma=True)
        t.apply(model)
        for ids, pos in ((torch.tensor([[7]]), torch.tensor([[0]])),
                         (torch.tensor([[3, 4, 5, 6, 7]]), torch.arange(5)[None])):
            cache = KVCache(cfg, 1, 64, window=4, device="cpu", dtype=torch.bfloat16)
            del norms[:]
            outs[entry.cuda, ids.shape[1]] = model.step(ids, pos, cache)
            early = [n for n in norms if n[2]]
            if entry.cuda:  # the update after o + the norm before gate|up, once a layer, at the step's row count
                assert early == [(ids.shape[1], True, True)] * cfg.num_layers
                # the verify pass's other norms (before q|k|v, the PLE gate, the last) as before; at one row the
                # other prologues run in the fused GEMVs
                assert len(norms) > len(early) or ids.shape[1] == 1
            else:
                assert norms and not early
    for M in (1, 5):
        assert torch.equal(outs[True, M], outs[False, M])
