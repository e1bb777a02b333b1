"""sweeps/ab.sh: a revision's package exported for before / after runs, and its refusals."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _ab(*args, env=None):
    return subprocess.run(["bash", "sweeps/ab.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_prepare_exports_the_package_of_a_revision(tmp_path):
    r = _ab("prepare", "HEAD", env={"AB_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    pkg = tmp_path / sha / "src" / "fastgemma"
    assert (pkg / "__init__.py").is_file() and (pkg / "kernels" / "mma_w4a16.py").is_file()
    # the exported files are the revision's, byte for byte
    shown = subprocess.run(["git", "show", f"{sha}:src/fastgemma/kernels/mma_w4a16.py"], cwd=ROOT,
                           capture_output=True).stdout
    assert (pkg / "kernels" / "mma_w4a16.py").read_bytes() == shown
    # and its config groups beside src/, where the CLI looks for them (the cli part)
    assert (tmp_path / sha / "conf" / "config.yaml").is_file() and (tmp_path / sha / "conf" / "spec").is_dir()
    assert f"bash sweeps/ab.sh {sha} PART" in r.stdout


def test_refusals(tmp_path):
    r = _ab("prepare", "no-such-revision", env={"AB_DIR": str(tmp_path)})
    assert r.returncode == 2 and "is not a commit" in r.stderr
    r = _ab("abc1234", "stack", env={"AB_DIR": str(tmp_path)})
    assert r.returncode == 2 and "run 'bash sweeps/ab.sh prepare abc1234' first" in r.stderr
    r = _ab("prepare")
    assert r.returncode == 2 and "usage" in r.stderr


def test_each_part_runs_for_the_base_then_this_checkout(tmp_path):
    assert _ab("prepare", "HEAD", env={"AB_DIR": str(tmp_path / "ab")}).returncode == 0
    sha = next((tmp_path / "ab").iterdir()).name
    # an unknown part: h200.sh refuses it in both runs (no GPU needed), base first
    r = _ab(sha, "nosuchpart", env={"AB_DIR": str(tmp_path / "ab"), "OUT": str(tmp_path / "out")})
    lines = r.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("##########")]
    assert [lines[i] for i in heads] == [f"########## nosuchpart: base ({sha})", "########## nosuchpart: new (this checkout)"]
    assert r.stdout.count("unknown part nosuchpart") == 2
    assert (tmp_path / "out" / "base").is_dir() and (tmp_path / "out" / "new").is_dir()
    # AB_FIRST=new swaps the order; anything else is refused before a part runs
    r = _ab(sha, "nosuchpart", env={"AB_DIR": str(tmp_path / "ab"), "OUT": str(tmp_path / "out"), "AB_FIRST": "new"})
    heads = [line for line in r.stdout.splitlines() if line.startswith("##########")]
    assert heads == ["########## nosuchpart: new (this checkout)", f"########## nosuchpart: base ({sha})"]
    r = _ab(sha, "nosuchpart", env={"AB_DIR": str(tmp_path / "ab"), "AB_FIRST": "old"})
    assert r.returncode == 2 and "AB_FIRST is base or new" in r.stderr and "##########" not in r.stdout
