"""Hardware and software facts stored with every record (read, never set)."""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd=None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def git_facts() -> dict:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return {"git_commit": None, "git_dirty": None}
    commit = _run(["git", "rev-parse", "HEAD"], cwd=REPO)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO)
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device) -> dict:
    import torch

    facts = {"device": str(device), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
             "gpu_name": None, "gpu_count": 0, "gpu_memory_gb": None, "driver": None, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        idx = device.index if getattr(device, "type", "") == "cuda" and device.index is not None else 0
        p = torch.cuda.get_device_properties(idx)
        facts.update(gpu_name=p.name, gpu_count=torch.cuda.device_count(),
                     gpu_memory_gb=round(p.total_memory / 2**30, 1))
        if shutil.which("nvidia-smi"):
            out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={idx}"])
            facts["driver"] = out.splitlines()[0].strip() if out else None
    return facts


def software() -> dict:
    return {"python": platform.python_version(), "torch": _version("torch"), "triton": _version("triton"),
            "transformers": _version("transformers"), "hydra": _version("hydra-core"),
            "wandb": _version("wandb"), "fastgemma": _version("fastgemma"),
            "platform": platform.platform(), "argv": sys.argv[1:], **git_facts()}
