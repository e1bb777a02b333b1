"""quant=int8 (W8A16, a scale per output row): the Triton path (the int8 row kernel under the CPU interpreter)
against its torch twin on odd shapes, one and several rows; the quantization's error bound; the transform on
the tiny model (layers swapped, skip patterns, bytes, the scales fp32 through dtype casts); the op's schema
for torch.compile; the CLI with quant=int8 (merged, and the fused one-row step), and fuse.batch_invariant
refusing it in one line.

The interpreter computes tl.dot on bf16 wrongly, so several rows run fp32 / fp16; one row (no tl.dot) runs bf16.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest
import torch
import torch.nn as nn

from fastgemma.kernels.w8a16 import quantize_int8_rows, w8a16_matmul, w8a16_matmul_op, w8a16_torch
from fastgemma.transforms.quant_int8 import Int8Linear, Int8Quant

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative to the output's scale


def _operands(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    q, s = quantize_int8_rows(w)
    return torch.randn(M, K, generator=g).to(dtype), q, s, w


@pytest.mark.parametrize("M,dtype", [(1, torch.bfloat16), (1, torch.float32), (3, torch.float32),
                                     (3, torch.float16)])
@pytest.mark.parametrize("N,K", [(203, 72), (40, 70), (64, 256)])  # K = 70: no int32 words (element loads)
def test_triton_matches_the_twin(M, dtype, N, K):
    x, q, s, _ = _operands(M, N, K, dtype)
    got, ref = w8a16_matmul(x, q, s), w8a16_torch(x, q, s)
    assert got.dtype == dtype and got.shape == (M, N)
    scale = ref.float().abs().max()
    assert ((got.float() - ref.float()).abs().max() / scale) < TOL[dtype]


def test_quantization_error_is_half_a_step_per_row():
    x, q, s, w = _operands(2, 96, 128, torch.float32)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and int(q.abs().max()) <= 127
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()
    q0, s0 = quantize_int8_rows(torch.zeros(3, 8))  # an all-zero row: codes 0, a usable scale
    assert not q0.any() and (s0 > 0).all()
    # the layer's output against the float one: within the codes' error
    err = (w8a16_torch(x, q, s) - x @ w.T).abs().max()
    assert err < (x.abs().sum(-1).max() * s.max() / 2)


def test_operands_are_checked():
    x, q, s, _ = _operands(1, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="same K"):
        w8a16_torch(x[:, :16], q, s)
    with pytest.raises(ValueError, match="must be int8"):
        w8a16_matmul(x, q.float(), s)
    with pytest.raises(ValueError, match=r"scales must be fp32 \[N\]"):
        w8a16_torch(x, q, s.half())
    with pytest.raises(ValueError, match="int8 backend must be one of"):
        Int8Linear(32, 16, backend="cuda")


def test_the_op_passes_the_schema_and_fake_tensor_checks():
    x, q, s, _ = _operands(1, 48, 64, torch.float32)
    torch.library.opcheck(w8a16_matmul_op, (x, q, s), test_utils=("test_schema", "test_faketensor"))


def test_linear_from_nn_linear_both_backends_and_casts():
    lin = nn.Linear(64, 40, bias=True)
    x = torch.randn(2, 3, 64)
    mods = {b: Int8Linear.from_linear(lin, b) for b in ("triton", "torch")}
    ref = lin(x)
    for b, m in mods.items():
        y = m(x)
        assert y.shape == (2, 3, 40)
        assert (y - ref).abs().max() < 0.02 * ref.abs().max(), b
    assert torch.allclose(mods["triton"](x[0, :1]), mods["torch"](x[0, :1]), rtol=1e-5, atol=1e-6)
    scales = mods["torch"].scales.clone()
    m = mods["torch"].to(torch.bfloat16)
    assert m.scales.dtype == torch.float32 and m.qweight.dtype == torch.int8 and m.bias.dtype == torch.bfloat16
    assert torch.equal(m.scales, scales)  # not rounded through bf16 on the way
    from fastgemma.transforms.lm_head import Int8Rows  # the int8 head rows keep theirs the same way

    rows = Int8Rows.from_weight(lin.weight.detach(), 100, 30.0)
    scales = rows.scales.clone()
    assert rows.to(torch.bfloat16).scales.dtype == torch.float32 and torch.equal(rows.scales, scales)
    assert m.weight_bytes() == 40 * 64 + 40 * 4
    m.set_backend("triton")
    assert m.backend == "triton" and "backend=triton" in repr(m)


def test_transform_on_the_tiny_model():
    from fastgemma.model.config import preset
    from fastgemma.weights.synthetic import synthetic_model

    cfg = preset("gemma4_tiny")
    model = synthetic_model(cfg, "cpu", torch.float32, seed=0)
    dense = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)
                and m.weight is not model.embed_tokens.weight)
    t = Int8Quant(skip=("per_layer_input_gate",), backend="torch")
    model = t.apply(model)
    info = t.describe()
    lins = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert info["quant"] == "int8" and info["quantized_layers"] == len(lins) > 0
    assert all("per_layer_input_gate" in n for n in info["skipped"] if "embed" not in n) and info["skipped"]
    assert info["weight_bytes"] == sum(m.weight_bytes() for m in lins)
    assert info["quantized_params"] + sum(m.weight.numel() for n, m in model.named_modules()
                                          if isinstance(m, nn.Linear) and n in info["skipped"]) == dense
    with pytest.warns(UserWarning, match="matches no nn.Linear"):
        Int8Quant(skip=("no_such_layer",), backend="torch").apply(synthetic_model(cfg, "cpu", torch.float32))


def test_cli_runs_int8_merged_and_fused_and_refuses_batch_invariant(tmp_path, capsys):
    from fgcli_helpers import TINY, results, run_job

    base = TINY + ["quant=int8", "quant.backend=torch", "workload.num_prompts=1", "workload.warmup=0"]
    for fuse in (["fuse=merged"], ["fuse=layers", "fuse.backend=torch"]):
        rec = run_job(base + fuse, tmp_path)
        assert rec["status"] == "ok", rec["error"]
        assert rec["choices"]["quant"] == "int8" and rec["metrics"]["tps"] > 0
    with pytest.raises(SystemExit):
        run_job(base + ["fuse=layers", "fuse.backend=torch", "fuse.batch_invariant=true", "fuse.qkv_kernel=true"],
                tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fuse.batch_invariant has no int8 form" in err[0], err
    assert results(tmp_path)[-1]["status"] == "error"
