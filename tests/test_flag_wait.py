"""fuse.flag_wait (kernels/flag_wait.py): the int4 tensor-core GEMM raises the device's arrival flag, the residual
norm after it waits on the flag. Under the interpreter (launches in order, so the flag is up when the norm
starts): the same outputs as the plain launches at every kernel form (split-K, several tiles a program, the
persistent kernel), the flag's words back at zero after each pair, refusals; the sm_90a build: the norm that
waits on the flag has no griddepcontrol.wait, the GEMMs' arrivals and the wait's acquire loop are there."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastgemma.kernels.counters import arrival_flag
from fastgemma.kernels.int4_pack import quantize_int4
from fastgemma.kernels.mma_table import MmaConfig
from fastgemma.kernels.mma_w4a16 import MmaWeight, mma_w4a16
from fastgemma.kernels.residual_norm import residual_norm

N, K, G = 96, 256, 64


def _operands(M, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    q, s, z = quantize_int4(w, G)
    x = torch.randn(M, K, generator=g).bfloat16()
    a, post, pre = torch.randn(M, N, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16(), \
        torch.randn(N, generator=g).bfloat16()
    return MmaWeight.from_codes(q, s, z, G), x, a, post, pre, torch.tensor([0.5]).bfloat16()


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("cfg", [MmaConfig(1, 2), MmaConfig(1, 1, splits=4), MmaConfig(1, 2, iters=2),
                                 MmaConfig(2, 2, 2, persist=1, fresh=True)])
def test_the_norm_on_the_flag_equals_the_plain_pair(M, cfg):
    weight, x, a, post, pre, scale = _operands(M)
    flag = arrival_flag(x.device)
    y0 = mma_w4a16(x, weight, config=cfg)
    h0, x0 = residual_norm(a, y0, post, scale, pre, eps=1e-6)
    for _ in range(2):  # the second pair finds the words the first left
        y = mma_w4a16(x, weight, config=cfg, flag=True)
        assert flag.tolist() == [0, 1, 0]  # every arrival counted and reset, the flag up
        h, xn = residual_norm(a, y, post, scale, pre, eps=1e-6, flag=True)
        assert flag.tolist() == [0, 0, 0]
        assert torch.equal(y, y0) and torch.equal(h, h0) and torch.equal(xn, x0)


def test_refusals():
    weight, x, a, post, pre, _ = _operands(2)
    with pytest.raises(ValueError, match="without y there is none"):
        residual_norm(a, pre=pre, eps=1e-6, flag=True)
    with pytest.raises(ValueError, match="the CUDA entry has none"):
        mma_w4a16(x, weight, config=MmaConfig(1, 4, 2, cuda=True), flag=True)


_BUILD = r'''
from sm90_compile import build
from fastgemma.kernels.mma_w4a16 import _mma_stream_kernel, _mma_w4a16_kernel
from fastgemma.kernels.residual_norm import _residual_norm_kernel

nsig = {n: "*bf16" for n in ("a_ptr", "y_ptr", "post_ptr", "scale_ptr", "pre_ptr", "h_ptr", "x_ptr")}
nsig.update(flag_ptr="*i32", stride_a="i32", stride_y="i32", stride_h="i32", stride_x="i32", eps="fp32", off="fp32")
for flag in (False, True):
    ce = dict(K=2560, BLOCK=4096, HAS_Y=True, HAS_SCALE=False, HAS_PRE=True, PDL=True, EARLY=False, FLAG=flag)
    ptx, regs, spills = build(_residual_norm_kernel, nsig, ce, (0, 1, 2, 4, 5, 6, 7), 8)
    print(f"norm\t{flag}\t{ptx.count('griddepcontrol.wait')}\t{ptx.count('ld.global.gpu.acquire')}\t{spills}")
sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "sz_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
       "M": "i32", "N": "i32", "HALF": "i32", "stride_xm": "i32", "stride_om": "i32", "NPT": "i32",
       "flag_ptr": "*i32"}
for name, T, W, S in [("down split-K", 1, 1, 8), ("PLE projection", 1, 1, 1)]:
    ce = dict(K=10240 if S > 1 else 256, GROUP=128, T=T, W=W, EPI=0, DEPTH=64, ITERS=1, S=S, PDL=True, EMU=False,
              FLAG=True)
    ptx, regs, spills = build(_mma_w4a16_kernel, sig, ce, (0, 1, 2, 3, 4, 5), W)
    print(f"gemm\t{name}\t{ptx.count('gpu.acq_rel.add')}\t{ptx.count('gpu.release.exch')}\t{spills}")
ssig = {k: v for k, v in sig.items() if k not in ("ws_ptr", "cnt_ptr")}
ssig["NITER"] = "i32"
ce = dict(K=2048, GROUP=128, T=2, W=4, EPI=0, DEPTH=5, FRESH=True, PDL=True, EMU=False, ONE=True, NS=0, FLAG=True)
ptx, regs, spills = build(_mma_stream_kernel, ssig, ce, (0, 1, 2, 3), 8)
print(f"gemm\to persistent\t{ptx.count('gpu.acq_rel.add')}\t{ptx.count('gpu.release.exch')}\t{spills}")
'''


def test_sm90_build_waits_on_the_flag_not_the_grid():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = Path(__file__).parent
    env["PYTHONPATH"] = os.pathsep.join([str(tests), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split("\t") for line in r.stdout.splitlines()]
    norm = {row[1]: row[2:] for row in rows if row[0] == "norm"}
    assert norm["False"][:2] == ["1", "0"] and norm["True"][0] == "0" and int(norm["True"][1]) >= 1, norm
    gemms = [row for row in rows if row[0] == "gemm"]
    assert len(gemms) == 3, rows
    for row in gemms + [["norm", "", *norm["True"]]]:
        assert row[-1] == "0", f"spills: {row}"
    for _, name, arrive, release, _ in gemms:
        assert int(arrive) >= 1 and int(release) >= 1, (name, arrive, release)


def test_invariant_steps_on_the_flag_equal_the_plain_steps(monkeypatch, wide_tiles):
    """bf16, int4 g64 (o persistent, down split over K, the PLE projection one tile a program), batch_invariant: the
    one-row step and a 4-row verify pass with flag_wait give the same hidden states as without it, bit for bit
    (the same kernels and sums; only what the norms wait on changes), every norm after those GEMMs waits on
    the flag (o, down and the PLE projection of each layer: 3 a layer), and the flag's words end at zero."""
    import dataclasses

    import fastgemma.kernels.mma_table as mma_table
    import fastgemma.kernels.residual_norm as rn_mod
    from conftest import TINY
    from fastgemma.engine.cache import KVCache
    from fastgemma.engine.generator import Generator
    from fastgemma.kernels.decode_attention import decode_attention_op
    from fastgemma.model.config import FULL, SLIDING
    from fastgemma.transforms.fuse_layers import FuseLayers
    from fastgemma.transforms.fused_layer_ops import _layer_linears
    from fastgemma.transforms.quant import Int4Linear, Int4Quant
    from fastgemma.weights.synthetic import synthetic_model

    cfg = dataclasses.replace(TINY, hidden_size=128, intermediate_size=256, ple_dim=64, num_layers=4,
                              num_kv_shared_layers=2, layer_types=(SLIDING, FULL) * 2)
    model = synthetic_model(cfg, "cpu", torch.bfloat16, seed=5)
    model.step_attention = decode_attention_op
    FuseLayers(backend="triton").apply(model)
    Int4Quant(group_size=64, skip=("per_layer_input_gate",), backend="triton").apply(model)
    configs = {"o": MmaConfig(2, 1, 2, persist=1, fresh=True), "down": MmaConfig(1, 1, splits=2),
               "ple_proj": MmaConfig(1, 1), "gate_up": MmaConfig(2, 1), "in": MmaConfig(1, 2)}
    for i, layer in enumerate(model.layers):
        for name, m in _layer_linears(i, layer).items():
            if isinstance(m, Int4Linear):
                monkeypatch.setitem(mma_table.MMA_CONFIGS, (m.out_features, m.in_features, False), configs[name])
    steps = {}
    for flag in (False, True):
        t = FuseLayers(backend="triton", int4_mma=True, qkv_kernel=True, batch_invariant=True, flag_wait=flag)
        t.apply(model)
        t.validate(model)
        assert t.describe()["flag_wait"] is flag
        steps[flag] = model.fused_decode, model.fused_verify
    waits = []
    real = rn_mod.residual_norm
    monkeypatch.setattr(rn_mod, "residual_norm", lambda *a, **k: waits.append(k.get("flag", False)) or real(*a, **k))
    prompt, toks = torch.tensor([list(range(5, 25))]), torch.tensor([[40, 41, 42, 43]])
    P, L = prompt.shape[1], cfg.num_layers
    flag_words = arrival_flag(torch.device("cpu"))
    outs = {}
    for flag, (decode, verify) in steps.items():
        model.fused_decode, model.fused_verify = decode, verify
        cache = KVCache(cfg, 1, 64, dtype=torch.bfloat16)
        Generator(model, cache, prefill_chunk=32).prefill(prompt)
        waits.clear()
        one = model.step(toks[:, :1], torch.tensor([[P]]), cache)
        assert waits.count(True) == (3 * L if flag else 0), waits
        wide = model.step(toks, torch.arange(P, P + 4)[None], cache)
        assert waits.count(True) == (6 * L if flag else 0), waits
        assert flag_words.tolist() == [0, 0, 0]
        outs[flag] = one, wide
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    with pytest.raises(ValueError, match="needs fuse.int4_mma=true"):
        FuseLayers(backend="triton", flag_wait=True)
