"""bench.gptq on the CPU: its shapes are the ones Int4Quant rounds in a merged model, and both column loops (the
kernel under the interpreter) give the same codes on each, the table summing the model's linears."""
from collections import Counter

import pytest
import torch

from fastgemma.bench import gptq as bg
from fastgemma.kernels import gptq_columns
from fastgemma.model.config import GEMMA4_E4B
from fastgemma.transforms.fuse import MergeProjections
from fastgemma.transforms.quant import _select
from fastgemma.weights.synthetic import synthetic_model

from test_gptq import TINY


def test_the_shapes_are_the_linears_int4quant_rounds():
    model = MergeProjections().apply(synthetic_model(TINY, "cpu", torch.float32, seed=0))
    targets, _ = _select(model, ["per_layer_input_gate"], "test")
    got = Counter((name.rsplit(".", 1)[-1], *mod.weight.shape) for name, mod in targets)
    assert got == bg.linear_shapes(TINY)
    e4b = bg.linear_shapes(GEMMA4_E4B)
    assert sum(e4b.values()) == 211  # the CLI's count on E4B (run KL)
    assert e4b[("down_proj", 2560, 10240)] == 42 and e4b[("per_layer_model_projection", 42 * 256, 2560)] == 1


def _wrong(W1, U1, S1, Z1, j0, j1, Q1, E1):
    gptq_columns.columns_torch(W1, U1, S1, Z1, j0, j1, Q1, E1)
    Q1[0, j0] = 15 - Q1[0, j0]


def test_every_shape_is_timed_and_its_codes_compared(capsys):
    """The twin against itself and against a loop that gets one code wrong (the kernel against the twin is
    tests/test_gptq_columns.py's, under the interpreter)."""
    loops = {"torch": gptq_columns.columns_torch, "again": gptq_columns.columns_torch}
    rows = bg.bench_gptq(TINY, tokens=64, group_size=32, device="cpu", loops=loops)
    assert {(r["kind"], r["N"], r["K"]) for r in rows} == set(bg.linear_shapes(TINY))
    assert all(r["codes_equal"] and r["torch_s"] > 0 and r["again_s"] > 0 for r in rows)
    text = bg.table(rows, list(loops))
    assert f"the model's {sum(bg.linear_shapes(TINY).values())} linears" in text.splitlines()[-1]
    assert text.splitlines()[-1].endswith("| True |")
    bad = bg.bench_gptq(TINY, tokens=64, group_size=32, device="cpu",
                        loops={"torch": gptq_columns.columns_torch, "wrong": _wrong})
    assert not any(r["codes_equal"] for r in bad)


def test_it_refuses_a_gpu_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        bg.main([])


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit, match="does not divide the K of gemma4_tiny's per_layer_projection"):
        bg.main(["--model", "gemma4_tiny", "--device", "cpu", "--group-size", "32"])
    with pytest.raises(SystemExit, match="unknown model preset 'gemma5'"):
        bg.main(["--model", "gemma5", "--device", "cpu"])
