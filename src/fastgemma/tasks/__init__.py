"""Tasks: bench, ppl, identity, generate, report. Each module has run(ctx) -> (metrics, details)."""
from __future__ import annotations

import importlib

TASKS = ("bench", "ppl", "identity", "generate", "report")


def run_task(ctx):
    if ctx.task not in TASKS:
        raise ValueError(f"task={ctx.task!r} is not one of {', '.join(TASKS)}")
    return importlib.import_module(f"{__name__}.{ctx.task}").run(ctx)
