"""launchers/*.sh and the sweep scripts' shared part (sweeps/_common.sh) on a CPU: the local launcher runs a
sweep, and each script names what is missing (fastgemma off PATH, no GPU, no SLURM) instead of failing later."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fgcli_helpers import results

ROOT = Path(__file__).resolve().parents[1]


def _bash(script: str, args: list[str], cwd: Path, path: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GPUS"}
    env.update(PATH=path, OMP_NUM_THREADS="1", WANDB_MODE="disabled", **extra)
    return subprocess.run([shutil.which("bash"), str(ROOT / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _path_with_fastgemma() -> str:
    return f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"


def _bare_path(tmp: Path) -> str:
    """A PATH of links to the few tools the scripts use besides fastgemma, nvidia-smi and sbatch."""
    bin_ = tmp / "bin"
    bin_.mkdir()
    for tool in ("bash", "grep", "dirname"):
        (bin_ / tool).symlink_to(shutil.which(tool))
    return str(bin_)


def test_the_local_launcher_runs_a_sweep(tmp_path):
    if not shutil.which("fastgemma", path=_path_with_fastgemma()):
        pytest.skip("the fastgemma script is not installed beside this Python")
    r = _bash("launchers/local.sh", ["model=gemma4_tiny", "workload=smoke", "workload.num_prompts=1", "device=cpu",
                                     "logger=jsonl", "progress=false", "window=native,w128"], tmp_path,
              _path_with_fastgemma())
    assert r.returncode == 0, r.stderr[-2000:]
    recs = results(tmp_path)
    assert sorted(x["choices"]["window"] for x in recs) == ["native", "w128"]
    assert all(x["status"] == "ok" for x in recs)


@pytest.mark.parametrize("script", ["launchers/local.sh", "launchers/gpus.sh", "launchers/slurm.sh",
                                    "sweeps/window_grid.sh"])
def test_without_fastgemma_on_path_each_script_says_so(script, tmp_path):
    env_path = _bare_path(tmp_path)
    sbatch = tmp_path / "bin" / "sbatch"  # slurm.sh asks for sbatch first: give it one
    sbatch.write_text("#!/bin/sh\n")
    sbatch.chmod(0o755)
    r = _bash(script, ["model=gemma4_tiny"], tmp_path, env_path, GPUS="1")  # gpus.sh: one GPU, said so
    assert r.returncode == 127, r.stderr
    assert "fastgemma is not on PATH: activate the environment it is installed in" in r.stderr
    assert not (tmp_path / "results").exists()


def test_gpus_without_a_gpu_and_slurm_without_sbatch_say_so(tmp_path):
    env_path = _bare_path(tmp_path)
    r = _bash("launchers/gpus.sh", ["model=gemma4_tiny"], tmp_path, env_path)
    assert r.returncode == 1 and "launchers/gpus.sh: no GPU found" in r.stderr
    r = _bash("launchers/slurm.sh", ["model=gemma4_tiny"], tmp_path, env_path)
    assert r.returncode == 1 and "sbatch not found: this is not a SLURM login node" in r.stderr
