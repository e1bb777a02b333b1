"""ple=table: each id's per-layer inputs built once (transforms/ple.py) against the model's own per-token
computation: the same inputs, the same tokens, W_plm's bytes gone from the step."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY
from fgcli_helpers import TINY as CLI_TINY, run_job
from fastgemma.metrics.memory import weight_bytes_per_step
from fastgemma.transforms.ple import PleTable, build_ple_table
from fastgemma.weights.synthetic import synthetic_model


def _pair(dtype=torch.float32, cfg=TINY):
    return synthetic_model(cfg, "cpu", dtype, seed=3), synthetic_model(cfg, "cpu", dtype, seed=3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_the_table_holds_what_embed_computes(dtype, tol):
    ref, model = _pair(dtype)
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    x_ref, p_ref = ref.embed(ids)
    assert PleTable(chunk=100).apply(model) is model  # 100 does not divide the vocabulary
    x, p = model.embed(ids)
    assert torch.equal(x, x_ref) and p.shape == p_ref.shape and p.dtype == p_ref.dtype
    # one GEMM's sums in place of the per-call projection's: equal up to the dtype's rounding
    assert torch.allclose(p.float(), p_ref.float(), rtol=tol, atol=tol * p_ref.float().abs().max().item())
    assert model.ple_from_table and model.per_layer_model_projection is None and model.per_layer_projection_norm is None


def test_chunking_does_not_change_the_table():
    a, b = _pair()
    build_ple_table(a, chunk=7)
    build_ple_table(b, chunk=TINY.vocab_size)
    assert torch.allclose(a.embed_tokens_per_layer.weight, b.embed_tokens_per_layer.weight, rtol=0, atol=1e-6)


def test_the_step_reads_no_projection_and_one_table_row():
    ref, model = _pair()
    PleTable().apply(model)
    w_plm = TINY.hidden_size * TINY.num_layers * TINY.ple_dim * 4 + TINY.ple_dim * 4  # W_plm and its norm, fp32
    assert weight_bytes_per_step(ref) - weight_bytes_per_step(model) == w_plm


def test_a_model_without_ple_is_left_as_it_is():
    cfg = dataclasses.replace(TINY, ple_dim=0)
    model = synthetic_model(cfg, "cpu", torch.float32, seed=3)
    t = PleTable()
    t.apply(model)
    assert not model.ple_from_table and t.describe() == {"ple": "table", "chunk": 2048, "rows": 0}


def test_the_fused_steps_embedding_is_the_gather_at_every_row_count():
    """fuse=layers' `_embed` under int4_mma / batch_invariant would launch the projection's kernels: with the table
    there is no projection, and every flag combination gives model.embed's rows."""
    from fastgemma.transforms.fused_layer_ops import _embed

    _, model = _pair()
    PleTable().apply(model)
    ids = torch.randint(0, TINY.vocab_size, (1, 5))
    want = model.embed(ids)
    for invariant, mma in ((True, False), (False, True), (True, True)):
        x, p = _embed(model, ids, invariant, True, False, mma)
        assert torch.equal(x, want[0]) and torch.equal(p, want[1])


def test_bad_chunk_is_refused():
    with pytest.raises(ValueError, match="ple.chunk must be a positive integer"):
        PleTable(chunk=0)


def test_greedy_tokens_equal_the_computed_inputs(tmp_path):
    """task=identity against plain eager AR (ple=project, weights as loaded): the same tokens (fp32)."""
    rec = run_job(CLI_TINY + ["task=identity", "ple=table", "ple.chunk=100"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["metrics"]["identity_rate"] == 1.0 and rec["metrics"]["top1_agree"] == 1.0
    assert rec["details"]["parts"]["ple"] == {"ple": "table", "chunk": 100, "rows": TINY.vocab_size}
    assert rec["choices"]["ple"] == "table"


@pytest.mark.filterwarnings("ignore:Int4Quant. skip pattern 'per_layer_model_projection' matches no nn.Linear")
def test_the_fused_int4_stack_decodes_the_same_tokens_from_the_table(tmp_path):
    """fuse=layers + int4 + window 128 (CPU twins), W_plm left dense in both (a table comes from W_plm as loaded):
    ple=table and ple=project generate the same ids."""
    stack = ["task=generate", "task.ids=[2,17,301,45,9,88,120,7]", "task.max_new_tokens=24", "fuse=layers",
             "fuse.backend=torch", "quant=int4", "quant.backend=torch", "quant.group_size=32",
             "quant.skip=[per_layer_input_gate,per_layer_projection,per_layer_model_projection]", "graphs=static",
             "window=w128"]
    out = {ple: run_job(CLI_TINY + stack + [f"ple={ple}"], tmp_path, ple)["details"]["output_ids"]
           for ple in ("project", "table")}
    assert len(out["table"]) == 24 and out["table"] == out["project"]


def test_the_table_gather_is_one_opaque_op_under_compile():
    """Traced, the gather stays one op (kernels/gather_rows.py) whose output every layer's PLE gate reads: left to
    inductor, each layer's slice of a plain embedding became a launch of its own (run LI)."""
    _, model = _pair()
    PleTable().apply(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, TINY.vocab_size, (1, 1))
    x, p = torch.compile(lambda i: model.embed(i), backend=backend, fullgraph=True)(ids)
    want = model.embed(ids)
    assert torch.equal(x, want[0]) and torch.equal(p, want[1])
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fastgemma.gather_rows.default) == 1, targets


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (5,)])
@pytest.mark.parametrize("D", [96, 4096 + 904])
def test_the_gather_kernel_copies_the_rows(shape, D):
    """kernels/gather_rows.py's launch (the op's CUDA path; the interpreter here) against F.embedding: the same
    values, rows of any width (chunks of 4,096 and a masked tail), int64 and int32 ids."""
    from fastgemma.kernels.gather_rows import gather_rows_triton

    w = torch.randn(40, D).bfloat16()
    ids = torch.randint(0, 40, shape)
    for i in (ids, ids.int()):
        got = gather_rows_triton(w, i)
        assert got.shape == (*shape, D) and torch.equal(got, torch.nn.functional.embedding(ids, w))
    with pytest.raises(ValueError, match="rows contiguous"):
        gather_rows_triton(w.t(), ids)
    with pytest.raises(ValueError, match="ids must be integers"):
        gather_rows_triton(w, ids.float())
