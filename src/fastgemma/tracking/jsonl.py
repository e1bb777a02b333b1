"""Results JSONL: one line per run, appended under an exclusive lock, flushed and fsynced.

Each job writes its own line as one write() the moment it ends (crashed or not), so a job that
dies later, or a sibling job on another GPU, cannot lose or tear it. Readers skip a torn or foreign
line with a warning that names it.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path

from .record import to_json


def append_jsonl(path, record: dict) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (to_json(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line)
        os.fsync(fd)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return path


def read_records(paths, warn=None) -> list[dict]:
    """Records from JSONL files, record.json files, or directories (searched for both)."""
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    out = []
    for p in paths:
        p = Path(p).expanduser()
        if p.is_dir():
            files = sorted(p.rglob("*.jsonl")) + sorted(p.rglob("record.json"))
        elif p.exists():
            files = [p]
        else:
            raise FileNotFoundError(f"results path {p} does not exist (task=bench runs started in a folder append "
                                    "to its results/results.jsonl; task.inputs=[PATH, ...] names JSONL files, "
                                    "record.json files or run folders)")
        for f in files:
            if f.suffix == ".json":
                try:
                    out.append(json.loads(f.read_text()))
                except (OSError, json.JSONDecodeError) as err:
                    warn(f"{f}: skipped, not a JSON record ({err})")
                continue
            with f.open("r", encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as err:
                        warn(f"{f}:{n}: skipped, not valid JSON ({err.msg})")
                        continue
                    if not isinstance(rec, dict) or "metrics" not in rec or "choices" not in rec:
                        warn(f"{f}:{n}: skipped, not a fastgemma record")
                        continue
                    out.append(rec)
    return out
