"""Trackers. Every one writes the same record; they differ in where it goes.

- JsonlLogger: append to the results JSONL.
- WandbLogger: the JSONL line too, plus a W&B run for each job that succeeded (mode offline by
  default: no server needed, `wandb sync <dir>/wandb/offline-run-*` uploads later; online when
  asked; disabled). The config choices are the run's W&B config and its tags (`quant=int4`);
  metrics go to the summary. A failed job's record stays in record.json and the JSONL.
- DisabledLogger: nothing beyond the run directory's record.json.
"""
from __future__ import annotations

import os
from pathlib import Path

from .jsonl import append_jsonl
from .record import _clean


class DisabledLogger:
    name = "disabled"

    def log(self, record: dict) -> dict:
        return {}


class JsonlLogger:
    name = "jsonl"

    def __init__(self, results: str = "results/results.jsonl"):
        self.results = Path(results).expanduser()

    def log(self, record: dict) -> dict:
        return {"results": str(append_jsonl(self.results, record))}


_MODES = ("offline", "online", "disabled")


class WandbLogger(JsonlLogger):
    name = "wandb"

    def __init__(self, results: str = "results/results.jsonl", mode: str = "offline", project: str = "fastgemma",
                 entity: str | None = None, dir: str | None = None, group: str | None = None,
                 tags: list | None = None, name: str | None = None):
        super().__init__(results)
        if mode not in _MODES:
            raise ValueError(f"logger.mode must be one of {', '.join(_MODES)}, got {mode!r}")
        self.mode, self.project, self.entity, self.dir = mode, project, entity, dir
        self.group, self.tags, self.run_name = group, list(tags or []), name

    def log(self, record: dict) -> dict:
        out = super().log(record)
        if self.mode == "disabled" or record.get("status") != "ok":  # failures: record.json + JSONL only
            return out
        import wandb

        choices = record.get("choices", {})
        metrics = {k: v for k, v in record.get("metrics", {}).items() if isinstance(v, (int, float)) and v is not None}
        wdir = self.dir or os.environ.get("WANDB_DIR") or record.get("run_dir") or "."
        Path(wdir).mkdir(parents=True, exist_ok=True)
        tags = [f"{k}={v}" for k, v in sorted(choices.items())][:60] + self.tags
        run = wandb.init(
            project=self.project, entity=self.entity, dir=str(wdir), mode=self.mode, group=self.group,
            name=self.run_name or record.get("run_id"), job_type=record.get("task"),
            tags=[t[:64] for t in tags], reinit="finish_previous", settings=wandb.Settings(quiet=True),
            config=_clean({"choices": choices, **choices, "task": record.get("task"),
                           "config": record.get("config"), "hardware": record.get("hardware"),
                           "software": record.get("software")}),
        )
        try:
            run.log(metrics)
            run.summary.update({**metrics, "status": record.get("status"), "run_id": record.get("run_id")})
            if record.get("error"):
                run.summary["error"] = record["error"][:2000]
            out["wandb_dir"] = str(Path(run.dir).parent) if getattr(run, "dir", None) else str(wdir)
            out["wandb_id"] = run.id
        finally:
            run.finish(exit_code=0 if record.get("status") == "ok" else 1)
        return out
