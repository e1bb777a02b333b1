"""Tasks on the tiny model (synthetic fp32 weights on a CPU): bench, identity, generate, bad input,
every experiment file, and the CLI end to end (a 2x2 multirun; a sweep with a crashing job)."""
from __future__ import annotations

import json

import pytest

from fgcli_helpers import CONF, TINY, cli, compose_cfg, results, run_job

BENCH_METRICS = ("tps", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "step_ms", "tokens_per_step",
                 "vram_peak_gb", "weight_bytes_per_token", "mbu")


def test_bench_smoke_writes_one_record(tmp_path, capsys, caplog):
    caplog.set_level("INFO", logger="fastgemma")
    rec = run_job(TINY + ["task=bench"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    m = rec["metrics"]
    for k in BENCH_METRICS:
        assert k in m, k
    assert m["tps"] > 0 and m["output_tokens"] == 3 * 16 and m["tokens_per_step"] == 1
    assert m["itl_ms_p50"] <= m["itl_ms_p99"]
    # CPU: nothing is made up for what was not measured
    assert m["vram_peak_gb"] is None and m["mbu"] is None and m["copy_bw_gbs"] is None
    assert m["weight_bytes_per_token"] > 0
    assert len(rec["details"]["cdf"]["itl_ms"]) == 101
    reqs = rec["details"]["requests"]  # each timed request, in order
    assert [r["output_tokens"] for r in reqs] == [16] * 3 and not any(r["ended"] for r in reqs)
    assert all(r["prompt_tokens"] > 0 and r["ttft_ms"] > 0 for r in reqs)
    assert rec["choices"]["model"] == "gemma4_tiny" and rec["choices"]["quant"] == "bf16"
    assert rec["software"]["torch"] and "git_commit" in rec["software"]
    assert rec["hardware"]["device"] == "cpu"
    on_disk = json.loads((tmp_path / "outputs" / "run" / "record.json").read_text())
    assert on_disk["run_id"] == rec["run_id"]
    assert [r["run_id"] for r in results(tmp_path)] == [rec["run_id"]]
    out = capsys.readouterr().out
    assert "[bench]" in out and "tps=" in out
    # each setup phase before the clock: logged as it starts and ends, its seconds recorded
    setup = rec["details"]["setup_s"]
    assert list(setup) == ["model (weights, transforms)", "engine (cache, step capture / compile)",
                           "warm-up (1 request)", "prompt graphs (up to 40 tokens)"], setup
    assert all(v >= 0 for v in setup.values())
    logged = [r.getMessage() for r in caplog.records if r.name == "fastgemma"]
    for name in setup:
        assert f"{name} ..." in logged and any(m.startswith(f"{name}: ") and m.endswith(" s") for m in logged)
    assert "timed: 3 prompts x 16 new tokens" in logged


def test_bench_with_replay_primes_every_trace_before_its_request(tmp_path, caplog):
    """spec=replay through the bench task: the warm-up's and the timed prompts' reference traces are
    recorded before their requests (no request primes its own, which would warn and time a greedy pass)."""
    import warnings

    from fastgemma.transforms.spec import SYNTHETIC_MTP

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="spec=replay: no reference trace")
        rec = run_job(TINY + ["task=bench", "spec=replay", "spec.depth=2"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert SYNTHETIC_MTP not in caplog.text  # replay's synthetic drafter is only its cost
    assert "replay traces (3 prompts)" in rec["details"]["setup_s"]
    assert rec["metrics"]["tokens_per_step"] >= 1 and rec["metrics"]["accept_by_pos"]
    # the timed requests reproduced their traces; each prompt's trace head (its draws' seed) recorded
    replay = rec["details"]["replay"]
    assert replay["mismatch"] == 0 and len(replay["reference_head"]) == 3
    assert all(len(h) == 4 for h in replay["reference_head"])


def test_bench_with_the_mtp_drafter_runs_and_records_acceptance(tmp_path, caplog):
    """spec=mtp through the bench task (the synthetic drafter): no replay trace is recorded, the record
    carries the acceptance metrics of the drafter's own drafts, and the user is told once that a random
    drafter's acceptance is no trained drafter's."""
    from fastgemma.transforms.spec import SYNTHETIC_MTP

    with caplog.at_level("WARNING", logger="fastgemma"):
        rec = run_job(TINY + ["task=bench", "spec=mtp", "spec.depth=3"], tmp_path)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"].count(SYNTHETIC_MTP) == 1
    assert rec["status"] == "ok", rec["error"]
    m = rec["metrics"]
    assert m["output_tokens"] == 3 * 16 and 1 <= m["tokens_per_step"] <= 4
    assert len(m["accept_by_pos"]) == 3 and 0 <= m["accept_mean"] <= 3
    assert not any(k.startswith("replay traces") for k in rec["details"]["setup_s"])
    assert rec["details"].get("replay") is None


def test_replay_tokens_off_their_trace_are_counted_and_warned(caplog):
    from types import SimpleNamespace

    from fastgemma.engine.speculative import Replay
    from fastgemma.tasks.bench import _replay_details

    gen = SimpleNamespace(replay=Replay())
    gen.replay.references[(1, 2)] = [5, 6, 7, 8, 9]
    prompts = [SimpleNamespace(ids=[1, 2]), SimpleNamespace(ids=[3])]
    with caplog.at_level("WARNING", logger="fastgemma"):
        d = _replay_details(gen, prompts, [SimpleNamespace(replay_mismatch=2), SimpleNamespace(replay_mismatch=1)])
    assert d == {"mismatch": 3, "reference_head": [[5, 6, 7, 8], []]}
    assert any("3 emitted tokens left the reference traces" in r.getMessage() for r in caplog.records)
    assert _replay_details(SimpleNamespace(), prompts, []) is None  # not spec=replay


def test_requests_that_end_are_marked_and_counted(caplog):
    from types import SimpleNamespace

    from fastgemma.tasks.bench import _request_details

    gens = [SimpleNamespace(prompt_len=5, tokens=[7, 8, 1], ttft_s=0.002),   # ended on id 1
            SimpleNamespace(prompt_len=9, tokens=[7, 8, 9, 10], ttft_s=0.003),  # ran to its limit
            SimpleNamespace(prompt_len=4, tokens=[106], ttft_s=0.001)]         # ended at once
    with caplog.at_level("INFO", logger="fastgemma"):
        rows = _request_details(gens, (1, 106), ignore_eos=False)
    assert [r["ended"] for r in rows] == [True, False, True]
    assert rows[1] == {"prompt_tokens": 9, "output_tokens": 4, "ttft_ms": 3.0, "ended": False}
    assert "2 of 3 requests ended on an end-of-sequence id (8 output tokens in all)" in caplog.text
    # ends ignored: an end id emitted along the way ends nothing
    assert not any(r["ended"] for r in _request_details(gens, (1, 106), ignore_eos=True))


def test_weight_bytes_per_token_counts_the_head_and_one_ple_row(tmp_path):
    import torch

    from fastgemma.metrics.memory import weight_bytes_per_step
    from fastgemma.model.config import preset
    from fastgemma.weights.synthetic import synthetic_model

    cfg = preset("gemma4_tiny")
    m = synthetic_model(cfg, "cpu", torch.float32)
    every = sum(p.numel() for p in m.parameters()) * 4
    every += sum(b.numel() * 4 for n, b in m.named_buffers() if "inv_freq" not in n)  # layer scalars
    ple = m.embed_tokens_per_layer.weight
    assert weight_bytes_per_step(m) == every - ple.numel() * 4 + ple.shape[1] * 4
    # int4 layers count their codes, scales and zeros once: the packed scale / zero words are a copy
    from fastgemma.transforms.quant import Int4Linear, Int4Quant

    m = Int4Quant(group_size=32, skip=("per_layer_projection",), backend="torch").apply(m.to(torch.bfloat16))
    lins = [mod for mod in m.modules() if isinstance(mod, Int4Linear)]
    assert lins and all(mod.sz is not None for mod in lins)
    before = weight_bytes_per_step(m)
    for mod in lins:
        mod.sz = None
    assert weight_bytes_per_step(m) == before


def test_identity_of_the_baseline_and_the_static_step_is_exact(tmp_path):
    rec = run_job(TINY + ["task=identity", "graphs=static"], tmp_path)
    m = rec["metrics"]
    assert rec["status"] == "ok", rec["error"]
    # fp32, same weights, same math: the static step must reproduce the eager reference
    assert m["identity_rate"] == 1.0 and m["identity_prefix_mean"] == 16
    assert m["top1_agree"] == 1.0 and m["top1_agree_confident"] == 1.0


def test_identity_of_a_lossy_window_is_a_rate(tmp_path):
    rec = run_job(TINY + ["task=identity", "window=w128", "task.max_new_tokens=24"], tmp_path)
    m = rec["metrics"]
    for k in ("identity_rate", "identity_prefix_mean", "top1_agree", "top1_agree_confident"):
        assert m[k] is not None, k
    assert 0 <= m["identity_rate"] <= 1 and 0 <= m["top1_agree"] <= 1 and m["identity_prefix_mean"] <= 24


def test_identity_of_nf4_runs_on_the_cpu(tmp_path):
    """quant=nf4 through the whole job on a CPU: bitsandbytes NF4 layers in the engine's decode."""
    pytest.importorskip("bitsandbytes", reason="quant=nf4 needs bitsandbytes (in the test extra)")
    rec = run_job(TINY + ["task=identity", "quant=nf4"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    q = rec["details"]["parts"]["quant"]
    assert q["quant"] == "nf4" and q["quantized_layers"] > 0 and q["weight_bytes"] < q["dense_weight_bytes"] / 6
    assert 0 <= rec["metrics"]["top1_agree"] <= 1


def test_identity_of_gptq_int4_runs_on_the_cpu(tmp_path, monkeypatch):
    """quant=int4 quant.method=gptq through the whole job: calibrated on the default texts (the byte
    tokenizer of synthetic weights), the record says how."""
    monkeypatch.setenv("FASTGEMMA_CACHE", str(tmp_path / "cache"))
    rec = run_job(TINY + ["task=identity", "quant=int4", "quant.backend=torch", "quant.method=gptq",
                          "quant.group_size=32", "quant.skip=[per_layer_input_gate,per_layer_projection]",
                          "quant.calib_tokens=128", "quant.calib_seq_len=64"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    q = rec["details"]["parts"]["quant"]
    assert q["method"] == "gptq" and q["quantized_layers"] > 0
    assert q["gptq"]["calib_sequences"] == 2 and 0 < q["gptq"]["error_vs_rtn"] < 1 and q["gptq"]["cache_hit"] is False
    assert 0 <= rec["metrics"]["top1_agree"] <= 1


def test_generate_text_and_ids(tmp_path, capsys):
    rec = run_job(TINY + ["task=generate", "task.prompt=Hello", "task.max_new_tokens=5"], tmp_path, "a")
    assert rec["status"] == "ok" and len(rec["details"]["output_ids"]) == 5
    assert list(rec["details"]["setup_s"]) == ["model (weights, transforms)", "engine (cache, step capture / compile)",
                                               "prompt graphs (6 tokens)"]
    assert rec["details"]["prompt_ids"][0] == 2  # BOS from the byte tokenizer of synthetic weights
    rec = run_job(TINY + ["task=generate", "task.ids=[2,10,11,12]", "task.max_new_tokens=4", "tokenizer=none"],
                  tmp_path, "b")
    assert rec["details"]["output_text"] is None
    out = capsys.readouterr().out
    assert "prompt (6 tokens): Hello" in out and "prompt (4 tokens): [2, 10, 11, 12]" in out


def _chat_tokenizer(path):
    """A word-level tokenizer of the tiny model's ids with a Gemma-style chat template, saved as a checkpoint's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "user", "model", "Why", "is",
             "the", "sky", "blue?"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<start_of_turn> {{ m['role'] }} {{ m['content'] }} "
                         "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}")
    tok.save_pretrained(path)
    return tok


def test_generate_chat_wraps_the_prompt_in_the_template(tmp_path):
    _chat_tokenizer(tmp_path / "tok")
    over = TINY + ["task=generate", "task.prompt=Why is the sky blue?", "task.max_new_tokens=3", "task.chat=true",
                   f"tokenizer={tmp_path / 'tok'}"]
    rec = run_job(over, tmp_path, "a")
    assert rec["status"] == "ok", rec["error"]
    # <bos> <start_of_turn> user Why is the sky blue? <end_of_turn> <start_of_turn> model
    assert rec["details"]["prompt_ids"] == [2, 4, 6, 8, 9, 10, 11, 12, 5, 4, 7]
    plain = run_job(over[:-2] + [f"tokenizer={tmp_path / 'tok'}"], tmp_path, "b")
    assert plain["details"]["prompt_ids"] == [8, 9, 10, 11, 12]  # the text as it is (Gemma's tokenizers add <bos>)
    for bad, message in ((["tokenizer=bytes"], "task.chat=true needs a tokenizer with a chat template"),
                         (["task.prompt=null", "task.ids=[2,5]"], "task.ids are passed as they are")):
        with pytest.raises(SystemExit):
            run_job(over[:-1] + bad if bad[0].startswith("tokenizer") else over + bad, tmp_path, "c")
        assert message in results(tmp_path)[-1]["error"]


EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# the CPU twins of CUDA-only choices, and an int4 layout the tiny model's 64/16-wide layers allow
CPU_SHRINK = {("graphs", "cuda_graph"): ["graphs=static"], ("graphs", "compiled"): ["graphs=static"], ("attention", "triton"): ["attention=torch"],
              ("quant", "int4"): ["quant.backend=torch", "quant.group_size=32",
                                  "quant.skip=[per_layer_input_gate,per_layer_projection]"],
              ("quant", "bf16"): ["quant.backend=torch"], ("quant", "int8"): ["quant.backend=torch"],
              ("fuse", "layers"): ["fuse.backend=torch"],
              ("lm_head", "pruned"): ["lm_head.rows=64", "lm_head.backend=torch"],
              ("sampler", "fused_argmax"): ["sampler.backend=torch"],
              ("weights", "gguf"): ["weights=synthetic"]}  # the real model runs in test_gemma3.py


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_on_the_tiny_model(experiment, tmp_path):
    over = TINY + [f"experiment={experiment}", "workload.num_prompts=1", "workload.warmup=0"]
    choices = compose_cfg(over).hydra.runtime.choices
    for (g, c), extra in CPU_SHRINK.items():
        if choices[g] == c:
            over += extra
    rec = run_job(over, tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["choices"]["experiment"] == experiment and rec["metrics"]["tps"] > 0


@pytest.mark.parametrize("overrides,message", [
    (["task=ppl", "eval.corpus=/no/such/corpus.txt"], "corpus file /no/such/corpus.txt does not exist"),
    (["graphs=cuda_graph"], "graphs=cuda_graph needs a CUDA GPU"),
    (["attention=triton", "graphs=static"], "attention=triton needs a CUDA GPU"),
    (["quant.backend=triton"], "quant=bf16 needs a CUDA GPU"),
    (["device=cuda"], "device=cuda asked for, but no CUDA GPU"),
    (["weights=hf"], "weights=hf needs weights.path"),
    (["model=checkpoint"], "weights=synthetic needs a model preset"),
    (["quant=int4", "quant.backend=torch", "quant.method=awq"], "quant.method must be one of ('rtn', 'gptq')"),
    (["spec.depth=-1"], "spec depth must be a non-negative integer, got -1"),
])
def test_bad_input_gives_one_clear_message(overrides, message, tmp_path, capsys):
    import torch

    if torch.cuda.is_available() and "CUDA" in message:
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exc:
        run_job(TINY + overrides, tmp_path)
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fastgemma: error: ") and message in err[0], err
    rec = results(tmp_path)[-1]  # the failure is recorded too
    assert rec["status"] == "error" and message in rec["error"]


def test_malformed_jsonl_names_its_line(tmp_path, capsys):
    bad = tmp_path / "ppl.jsonl"
    bad.write_text('{"context_ids": [2, 5], "target_ids": [6, 7]}\n\n{"context_ids": [2, 5], "target_ids": [6,\n')
    with pytest.raises(SystemExit):
        run_job(TINY + ["task=ppl", f"eval.jsonl={bad}"], tmp_path)
    assert f"{bad}:3: not valid JSON" in capsys.readouterr().err


def test_multirun_2x2_writes_four_records_then_report(tmp_path):
    """The CLI end to end: 4 jobs, 4 records with distinct choices, and a report drawn from them."""
    r = cli(["-m", "model=gemma4_tiny", "workload=smoke", "device=cpu", "logger=jsonl", "progress=false",
             "workload.warmup=0", "eval=ppl", "eval.max_tokens=200",
             "window=native,w128", "graphs=eager,static"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = results(tmp_path)
    assert len(recs) == 4 and all(x["status"] == "ok" for x in recs)
    combos = {(x["choices"]["window"], x["choices"]["graphs"]) for x in recs}
    assert combos == {("native", "eager"), ("native", "static"), ("w128", "eager"), ("w128", "static")}
    assert len({x["run_dir"] for x in recs}) == 4
    assert r.stdout.count("[bench]") == 4

    rep = run_job(["task=report", f"task.out={tmp_path / 'report'}",
                   f"task.inputs=[{tmp_path / 'results' / 'results.jsonl'}]"], tmp_path, "report")
    assert rep["status"] == "ok", rep["error"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| baseline |" in md and "| window=w128 graphs=static |" in md
    for png in ("tps_vs_ppl", "marginal_gain", "latency_cdf"):
        data = (tmp_path / "report" / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_a_sweep_with_a_key_one_choice_lacks_stops_before_its_first_job(tmp_path):
    r = cli(["-m", "model=gemma4_tiny", "workload=smoke", "device=cpu", "logger=jsonl", "quant=bf16,int4",
             "quant.group_size=32", "quant.backend=torch"], tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == (
        "fastgemma: error: quant.group_size: quant=bf16 has no key 'group_size' (its keys: backend); the quant "
        "choices with it: int4; run quant=bf16 in a command of its own")
    assert not (tmp_path / "results").exists() and not (tmp_path / "multirun").exists()


def test_a_crashed_job_loses_no_other_record(tmp_path):
    r = cli(["-m", "model=gemma4_tiny", "workload=smoke", "device=cpu", "logger=jsonl", "progress=false",
             "workload.num_prompts=1", "workload.warmup=0", "graphs=cuda_graph,eager,static"], tmp_path)
    recs = results(tmp_path)
    status = {x["choices"]["graphs"]: x["status"] for x in recs}
    if status.get("cuda_graph") == "ok":
        pytest.skip("this machine has a GPU")
    assert status == {"cuda_graph": "error", "eager": "ok", "static": "ok"}
    assert r.returncode == 1
    assert "3 records, 2 ok, 1 failed" in r.stderr and "needs a CUDA GPU" in r.stderr


def test_challenge_workload_follows_the_contest_profile():
    import statistics

    from hydra.utils import instantiate

    wl = instantiate(compose_cfg(["workload=challenge"]).workload)
    lens = wl.prompt_lengths()
    assert len(lens) == 128 and wl.max_new_tokens == 512 and wl.warmup == 4 and wl.ignore_eos
    assert statistics.median(lens) == 230 and abs(statistics.mean(lens) - 272) < 2
    assert min(lens) >= 80 and max(lens) <= 1500
    prompts = wl.prompts(vocab_size=262144, bos_id=2, special=(0, 1, 106))
    assert [len(p.ids) for p in prompts] == lens and all(p.ids[0] == 2 for p in prompts)
    assert all(t not in (0, 1, 106) for p in prompts for t in p.ids[1:])
    again = wl.prompts(vocab_size=262144, bos_id=2, special=(0, 1, 106))
    assert [p.ids for p in again] == [p.ids for p in prompts]  # seeded
    warm = {tuple(p.ids) for p in wl.warmup_prompts(262144, 2)}
    assert len(warm) == 4 and not warm & {tuple(p.ids) for p in prompts}  # never the benchmark's own
