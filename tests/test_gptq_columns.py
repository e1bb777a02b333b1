"""GPTQ's column loop as one Triton launch a block (kernels/gptq_columns.py) against its torch twin: bit for bit
under the interpreter, alone and inside gptq_int4; and its sm_90a build keeps the twin's roundings."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastgemma.kernels import gptq_columns as gc
from fastgemma.transforms import gptq


def _upper(B: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(B, B, generator=g)
    H = A @ A.T / B + 0.05 * torch.eye(B)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).contiguous()


def _run(fn, W, U, S, Z, j0, j1):
    W1, Q, E = W.clone(), torch.zeros(W.shape, dtype=torch.uint8), torch.zeros_like(W)
    fn(W1, U, S, Z, j0, j1, Q, E)
    return W1, Q, E


@pytest.mark.parametrize("N,B,j0,j1,shared", [(37, 128, 0, 128, False), (37, 96, 32, 64, True),
                                              (16, 128, 96, 128, True), (5, 64, 0, 64, False)])
def test_the_kernel_is_the_twin_bit_for_bit(N, B, j0, j1, shared):
    """Odd row counts (a program's rows past N masked), a block narrower than its power of two, a group in the
    middle of the block (the columns before it untouched, the ones after it updated), one scale row for the
    group (stride 0) or one per column, a constant group (scale 0: code 0)."""
    g = torch.Generator().manual_seed(N + B + j0)
    W = torch.randn(N, B, generator=g)
    U = _upper(B, seed=j1)
    if shared:
        S = (torch.rand(N, generator=g) * 0.3)[None, :].expand(j1 - j0, N)
        Z = (-torch.rand(N, generator=g))[None, :].expand(j1 - j0, N)
    else:
        S, Z = torch.rand(j1 - j0, N, generator=g) * 0.3, -torch.rand(j1 - j0, N, generator=g)
        S[3, : N // 2] = 0
    want, got = _run(gc.columns_torch, W, U, S, Z, j0, j1), _run(gc.columns_triton, W, U, S, Z, j0, j1)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    Q = got[1]
    assert Q[:, j0:j1].float().std() > 1 and not Q[:, :j0].any() and not Q[:, j1:].any()
    assert torch.equal(got[0][:, :j0], W[:, :j0])
    if j1 < B:  # the columns after the group took its errors
        assert (got[0][:, j1:] != W[:, j1:]).float().mean() > 0.9


@pytest.mark.parametrize("G,act_order", [(32, False), (32, True), (128, False), (64, True)])
def test_gptq_int4_through_the_kernel_gives_the_twins_codes(monkeypatch, G, act_order):
    """Two blocks of columns (the second on the first's carried errors), static groups in the act-order
    permutation or ranges taken as each group starts: the same codes, scales and zeros either way."""
    g = torch.Generator().manual_seed(G)
    N, K = 24, 256
    w = torch.randn(N, K, generator=g)
    X = torch.randn(512, K, generator=g) * torch.linspace(0.2, 3, K)
    H = X.T @ X / X.shape[0]
    want = gptq.gptq_int4(w, H, G, act_order=act_order)
    monkeypatch.setattr(gptq, "columns", gc.columns_triton)
    got = gptq.gptq_int4(w, H, G, act_order=act_order)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_the_kernel_refuses_a_strided_block():
    W = torch.randn(8, 64).t()  # [64, 8], column-major
    with pytest.raises(ValueError, match="contiguous along their last dim"):
        gc.columns_triton(W, _upper(8, 0), torch.ones(8, 64), torch.zeros(8, 64), 0, 8,
                          torch.zeros(64, 8, dtype=torch.uint8), torch.zeros(64, 8))


_SM90 = r'''
import re, sys, tempfile
sys.path.insert(0, "tests")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sm90_compile import _ptxas
from fastgemma.kernels import gptq_columns as gc

sig = {"W": "*fp32", "U": "*fp32", "S": "*fp32", "Z": "*fp32", "Q": "*u8", "E": "*fp32", "N": "i32", "B": "i32",
       "sw": "i32", "su": "i32", "ss": "i32", "sq": "i32", "se": "i32"}
ce = dict(J0=0, J1=128, BN=gc.ROWS, BB=128)
for name, fusion in (("shipped", gc.OPTIONS["enable_fp_fusion"]), ("fused", True)):
    src = ASTSource(gc._columns, dict(sig, **{k: "constexpr" for k in ce}), constexprs=ce)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(gc.OPTIONS, enable_fp_fusion=fusion)).asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", _ptxas(ptx, d).stderr))
    counts = [len(re.findall(p, ptx)) for p in (r"fma\.rn\.f32", r"div\.rn\.f32", r"div\.(full|approx)",
                                                r"add\.rn\.f32\s+%r\d+, %r\d+, 0f4B400000",
                                                r"add\.rn\.f32\s+%r\d+, %r\d+, 0fCB400000")]
    print("\t".join([name] + [str(c) for c in counts + [spills]]))
'''


def test_the_sm90_build_keeps_the_twins_roundings():
    """The launch's options on sm_90a: no fused multiply-add (the twin rounds a * b, then + c), IEEE divisions,
    the round-half-even pair (+ 1.5 * 2^23, then - 1.5 * 2^23) not folded away, no spills. With fusion on,
    fmas appear: the check can fail."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _SM90], env=env, capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {f[0]: [int(x) for x in f[1:]] for f in (line.split("\t") for line in r.stdout.splitlines())}
    fma, div_rn, div_approx, up, down, spills = rows["shipped"]
    assert fma == 0 and div_rn > 0 and div_approx == 0 and up == down > 0 and spills == 0, rows
    assert rows["fused"][0] > 0, rows
