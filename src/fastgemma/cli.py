"""`fastgemma`: the Hydra entry point. `fastgemma task=bench quant=int4 window=192`, or `-m` to sweep.

Every run (but report) writes one record: record.json in its Hydra run directory, a line in the
results JSONL and, with logger=wandb, a W&B run; it prints one result line. A bad config or input
gives one line on stderr and exit status 1. In a multirun a failed job writes its record with
status "error" and the sweep goes on; SweepSummary then lists the failures and exits 1.
"""
from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from . import build
from .engine.cache import CacheError
from .engine.generator import GenerationError
from .model.config import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
log = logging.getLogger("fastgemma")

# errors that come from the config or the input, not from a bug: one line, no traceback
USER_ERRORS = (build.BuildError, ConfigError, CacheError, GenerationError, FileNotFoundError, ValueError,
               ImportError, NotImplementedError)
try:
    from .weights.hf import CheckpointError

    USER_ERRORS += (CheckpointError,)
except ImportError:  # pragma: no cover
    pass


def choices_of(hc) -> dict:
    return {k: v for k, v in hc.runtime.choices.items() if v is not None and not k.startswith("hydra")}


def _config_dict(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # an interpolation that only fails at run time: keep it as written
        return OmegaConf.to_container(cfg, resolve=False)


def run(cfg: DictConfig):
    """One job: build, run the task, record. Returns the record (multirun keeps going on errors)."""
    from .tasks import run_task
    from .tracking.environment import hardware, software
    from .tracking.loggers import DisabledLogger
    from .tracking.record import new_record, result_line, result_table, write_record

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    choices = choices_of(hc)
    out_dir = Path(hc.runtime.output_dir)
    task = cfg.task.name
    sweep = {"dir": hc.sweep.dir, "job_num": hc.job.num} if multirun else None
    record = new_record(task, choices, list(hc.overrides.task), out_dir, _config_dict(cfg), sweep)
    record["software"] = software()
    logger, failure, ctx = None, None, None
    try:
        logger = build.instantiate_group(cfg, "logger", choices) or DisabledLogger()
        ctx = build.build_context(cfg, choices, out_dir, hc.job.num if multirun else None)
        metrics, details = run_task(ctx)
        record.update(status="ok", metrics=metrics, details=details)
    except Exception as err:  # recorded, then reported below
        failure = err
        record.update(status="error", error=f"{type(err).__name__}: {err}")
        (out_dir / "error.txt").write_text(traceback.format_exc())
    if ctx is not None and ctx.factory is not None:
        record["details"] = {**record["details"], **ctx.factory.describe()}
        record["hardware"] = hardware(ctx.factory.device)
    elif task != "report":
        import torch

        record["hardware"] = hardware(torch.device("cpu"))

    if task != "report":
        where = [str(write_record(record, out_dir))]
        if logger is not None:
            try:
                where += [str(v) for k, v in logger.log(record).items() if k in ("results", "wandb_dir")]
            except Exception as err:  # the run's own record is safe in the run dir; say why the rest is not
                print(f"fastgemma: warning: logger={choices.get('logger')} failed: {type(err).__name__}: {err}",
                      file=sys.stderr)
        if failure is None:
            print(result_line(record))
            if cfg.task.get("table"):
                print(result_table(record))
            log.info("record: %s", ", ".join(where))
    if failure is None:
        return record
    user = isinstance(failure, USER_ERRORS)
    msg = f"fastgemma: error: {failure}" if user else f"fastgemma: error: {type(failure).__name__}: {failure}"
    if multirun:
        print(msg + f" (job {hc.job.num}; traceback in {out_dir / 'error.txt'})", file=sys.stderr)
        return record
    if not user:
        raise failure
    print(msg, file=sys.stderr)
    sys.exit(1)


class SweepSummary(Callback):
    """After a multirun: one line per failed job, and exit status 1 if any failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        import json

        sweep = Path(config.hydra.sweep.dir)
        records = []
        for f in sorted(sweep.rglob("record.json")):
            try:
                records.append(json.loads(f.read_text()))
            except (OSError, json.JSONDecodeError):
                continue
        bad = [r for r in records if r.get("status") != "ok"]
        print(f"fastgemma: sweep {sweep}: {len(records)} records, {len(records) - len(bad)} ok, {len(bad)} failed",
              file=sys.stderr)
        for r in bad:
            print(f"  job {(r.get('sweep') or {}).get('job_num')}: {' '.join(r.get('overrides', []))}: {r.get('error')}",
                  file=sys.stderr)
        if bad:
            sys.exit(1)


def main():
    if not CONF_DIR.is_dir():
        sys.exit(f"fastgemma: error: config directory {CONF_DIR} not found (install the repository with "
                 "`pip install -e .` so that conf/ sits beside src/)")
    from .sweep_check import key_mismatches

    bad = key_mismatches(sys.argv[1:], CONF_DIR)
    if bad:
        sys.exit("\n".join(f"fastgemma: error: {m}" for m in bad))
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(run)()


if __name__ == "__main__":
    main()
