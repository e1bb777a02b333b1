"""The GPU benchmark entries' logic on the CPU: helpers with exact expectations, and a tiny-model
smoke run of the entries that can run on torch twins (so they cannot rot between GPU runs)."""
import json

import pytest
import torch

from fastgemma.bench.profile import group_of
from fastgemma.metrics.identity import top1_agreement


def test_profile_groups_kernel_names():
    assert group_of("_split_kernel") == group_of("_combine_kernel") == "attention"  # split-KV + combine
    assert group_of("_dense_gemv_kernel") == group_of("_fused_gemv_kernel") == "bf16 gemv (ours)"
    assert group_of("_gemv_kernel") == group_of("_fused_w4a16_kernel") == group_of("_group_mma_kernel") == "int4 gemv"
    assert group_of("nvjet_sm90_tst_192x8_64x8_4x1_v_bz_TNT") == "gemv/gemm (cuBLAS)"
    assert group_of("triton_red_fused__to_copy_add_mean_mul_pow_10") == "fused elementwise / reductions"
    assert group_of("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps>>") == "head argmax"


def test_agree_counts_flips_and_confident_positions():
    ref = torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.95, 0.0], [0.0, 2.0, 1.0]])
    got = torch.tensor([[2.0, 1.0, 0.0], [0.9, 1.0, 0.0], [0.0, 1.0, 1.5]])  # rows 1 and 2 flip
    # reference margins: 2.0, 0.05, 1.0
    r = top1_agreement(ref, got, 0.1)
    assert abs(r["top1"] - 1 / 3) < 1e-6
    assert r["confident_positions"] == 2 and r["top1_confident"] == 0.5  # row 2 is confident and flipped
    assert r["worst_flipped_margin"] == 1.0 and r["max_abs_diff"] == 1.0
    # a pruned head's unkept rows are -inf on both sides: no difference; -inf against a logit is one
    inf = float("-inf")
    pruned = torch.tensor([[3.0, inf, 0.5]])
    assert top1_agreement(pruned, torch.tensor([[2.5, inf, 0.5]]))["max_abs_diff"] == 0.5
    assert top1_agreement(pruned, torch.tensor([[3.0, 1.0, 0.5]]))["max_abs_diff"] == float("inf")


def test_agreement_and_ladder_run_on_the_cpu(tmp_path, capsys):
    from fastgemma.bench import agreement, ladder

    out = tmp_path / "agreement.jsonl"
    agreement.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompt-len", "12", "--new", "6",
                    "--variants", "eager,static_torch", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["eager", "static_torch"]
    assert all(0.0 <= r["top1"] <= 1.0 and r["vs"] == "fp32" for r in rows)
    assert "top1_vs_eager" in rows[1]
    out = tmp_path / "ladder.jsonl"
    ladder.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "6",
                 "--variants", "eager,static_torch", "--hf-new", "0", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["variant"] == "eager" and rows[0]["identity_rate"] == 1.0 and rows[0]["top1_agree"] == 1.0
    assert rows[-1]["variant"] == "transformers" and "max_abs_diff" in rows[-1], rows[-1]
    assert "| static_torch |" in capsys.readouterr().out


def test_chain_has_every_body_gemv_of_a_step_in_order():
    from fastgemma.bench.chain import chain_shapes, run_chain
    from fastgemma.model.config import preset

    cfg = preset("gemma4_e4b")
    shapes = chain_shapes(cfg)
    assert len(shapes) == 42 * 6
    assert shapes[:6] == [("qkv", 3072, 2560), ("o", 2560, 2048), ("gate|up", 20480, 2560),
                          ("down", 2560, 10240), ("ple_gate", 256, 2560), ("ple_proj", 2560, 256)]
    assert shapes[5 * 6][:2] == ("qkv", 6144)  # layer 5: full attention, head_dim 512
    assert shapes[-6][:2] == ("q", 4096)       # layer 41: KV-shared full layer, q only
    # every GEMV's K fits in the previous one's output (the chain slices it)
    assert all(k <= prev_n for (_, prev_n, _), (_, _, k) in zip(shapes[-1:] + shapes, shapes))
    # the chain is the body: every body weight of the model except W_plm (embedding side)
    body = sum(n * k for _, n, k in shapes)
    assert body == 3_945_267_200
    ws = [torch.randn(n, k, dtype=torch.float64) for n, k in [(6, 4), (3, 5), (2, 3)]]
    x0 = torch.randn(1, 4, dtype=torch.float64)
    ref = ((x0 @ ws[0].T)[:, :5] @ ws[1].T) @ ws[2].T
    assert torch.allclose(run_chain(ws, x0, torch.nn.functional.linear), ref)


def test_ladder_fused_variants_on_the_cpu(tmp_path):
    """The fused variants' setup on the CPU (twins, no compile here): apply_variant installs the fused
    one-row step for dense and int4 bodies and removes it for the others."""
    from fastgemma.bench.ladder import VARIANTS, apply_variant
    from fastgemma.model.config import GEMMA4_TINY
    from fastgemma.weights.synthetic import synthetic_model

    model = synthetic_model(GEMMA4_TINY, "cpu", torch.float32, seed=0)
    state = {}
    apply_variant(model, "compiled_triton_fused_pdl", state)
    assert model.fused_decode is not None and model.fused_decode.keywords["pdl"] is True
    assert model.fused_decode.keywords["attn_pdl"] is False
    apply_variant(model, "compiled_triton_fused_all", state)  # + the attention's PDL (the q/k/v kernel: triton only)
    kw = model.fused_decode.keywords
    assert (kw["pdl"], kw["attn_pdl"], kw["qkv_kernel"]) == (True, True, False)
    assert model.fused_verify.keywords["attn_pdl"] is True
    apply_variant(model, "compiled_triton_merged_gemv", state)
    assert model.fused_decode is None and model.fused_verify is None
    assert VARIANTS["compiled_triton_fused_int4"][4] and VARIANTS["compiled_triton_fused_int4"][6] == "layers"
    state["int4"] = True  # (E4B's group 128 does not divide the tiny model's PLE projection: its body stays dense)
    apply_variant(model, "compiled_triton_fused_int4_mma", state)  # then FuseLayers.validate: the mma copies
    kw = model.fused_decode.keywords
    assert (kw["pdl"], kw["attn_pdl"]) == (True, True) and VARIANTS["compiled_triton_fused_int4_mma"][4]


def _kernel(name, start, dur, grid=(1, 1, 1)):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur,
            "args": {"grid": list(grid), "block": [128, 1, 1], "registers per thread": 96}}


def test_timeline_charges_each_kernel_its_share_of_the_critical_path(capsys):
    """bench.timeline on a hand-made trace of two calls: kernels in start order, split per call; a
    kernel hidden under its predecessor costs nothing, one that overlaps costs its tail, a late start
    is charged its idle gap; the incs add up to the span; groups by (name, grid), sorted by inc."""
    from fastgemma.bench.timeline import charge, group, kernels_from_trace, print_groups, span, split_calls, summarize

    one = [("a", 0, 10), ("b", 5, 3), ("c", 8, 6, (2, 1, 1)), ("a", 16, 4)]  # b hidden, c overlaps 2, a waits 2
    events = [_kernel(n, t0 + s, d, *g) for t0 in (100, 0) for n, s, d, *g in one]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 50})  # not a kernel
    ks = kernels_from_trace({"traceEvents": events})
    assert [k["name"] for k in ks] == ["a", "b", "c", "a"] * 2 and ks[0]["grid"] == (1, 1, 1) and ks[0]["regs"] == 96
    calls = [charge(c) for c in split_calls(ks, 2)]
    assert [(k["inc"], k["gap"], k["overlap"]) for k in calls[0]] == [
        (10, 0, 0), (0, 0, 3), (4, 0, 2), (6, 2, 0)]
    assert span(calls[0]) == 20 == calls[0][-1]["t"] + calls[0][-1]["dur"]
    rows = group(calls)
    assert [(r["name"], r["grid"], r["n"], r["dur_us"], r["inc_us"], r["gap_us"]) for r in rows] == [
        ("a", [1, 1, 1], 2, 14, 16, 2), ("c", [2, 1, 1], 1, 6, 4, 0), ("b", [1, 1, 1], 1, 3, 0, 0)]
    s = summarize(calls, top=2)
    assert s["kernels"] == 4 and s["span_us"] == 20 and s["kernel_us"] == 23 and s["gap_us"] == 2
    assert len(s["groups"]) == 2 and [k["inc"] for k in s["kernels_of_median_call"]] == [10, 0, 4, 6]
    print_groups(s, "hand-made")
    assert "| a | 1x1x1 | 2 | 14.0 | 16.0 | 2.0 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="do not split into 3 equal calls"):
        split_calls(ks, 3)
    with pytest.raises(ValueError, match="calls must be >= 1"):
        split_calls(ks, 0)


def test_fused_tables_name_the_drafters_gemvs_in_draft_loop_and_spec():
    """The drafter's fused GEMVs by name (fused_gemv.FUSED_CASES 'draft ...': its down and its full
    layer's o one shape), for bench.draft_loop and bench.spec --fused-table; a bad entry refused by
    either before any work (no GPU needed for the refusal)."""
    from fastgemma.bench import draft_loop, spec
    from fastgemma.kernels import fused_gemv
    from fastgemma.kernels.gemv import GemvConfig

    t = fused_gemv.parse_fused_table("draft_down=2x1024w4,draft_o=4x512w4,draft_pre-projection=2x1024w4")
    assert t == {(256, 2048, False, "none"): GemvConfig(2, 1024, 4), (256, 1024, False, "none"): GemvConfig(4, 512, 4),
                 (256, 5120, False, "none"): GemvConfig(2, 1024, 4)}
    plus = fused_gemv.parse_fused_table("+draft_gate|up=4x256w2,draft_q=2x256w2")  # one pinned, one not
    assert plus[(4096, 256, True, "geglu")] == GemvConfig(4, 256, 2) and len(plus) == len(fused_gemv.FUSED_CONFIGS) + 1
    assert plus[(1024, 256, True, "none")] == GemvConfig(2, 256, 2)
    shipped = dict(fused_gemv.FUSED_CONFIGS)
    for main in (draft_loop.main, lambda argv: spec.main(["--device", "cpu", "--model", "gemma4_tiny"] + argv)):
        with pytest.raises(SystemExit, match="--fused-table: fused table entry 'draft_nope=2x1024w4'"):
            main(["--fused-table", "draft_nope=2x1024w4"])
    assert fused_gemv.FUSED_CONFIGS == shipped and not fused_gemv._FORCED[0]


def test_fused_table_text_and_bench_stack_rows_per_table(tmp_path):
    """kernels/fused_gemv's table from text (bench.stack --fused-table): names, tiles, refusals; one
    row set per table in one process, the shipped table back afterwards."""
    from fastgemma.bench import stack
    from fastgemma.kernels import fused_gemv
    from fastgemma.kernels.gemv import GemvConfig

    assert fused_gemv.parse_fused_table("PLE_gate=2x1024w4, o=1x1024w4") == {
        (256, 2560, True, "gelu_mul"): GemvConfig(2, 1024, 4), (2560, 2048, False, "none"): GemvConfig(1, 1024, 4)}
    assert fused_gemv.parse_fused_table("none") == {}
    plus = fused_gemv.parse_fused_table("+PLE_gate=4x512w4")
    assert plus[(256, 2560, True, "gelu_mul")] == GemvConfig(4, 512, 4) and len(plus) == len(fused_gemv.FUSED_CONFIGS)
    assert fused_gemv.FUSED_CONFIGS[(256, 2560, True, "gelu_mul")] == GemvConfig(1, 1024, 4)  # the shipped one kept
    for bad in ("PLE gate=2x1024", "ple_gate=2x1024w4", "o=3x1024w4"):
        with pytest.raises(ValueError, match="fused table entry"):
            fused_gemv.parse_fused_table(bad)
    shipped = dict(fused_gemv.FUSED_CONFIGS)
    out = tmp_path / "stack.jsonl"
    stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--bodies", "bf16", "--heads", "full", "--prompt-len",
                "8", "--new", "3", "--fused-table", "default", "--fused-table", "PLE_gate=2x1024w4", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["base", "base (fused: PLE_gate=2x1024w4)"]
    assert rows[1]["identity_vs_first"] == 1.0 and fused_gemv.FUSED_CONFIGS == shipped
    assert not fused_gemv._FORCED[0] and not fused_gemv.pinned_on(torch.device("cpu"))  # the shipped table: sm_90
    with pytest.raises(SystemExit, match="--fused-table: fused table entry"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--fused-table", "x=1x1w1"])


def test_spec_profile_phases_charges_each_graph(monkeypatch, capsys):
    """bench.spec --profile-phases: the draft and the verify graph each traced through bench.timeline
    (its replays, its summary and table)."""
    import types

    from fastgemma.bench import spec, timeline

    replays = []
    gen = types.SimpleNamespace(_graphs=[types.SimpleNamespace(replay=lambda n=n: replays.append(n))
                                         for n in ("draft", "verify")])

    def fake_trace(fn, calls):
        fn()
        return [timeline.charge([dict(name="k", grid=(2, 1, 1), start=0.0, dur=5.0),
                                 dict(name="m", grid=(1, 1, 1), start=3.0, dur=4.0)]) for _ in range(calls)]

    monkeypatch.setattr(timeline, "trace_kernels", fake_trace)
    out = spec.profile_phases(gen, 3)
    assert replays == ["draft", "verify"] and set(out) == {"draft", "verify"}
    assert out["verify"]["span_us"] == 7 and [g["inc_us"] for g in out["verify"]["groups"]] == [5, 2]
    text = capsys.readouterr().out
    assert "### timeline: draft graph: 2 kernels, span 7.0 us" in text and "### timeline: verify graph" in text
    out = spec.profile_phases(gen, 2, floor=[(1, 1.0), (3, 3.0)])  # --floor: k at 2 programs 2.0 us, m 1.0
    assert out["verify"]["boundary_us"] == 3.0 and [g["boundary_us"] for g in out["verify"]["groups"]] == [2.0, 1.0]
    assert "| k | 2x1x1 | 1 | 5.0 | 5.0 | 0.0 | 2.0 | 3.0 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="give --profile-phases N too"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--floor", "floor.jsonl"])


def test_stack_bench_timeline_needs_a_gpu():
    from fastgemma.bench import stack

    with pytest.raises(SystemExit, match="needs --device cuda"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--timeline", "3"])
    with pytest.raises(SystemExit, match="replays >= 0"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--timeline", "-1"])


def test_stack_bench_bodies_and_heads_on_the_cpu(tmp_path, capsys):
    """bench.stack on the tiny model: every body x head row, bytes that shrink with int4, a pruned
    head whose keepset holds the full head's greedy tokens returns exactly its ids, and bad heads fail."""
    from fastgemma.bench import stack

    out = tmp_path / "stack.jsonl"
    stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--bodies", "bf16", "int4", "--heads", "full",
                "int8", "pruned:40", "pruned:40:int4", "--prompts", "2", "--prompt-len", "12", "--new", "6",
                "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["body"], r["head"]) for r in rows] == [
        (b, h) for b in ("bf16", "int4") for h in ("full", "int8", "pruned:40", "pruned:40:int4")]
    assert all("error" not in r for r in rows)
    by = {(r["body"], r["head"]): r for r in rows}
    for b in ("bf16", "int4"):
        full, pruned = by[(b, "full")], by[(b, "pruned:40")]
        assert full["identity_rate"] == 1.0 and pruned["identity_rate"] == 1.0 and pruned["prefix_mean"] == 6
        assert pruned["lm_head"]["rows"] == 40 and pruned["head_mb"] < full["head_mb"]
        assert by[(b, "int8")]["head_mb"] < full["head_mb"]
        pruned4 = by[(b, "pruned:40:int4")]  # the same keepset in int4: a quarter of the bytes and then some
        assert pruned4["lm_head"]["rows"] == 40 and pruned4["lm_head"]["dtype"] == "int4"
        assert pruned4["head_mb"] < 0.5 * pruned["head_mb"]
        assert "FuseLayers" in full["stack"]
    body_gb = {b: by[(b, "full")]["gb_per_token"] - by[(b, "full")]["head_mb"] / 1e3 for b in ("bf16", "int4")}
    assert 0 < body_gb["int4"] < 0.4 * body_gb["bf16"]
    table = capsys.readouterr().out.split("| body | variant | head |")[1]
    assert table.count("\n| bf16 | base |") == 4 and table.count("\n| int4 | base |") == 4
    assert stack.keepset([5, 3, 5], 4, 10)[:2] == [5, 3] and len(set(stack.keepset([5, 3], 6, 10))) == 6
    assert stack.parse_head("pruned:40:int4") == ("pruned", 40, "int4") and stack.parse_head("int8") == (
        "int8", None, "auto")
    assert stack.head_name(*stack.parse_head("pruned:40:int8")) == "pruned:40:int8"
    for bad in ("pruned", "pruned:0", "int3", "full:3", "pruned:40:int3", "int4:8"):
        with pytest.raises(SystemExit, match="bad head"):
            stack.parse_head(bad)


def test_stack_bench_step_variants_on_the_cpu(tmp_path, capsys):
    """bench.stack --variants: the body built once per fused-step variant, its FuseLayers options in the
    row's stack, the variants' full-head tokens equal to the first's (launch options change no
    arithmetic); nf4 would take the first only; a bad variant is refused in one line. --window: the
    sliding layers' window, in every row; a bad one refused."""
    from fastgemma.bench import stack

    out = tmp_path / "stack.jsonl"
    stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--bodies", "int4", "--window", "8",
                "--variants", "base,attn_pdl+qkv+attn_merge",
                "--heads", "full", "pruned:40", "--prompts", "1", "--prompt-len", "12", "--new", "6",
                "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["head"]) for r in rows] == [
        (v, h) for v in ("base", "attn_pdl+qkv+attn_merge") for h in ("full", "pruned:40")]
    fl = [r["stack"]["FuseLayers"] for r in rows]
    assert [(f["attn_pdl"], f["qkv_kernel"], f["attn_merge"]) for f in fl] == [(False,) * 3] * 2 + [(True,) * 3] * 2
    assert [r["identity_vs_first"] for r in rows] == [1.0, None, 1.0, None]
    # each later variant's step against the first variant's with the same head (a leave-one-out's deltas)
    assert [r["step_ms_vs_first"] is None for r in rows] == [True, True, False, False]
    assert all(abs(r["step_ms_vs_first"] - (r["step_ms"] - f["step_ms"])) < 1e-9 for r, f in zip(rows[2:], rows))
    text = capsys.readouterr().out
    assert "identity vs first variant" in text and "| vs first variant |" in text
    table = [line for line in text.splitlines() if line.startswith("| int4 | attn_pdl")]
    assert len(table) == 2 and all(f"{r['step_ms_vs_first']:+.3f}" in t for r, t in zip(rows[2:], table))
    assert stack.parse_variant("attn_pdl+qkv") == {"attn_pdl": True, "qkv_kernel": True}
    assert stack.parse_variant("attn_merge") == {"attn_merge": True}
    assert stack.parse_variant("base") == {}
    with pytest.raises(SystemExit, match="bad variant"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--variants", "base,fast"])
    assert {r["window"] for r in rows} == {8}
    for bad in ("0", "wide"):
        with pytest.raises(SystemExit, match="--window: native or a positive number"):
            stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--window", bad])


def test_stack_bench_several_prompt_lengths_in_one_process(tmp_path, capsys):
    """bench.stack --prompt-len L1 L2: rows for each length from one engine whose cache holds the
    longest (long context in one process), identity per length against the full head's tokens of the
    same prompts; lengths past the model's positions are refused."""
    from fastgemma.bench import stack

    out = tmp_path / "stack.jsonl"
    stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--bodies", "bf16", "--heads", "full", "pruned:40",
                "--prompts", "1", "--prompt-len", "12", "30", "12", "--new", "4", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["head"], r["prompt_len"]) for r in rows] == [("full", 12), ("full", 30), ("pruned:40", 12),
                                                             ("pruned:40", 30)]
    assert all(r["max_context"] == 30 + 4 + 16 and r["identity_rate"] == 1.0 and r["prefix_mean"] == 4 for r in rows)
    assert [r["identity_vs_first"] for r in rows] == [1.0, 1.0, None, None]
    table = capsys.readouterr().out.split("| prompt |")[1]
    assert table.count(" | 12 |\n") == 2 and table.count(" | 30 |\n") == 2
    with pytest.raises(SystemExit, match="exceeds"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompt-len", "10", "1000000"])
    with pytest.raises(SystemExit, match=">= 1"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompt-len", "0"])


def test_stack_bench_one_row_set_per_mma_table(tmp_path, monkeypatch):
    """bench.stack --mma-table, repeated: variants with 'mma' built once per table in one process (rows
    labelled by the table's text, 'default' unlabelled), the others once; the shipped table restored
    after; a bad entry refused."""
    from fastgemma.bench import stack
    from fastgemma.kernels import mma_table

    shipped = dict(mma_table.MMA_CONFIGS)
    out = tmp_path / "stack.jsonl"
    seen = []
    real = mma_table.set_table

    def spy(table):  # the table each build runs with
        seen.append(dict(table))
        real(table)

    monkeypatch.setattr(mma_table, "set_table", spy)
    stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--bodies", "int4", "--variants", "base,mma",
                "--mma-table", "default", "--mma-table", "down@1=1x4s4", "--mma-table", "+down@1=2x8d2p1",
                "--heads", "full", "--prompts", "1", "--prompt-len", "12", "--new", "4", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["base", "mma", "mma [down@1=1x4s4]", "mma [+down@1=2x8d2p1]"]
    assert [r["stack"]["FuseLayers"]["int4_mma"] for r in rows] == [False, True, True, True]
    down = (2560, 10240, False)
    # '+': the shipped table with the entry changed; without it: that entry alone
    assert seen[2] == {down: mma_table.MmaConfig(1, 4, splits=4)}
    assert seen[3] == {**shipped, down: mma_table.MmaConfig(2, 8, 2, persist=1)}
    assert mma_table.MMA_CONFIGS == shipped
    with pytest.raises(SystemExit, match="CASE@ROWS=TxW"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--variants", "mma", "--mma-table", "down@1=4"])


def test_stack_bench_one_row_set_per_attention_tiles(tmp_path):
    """bench.stack --attn-tiles, repeated: variants with 'attn_qkv' built once per tile choice in one
    process (rows labelled by the choice, 'default' unlabelled, the choice in the row's FuseLayers),
    the others once; bad entries and tiles without an attn_qkv variant refused."""
    from fastgemma.bench import stack

    out = tmp_path / "stack.jsonl"
    stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--bodies", "bf16", "--variants", "base,attn_qkv",
                "--attn-tiles", "default", "--attn-tiles", "full_store:32x16s2", "--heads", "full", "--prompts", "1",
                "--prompt-len", "12", "--new", "4", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["base", "attn_qkv", "attn_qkv {full_store:32x16s2}"]
    assert [r["stack"]["FuseLayers"]["attn_tiles"] for r in rows] == ["", "", "full_store:32x16s2"]
    assert [r["identity_vs_first"] for r in rows] == [1.0, 1.0, 1.0]
    with pytest.raises(SystemExit, match="--attn-tiles: .*KIND"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--variants", "attn_qkv", "--attn-tiles", "full=32x4s2"])
    with pytest.raises(SystemExit, match="give a variant with attn_qkv"):
        stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--variants", "base", "--attn-tiles", "full_store:32x4s2"])


def test_spec_bench_compares_verify_tiles_on_the_cpu(tmp_path):
    """bench.spec's CPU smoke run with a pruned head: the AR row, then replay rows for each verify
    tile table, identical tokens to AR (no divergence, teacher-forced top-1 agreement 1), and the
    per-group table restored afterwards."""
    import json

    from fastgemma.bench import spec
    from fastgemma.kernels import w4a16_table

    before = dict(w4a16_table.CONFIGS)
    out = tmp_path / "spec.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "8",
               "--depths", "2", "--profiles", "frontier", "--windows", "native", "--mtp-depth", "0",
               "--verify-tiles", "per_group,mma", "--head", "pruned:50", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["stack"]["lm_head"]["rows"] == 50  # the pruned head of the stack
    rows = lines[1:]
    assert [(r["spec"], r.get("verify_tiles")) for r in rows] == [("none", None), ("replay", "per_group"),
                                                                  ("replay", "mma")]
    assert all(r["identity_rate"] == 1.0 and r["diverge_at"] == [8] for r in rows[1:])
    # fp32: the k+1-row verify pass gives the AR step's logits on AR's trace (teacher-forced)
    assert all(r["top1_agree"] == 1.0 and r["top1_agree_confident"] == 1.0 and r["max_abs_diff"] < 1e-3
               for r in rows[1:])
    assert w4a16_table.CONFIGS == before
    assert all(c.per_group for k, c in w4a16_table.CONFIGS.items() if k in w4a16_table.MMA_M16)


def test_spec_bench_refuses_depths_past_the_verify_rows_limit(monkeypatch):
    """A stack whose verify pass takes at most N rows (fuse.batch_invariant on the tensor-core kernel: 8) refuses
    --depths past N - 1 (the untrained-drafter row's --mtp-depth too) before any row is run."""
    from fastgemma.bench import spec

    built = spec.build_stack

    def limited(*args, **kw):
        model, sampler, stack = built(*args, **kw)
        model.max_verify_rows = 4
        return model, sampler, stack

    monkeypatch.setattr(spec, "build_stack", limited)
    argv = ["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "4",
            "--profiles", "frontier", "--windows", "native"]
    for extra in (["--depths", "1,4", "--mtp-depth", "0"], ["--depths", "2", "--mtp-depth", "7"]):
        with pytest.raises(SystemExit, match="take at most 4 rows, so depths <= 3"):
            spec.main(argv + extra)


def test_spec_bench_compares_the_bookkeeping_kernels_with_the_torch_ops(tmp_path):
    """--bookkeeping on,off: a replay row with kernels/spec_accept.py (the interpreter here) and one with
    the torch ops; the same tokens, acceptance and draws."""
    import json

    from fastgemma.bench import spec

    out = tmp_path / "spec.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "2", "--prompt-len", "12", "--new", "10",
               "--depths", "3", "--profiles", "frontier", "--windows", "native", "--mtp-depth", "0",
               "--bookkeeping", "on,off", "--no-agreement", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()][2:]  # the stack, the AR row
    assert [r["bookkeeping"] for r in rows] == ["kernels", "torch"]
    keys = ("identity_rate", "diverge_at", "tokens_per_step", "accept_mean", "accept_by_pos", "replay_mismatch")
    assert [rows[0][k] for k in keys] == [rows[1][k] for k in keys] and rows[0]["identity_rate"] == 1.0


def test_spec_bench_runs_several_prompt_lengths_in_one_process(tmp_path):
    """--prompt-len 12 40 (a window of 16, so the longer prompt wraps the ring): an AR row and a replay
    row for each length from one cache sized for the longest; each replay row is compared with its own
    length's AR tokens and timed against its own length's AR row."""
    import json

    from fastgemma.bench import spec

    out = tmp_path / "spec.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "40", "--new", "8",
               "--depths", "2", "--profiles", "frontier", "--windows", "16", "--mtp-depth", "0", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [(r["spec"], r["prompt_len"]) for r in rows] == [("none", 12), ("none", 40), ("replay", 12),
                                                            ("replay", 40)]
    ar = {r["prompt_len"]: r for r in rows[:2]}
    for r in rows[2:]:
        assert r["identity_rate"] == 1.0 and r["diverge_at"] == [8]
        assert r["speedup"] == pytest.approx(r["tps"] / ar[r["prompt_len"]]["tps"])
    assert rows[2]["top1_agree"] == 1.0 and "top1_agree" not in rows[3]  # teacher-forced on the first length
    with pytest.raises(SystemExit, match="exceeds"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompt-len", "12", "100000"])
    with pytest.raises(SystemExit, match=">= 1"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompt-len", "0"])


def test_spec_bench_compares_each_prompt_path_with_its_own_ar_tokens(tmp_path, monkeypatch):
    """--prefill graph,eager: a speculative row's identity and divergence are against the AR tokens of
    its own prompt path. Here the eager path's tokens are made to differ from the graph path's for
    every generator (as a path that rounds apart in bf16 would): its AR row has identity 0 against the
    first path, its speculative row identity 1 against its own AR row."""
    import json

    from fastgemma.bench import spec

    path = {}
    use, timed = spec.use_prefill, spec.timed

    def use_prefill(gen, name, prompt_len):
        path["now"] = name
        return use(gen, name, prompt_len)

    def shifted(gen, prompts, new):
        outs, wall = timed(gen, prompts, new)
        if path["now"] == "eager":
            for o in outs:
                o.tokens = [t + 1 for t in o.tokens]
        return outs, wall

    monkeypatch.setattr(spec, "use_prefill", use_prefill)
    monkeypatch.setattr(spec, "timed", shifted)
    out = tmp_path / "spec.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "8",
               "--depths", "2", "--profiles", "frontier", "--windows", "native", "--mtp-depth", "0",
               "--prefill", "graph,eager", "--no-agreement", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [(r["spec"], r["prefill"]) for r in rows] == [("none", "graph"), ("none", "eager"), ("replay", "graph"),
                                                        ("replay", "eager")]
    assert rows[1]["identity_rate"] == 0.0
    assert all(r["identity_rate"] == 1.0 and r["diverge_at"] == [8] for r in rows[2:])


def test_spec_bench_with_the_fused_one_row_step_on_the_cpu(tmp_path, wide_tiles):
    """--fuse layers: the AR rows take the fused one-row step (its torch twin here), the k+1-row passes
    the ordinary step with or without its GEMM epilogues, the drafter its fused step or the unfused
    one (a row each); speculative tokens still equal AR's and the verify pass agrees with the fused
    AR step on every teacher-forced position (fp32)."""
    import json

    from fastgemma.bench import spec
    from fastgemma.kernels import w4a16

    out = tmp_path / "spec.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "8",
               "--depths", "3", "--profiles", "frontier", "--windows", "native", "--mtp-depth", "0",
               "--fuse", "layers", "--drafter-steps", "fused,fused_torch_head,unfused", "--split-fixup", "off,on",
               "--verify-epilogues", "off,on", "--verify-norms", "on,off", "--head", "pruned:50", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["stack"]["FuseLayers"]["fused_layers"] is True
    rows = lines[1:]
    assert [(r["spec"], r.get("drafter_step"), r.get("split_fixup"), r.get("verify_epilogues"), r.get("verify_norms"))
            for r in rows] == [("none", None, None, None, None)] + [
        ("replay", d, f, e, n) for d in ("fused", "fused_torch_head", "unfused") for f in ("off", "on")
        for e, n in (("off", None), ("on", "on"), ("on", "off"))]
    assert w4a16.SPLIT_FIXUP  # back on afterwards
    for r in rows[1:]:
        assert r["identity_rate"] == 1.0 and r["diverge_at"] == [8]
        assert r["top1_agree"] == 1.0 and r["max_abs_diff"] < 1e-3
    with pytest.raises(SystemExit, match="the fused ones need --fuse layers"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--drafter-steps", "fused"])
    with pytest.raises(SystemExit, match="on, off or on,off"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--split-fixup", "maybe"])
    with pytest.raises(SystemExit, match="verify-epilogues"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--verify-epilogues", "both"])
    with pytest.raises(SystemExit, match="verify-norms"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--verify-norms", "kernel"])


def test_spec_bench_verify_pdl_and_qkv_rows_on_the_cpu(tmp_path, wide_tiles):
    """bench.spec --verify-pdl on,off --verify-qkv on,off --attn-pdl on,off (and --verify-mma): a row
    each for the fused verify pass (none where the epilogues are off, so fused_verify is not used),
    the AR step built as --variant says; all decode AR's tokens; a bad value is refused in one line."""
    import json

    from fastgemma.bench import spec

    out = tmp_path / "spec.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "8",
               "--depths", "3", "--profiles", "frontier", "--windows", "native", "--mtp-depth", "0",
               "--fuse", "layers", "--drafter-steps", "fused", "--verify-epilogues", "off,on",
               "--verify-pdl", "on,off", "--verify-qkv", "on,off", "--attn-pdl", "off,on", "--variant", "attn_pdl+qkv",
               "--head", "pruned:50", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["stack"]["FuseLayers"]["attn_pdl"] is True
    rows = lines[1:]
    assert [(r["spec"], r.get("verify_epilogues"), r.get("verify_pdl"), r.get("verify_qkv"), r.get("attn_pdl"))
            for r in rows] == [("none", None, None, None, None), ("replay", "off", None, None, None)] + [
        ("replay", "on", p, q, a) for p in ("on", "off") for q in ("on", "off") for a in ("off", "on")]
    assert {r["variant"] for r in rows} == {"attn_pdl+qkv"}
    for r in rows[1:]:
        assert r["identity_rate"] == 1.0 and r["diverge_at"] == [8] and r["top1_agree"] == 1.0
    for flag in ("--verify-pdl", "--verify-qkv", "--attn-pdl"):
        with pytest.raises(SystemExit, match=flag):
            spec.main(["--model", "gemma4_tiny", "--device", "cpu", flag, "yes"])
    with pytest.raises(SystemExit, match="bad variant"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--fuse", "layers", "--variant", "qkv+fast"])
    # --verify-mma: a row each with 'mma' in --variant (on the CPU the twins run: same tokens); without it, refused
    out = tmp_path / "mma.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "8",
               "--depths", "3", "--profiles", "frontier", "--windows", "native", "--mtp-depth", "0",
               "--fuse", "layers", "--variant", "attn_pdl+qkv+mma", "--verify-mma", "on,off", "--head", "pruned:50",
               "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [(r["spec"], r.get("verify_mma")) for r in rows] == [("none", None), ("replay", "on"), ("replay", "off")]
    assert all(r["identity_rate"] == 1.0 for r in rows[1:])
    # --verify-attn-qkv: off by default (fuse.attn_qkv is the one-row step's and the drafter's), on,off a row each
    out = tmp_path / "attn_qkv.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "8",
               "--depths", "3", "--profiles", "frontier", "--windows", "native", "--mtp-depth", "0",
               "--fuse", "layers", "--variant", "attn_pdl+attn_qkv", "--verify-attn-qkv", "on,off",
               "--attn-tiles", " sliding_query:16x4s2e1", "--head", "pruned:50", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["stack"]["FuseLayers"]["attn_qkv"] is True
    assert lines[0]["stack"]["FuseLayers"]["attn_tiles"] == "sliding_query:16x4s2e1"  # --attn-tiles, checked
    assert [(r["spec"], r.get("verify_attn_qkv")) for r in lines[1:]] == [("none", None), ("replay", "on"),
                                                                           ("replay", "off")]
    from fastgemma.bench.stack import parse_variant

    assert parse_variant("attn_pdl+attn_qkv") == {"attn_pdl": True, "attn_qkv": True}
    with pytest.raises(SystemExit, match="--attn-tiles sets"):  # without attn_qkv in --variant
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--fuse", "layers", "--attn-tiles", "full_store:32x4s2"])
    with pytest.raises(SystemExit, match="--attn-tiles: .*EARLY"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--fuse", "layers", "--variant", "attn_qkv",
                   "--attn-tiles", "full_store:32x4s2e3"])
    with pytest.raises(SystemExit, match="--verify-mma on needs 'mma' in --variant"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--fuse", "layers", "--verify-mma", "on"])
    with pytest.raises(SystemExit, match="CASE@ROWS=TxW"):  # --mma-table as bench.stack reads it
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--mma-table", "down@8=1x1x1"])


def test_prefill_bench_on_the_cpu(tmp_path):
    """bench.prefill's CPU smoke run: a row per (variant, prompt length), the graph variant's prompts
    padded to the bucket (no capture on a CPU), bad arguments refused in one line."""
    import json

    from fastgemma.bench import prefill

    out = tmp_path / "prefill.jsonl"
    prefill.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompt-lens", "5,40", "--repeats", "1",
                  "--warmup", "0", "--variants", "eager,graph", "--bucket", "16", "--head", "pruned:50",
                  "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [(r["variant"], r["prompt_len"], r["padded_len"]) for r in rows] == [
        ("eager", 5, 5), ("eager", 40, 40), ("graph", 5, 16), ("graph", 40, 48)]
    assert all(r["ttft_ms"] > 0 and r["prefill_tps"] > 0 and isinstance(r["dynamo_graphs"], int) for r in rows)
    # every row checked against the eager, unpadded forward: eager itself exactly, the padded path to rounding
    assert [r["hidden_max_diff"] for r in rows[:2]] == [0.0, 0.0]
    assert all(r["first_token_same"] and r["hidden_max_diff"] < 1e-4 * max(r["hidden_max"], 1.0) for r in rows)
    for bad, msg in ((["--variants", "fast"], "eager, compiled, graph"), (["--prompt-lens", "0"], "positive"),
                     (["--bucket", "0"], "--bucket")):
        with pytest.raises(SystemExit, match=msg):
            prefill.main(["--model", "gemma4_tiny", "--device", "cpu", *bad])


def test_spec_bench_rows_per_prompt_path_on_the_cpu(tmp_path):
    """bench.spec --prefill eager,graph: an AR row and a replay row per prompt path, each replay trace
    primed through the path it is timed with, tokens equal to AR's (fp32)."""
    import json

    from fastgemma.bench import spec

    out = tmp_path / "spec.jsonl"
    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12", "--new", "8",
               "--depths", "2", "--profiles", "frontier", "--windows", "native", "--mtp-depth", "0",
               "--prefill", "eager,graph", "--head", "pruned:50", "--no-agreement", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [(r["spec"], r["prefill"]) for r in rows] == [("none", "eager"), ("none", "graph"),
                                                          ("replay", "eager"), ("replay", "graph")]
    assert rows[1]["identity_rate"] == 1.0
    assert all(r["identity_rate"] == 1.0 and r["tokens_per_step"] > 1 for r in rows[2:])
    with pytest.raises(SystemExit, match="--prefill"):
        spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prefill", "fast"])


def test_prefill_tile_tables_and_the_long_chunk_entries():
    """bench.prefill's tile tables: `table` carries the dequantize-once entries of chunks of 256+
    rows, `per_group` and `first` drop them; use_tiles switches what a launch resolves to."""
    from fastgemma.bench.prefill import tile_tables, use_tiles
    from fastgemma.kernels import w4a16_table

    saved = dict(w4a16_table.CONFIGS)
    N, K = w4a16_table.E4B_SHAPES["gate|up"]
    long_key = (w4a16_table.DEQUANT_MIN_M, N, K)
    try:
        tables = tile_tables(["table", "per_group", "first"], 256)
        assert tables["table"][long_key].dequant and tables["table"][(64, N, K)] == saved[(64, N, K)]
        assert tables["per_group"][long_key] is None and tables["first"][long_key] is None
        assert tables["per_group"][(64, N, K)] == saved[(64, N, K)]
        use_tiles(tables["per_group"])
        assert not w4a16_table.resolve_config(256, N, K, 128).dequant
        use_tiles(tables["table"])
        assert w4a16_table.resolve_config(256, N, K, 128).dequant
        with pytest.raises(SystemExit, match="per_group"):
            tile_tables(["fast"], 256)
    finally:
        w4a16_table.CONFIGS.clear()
        w4a16_table.CONFIGS.update(saved)


def test_verify_chain_kernels_match_their_twins_on_the_cpu():
    """bench.verify_chain's kernel chain (interpreter) against the same chain through the twins, on two
    layers (sliding, full) of a tiny Gemma 4 layout with PLE (fp32: the kernels' fp32 paths); the
    pdl flag changes no bit (PDL is a launch attribute; the interpreter launches plainly); bad
    arguments refused in one line."""
    import dataclasses

    from fastgemma.bench import verify_chain
    from fastgemma.model.config import preset

    cfg = dataclasses.replace(preset("gemma4_tiny"), ple_dim=32)
    layers = verify_chain.build_layers(cfg, "cpu", group=32, dtype=torch.float32)[4:6]  # sliding, full
    g = torch.Generator().manual_seed(1)
    x0, ple = torch.randn(5, cfg.hidden_size, generator=g), torch.randn(5, cfg.ple_dim, generator=g)
    norm_w = torch.rand(cfg.hidden_size, generator=g)
    got = verify_chain.run_verify_chain(layers, x0, ple, norm_w, pdl=False)
    assert torch.equal(got, verify_chain.run_verify_chain(layers, x0, ple, norm_w, pdl=True))
    ref = verify_chain.run_verify_chain(layers, x0, ple, norm_w, pdl=False, twin=True)
    assert got.shape == (5, cfg.hidden_size) and torch.isfinite(ref).all()
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
    # --qkv-kernel: q|k|v through kernels/qkv_finish.py (its q feeds o; the caches written)
    qkv, qkv_ref = (verify_chain.qkv_inputs(layers, 5, "cpu", torch.float32) for _ in range(2))
    got = verify_chain.run_verify_chain(layers, x0, ple, norm_w, pdl=True, qkv=qkv)
    ref = verify_chain.run_verify_chain(layers, x0, ple, norm_w, pdl=False, twin=True, qkv=qkv_ref)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
    stores = [i for i, c in enumerate(qkv["caches"]) if c is not None]
    assert stores and all(qkv["caches"][i][0].abs().sum() > 0 for i in stores)
    for i in stores:
        torch.testing.assert_close(qkv["caches"][i][1], qkv_ref["caches"][i][1], rtol=1e-5, atol=1e-5)
    for bad, msg in ((["--rows", "1"], "--rows"), (["--rounds", "0"], "--rounds")):
        with pytest.raises(SystemExit, match=msg):
            verify_chain.main(bad)
    with pytest.raises(SystemExit, match="no CUDA device"):
        verify_chain.main([])


def test_draft_head_bench_on_the_cpu(capsys):
    """bench.draft_head on the tiny model's drafter (the kernel in the interpreter): every path
    timed (torch's, the kernels plain and under PDL), every path's ids equal to the twin's on every
    random state."""
    from fastgemma.bench.draft_head import bench_draft_head

    rows = bench_draft_head(rows=2, checks=3, device="cpu", model="gemma4_tiny", dtype=torch.float32,
                            timer=lambda fn: (fn(), 1e-3)[1])
    assert [r["path"] for r in rows] == ["torch (topk, gather, einsum)", "kernels/draft_head.py",
                                         "kernels/draft_head.py, PDL", "PDL, one select program a centroid"]
    assert all(r["ids_equal"] == r["checks"] == 3 and r["us"] == 1.0 for r in rows), rows
    assert "3/3" in capsys.readouterr().out


def test_bench_stack_model_and_step_variant_options(tmp_path):
    """bench.stack's 'ple' variant option (ple=table before the body's transforms) and its step options ('tail',
    'adv', 'combo') in the same process as the step without them: the same tokens (fp32 twins), W_plm's bytes gone
    from the per-token figure."""
    from fastgemma.bench import stack

    out = tmp_path / "stack.jsonl"
    stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--bodies", "bf16", "--heads", "full", "--prompt-len",
                "8", "--new", "4", "--variants", "base,base+ple,base+tail+adv+combo", "--out", str(out)])
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"base", "base+ple", "base+tail+adv+combo"} and rows["base+ple"]["identity_vs_first"] == 1.0
    # the last norm's kernel (its twin here), the step's bookkeeping in one launch (the twin on a CPU), inductor's
    # combo kernels (nothing compiles on a CPU): the same tokens
    assert rows["base+tail+adv+combo"]["identity_vs_first"] == 1.0
    assert rows["base+tail+adv+combo"]["stack"]["FuseLayers"]["tail_norm"] is True
    from fastgemma.model.config import GEMMA4_TINY as c

    w_plm = (c.hidden_size * c.num_layers * c.ple_dim + c.ple_dim) * 4  # W_plm and its norm, fp32 on the CPU
    assert round((rows["base"]["gb_per_token"] - rows["base+ple"]["gb_per_token"]) * 1e9) == w_plm
    with pytest.raises(SystemExit, match="options joined by '.' from .*ple"):
        stack.parse_variant("mma+pl")


@pytest.fixture
def ar_calls(monkeypatch):
    """(prompt length, new tokens) of every plain Generator.generate call (not the speculative generator's)."""
    from fastgemma.engine.generator import Generator

    calls = []
    generate = Generator.generate

    def record(self, prompt_ids, max_new_tokens, *args, **kw):
        if type(self) is Generator:
            calls.append((len(prompt_ids), max_new_tokens))
        return generate(self, prompt_ids, max_new_tokens, *args, **kw)

    monkeypatch.setattr(Generator, "generate", record)
    return calls


def test_benches_warm_up_at_each_timed_length(tmp_path, ar_calls):
    """bench.spec's AR rows, bench.stack and bench.ladder warm up with a prompt of each timed length before timing
    it (a 32-token warm-up left the eager prompt path's first compile of a longer shape inside the timed TTFT and
    tok/s: run LU's AR row, TTFT 2,006.6 ms in a first process)."""
    from fastgemma.bench import ladder, spec, stack

    spec.main(["--model", "gemma4_tiny", "--device", "cpu", "--prompts", "2", "--prompt-len", "12", "40", "--new", "6",
               "--depths", "2", "--profiles", "frontier", "--windows", "16", "--mtp-depth", "0", "--no-agreement",
               "--out", str(tmp_path / "spec.jsonl")])
    assert ar_calls[:6] == [(12, 8), (12, 6), (12, 6), (40, 8), (40, 6), (40, 6)]
    ar_calls.clear()
    stack.main(["--model", "gemma4_tiny", "--device", "cpu", "--bodies", "bf16", "--heads", "full", "--prompts", "1",
                "--prompt-len", "12", "40", "--new", "4", "--out", str(tmp_path / "stack.jsonl")])
    assert ar_calls[:4] == [(12, 8), (40, 8), (12, 4), (40, 4)]
    ar_calls.clear()
    ladder.main(["--model", "gemma4_tiny", "--device", "cpu", "--variants", "eager", "--prompts", "1",
                 "--prompt-len", "40", "--new", "4", "--hf-new", "0", "--hf-check", "0"])
    assert ar_calls[:2] == [(40, 8), (40, 4)]
