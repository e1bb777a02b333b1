#!/usr/bin/env bash
# Local, sequential: Hydra's basic launcher runs the sweep's jobs one after another in this process.
#   launchers/local.sh window=native,w192 quant=bf16,int4 [more overrides]
command -v fastgemma >/dev/null || {
  echo "launchers/local.sh: fastgemma is not on PATH: activate the environment it is installed in (. .venv/bin/activate)," \
       "or install it there (pip install -e .)" >&2
  exit 127
}
exec fastgemma -m hydra/launcher=basic "$@"
