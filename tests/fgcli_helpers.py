"""Helpers for the CLI / config tests: compose the real config and run a job in-process."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# the tiny model on a CPU, quick: every job in these tests starts from this
TINY = ["model=gemma4_tiny", "workload=smoke", "device=cpu", "threads=1", "logger=jsonl", "progress=false"]


def compose_cfg(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def run_job(overrides: list[str], workdir: Path, name: str = "run"):
    """One job as `fastgemma <overrides>` would run it, with its run dir under workdir."""
    from fastgemma import cli

    cfg = compose_cfg(overrides)
    out = Path(workdir) / "outputs" / name
    out.mkdir(parents=True, exist_ok=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out)
        cfg.hydra.runtime.cwd = str(workdir)
        cfg.hydra.overrides.task = list(overrides)
    HydraConfig.instance().set_config(cfg)
    return cli.run(cfg)


def results(workdir: Path) -> list[dict]:
    path = Path(workdir) / "results" / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cli(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "fastgemma.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def wandb_offline_summary(run_file: Path) -> dict:
    """The last summary a W&B offline run file (run-<id>.wandb) holds: its records are protobufs in
    LevelDB log framing (32 KiB blocks; chunk = crc32, length, type; 7-byte file header). A record
    whose chunk runs past the file's end is still being written: the records before it are read."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B", "not a W&B datastore file"
    block, pos, buf, out, tags = 32768, 7, b"", {}, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + n > len(data):  # a record still being written (the writer flushes after the run)
            break
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            rec = pb.Record()
            try:
                rec.ParseFromString(buf)
            except DecodeError:
                if pos + 7 > len(data):  # the file's last record, its bytes not all written yet
                    break
                raise
            which = rec.WhichOneof("record_type")
            if which == "summary":
                out.update({i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
            elif which == "run":
                tags = list(rec.run.tags)
    out["_tags"] = tags
    return out
