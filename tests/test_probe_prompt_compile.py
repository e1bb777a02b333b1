"""sweeps/probes/prompt_compile.py: E4B's layer layout at toy width, its arguments checked, one short run."""
import importlib.util
from pathlib import Path

import pytest

from fastgemma.model.config import GEMMA4_E4B

PROBE = Path(__file__).resolve().parents[1] / "sweeps" / "probes" / "prompt_compile.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("prompt_compile", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_toy_config_keeps_e4bs_layout(probe):
    full = probe.toy_config(42)
    assert full.layer_types == GEMMA4_E4B.layer_types and full.num_kv_shared_layers == 18
    assert full.hidden_size == 64 and full.vocab_size == 512
    cut = probe.toy_config(12)
    assert cut.layer_types == GEMMA4_E4B.layer_types[:12] and cut.num_kv_shared_layers == 6
    for bad in (6, 13, 48):
        with pytest.raises(SystemExit, match="--layers"):
            probe.toy_config(bad)


@pytest.mark.parametrize("argv, match", [(["--mode", "false"], "--mode"), (["--mode", "layer"], "--mode"),
                                         (["--mode", "true", "--prompt-lens", "0"], "--prompt-lens")])
def test_bad_arguments_are_refused(probe, argv, match):
    with pytest.raises(SystemExit, match=match):
        probe.main(argv)


def test_a_short_run_reports_each_prompt(probe, capsys):
    probe.main(["--mode", "layers", "--layers", "12", "--prompt-lens", "20,7", "--chunk", "16", "--window", "8"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("compile_prefill=layers, 12 layers (6 KV-shared), chunk 16: 20 tokens")
    diffs = [float(part.split("eager ")[1].rstrip(")")) for part in line.split("; ") if "eager" in part]
    assert len(diffs) == 2 and max(diffs) < 1e-4
