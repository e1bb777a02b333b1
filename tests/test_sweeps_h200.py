"""sweeps/h200.sh without a GPU: the cli part under another name keeps its own log and run folder, and the
summary reads them."""
import os
import subprocess
import sys
from pathlib import Path

from fgcli_helpers import TINY

ROOT = Path(__file__).parents[1]


def _h200(*parts, env):
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(["bash", "sweeps/h200.sh", *parts], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PATH": path, **env})


def test_two_cli_runs_in_one_call_keep_both(tmp_path):
    args = " ".join(a for a in TINY if not a.startswith(("logger=", "progress="))) + \
        f" task=bench workload.num_prompts=1 workload.warmup=0 logger.results={tmp_path}/results.jsonl"
    for name in ("cli_a", "cli"):
        r = _h200("cli", env={"OUT": str(tmp_path), "CLI_ARGS": args, "CLI_NAME": name})
        assert r.returncode == 0, r.stderr
        assert f"##### {name}" in r.stdout and "[bench] model=gemma4_tiny" in r.stdout, r.stdout[-3000:]
        assert (tmp_path / f"{name}.log").is_file() and (tmp_path / name / "record.json").is_file()
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2


def test_a_cli_name_that_is_no_file_name_is_refused(tmp_path):
    r = _h200("cli", env={"OUT": str(tmp_path), "CLI_NAME": "../x"})
    assert r.returncode == 2 and "CLI_NAME is lower-case letters" in r.stderr
