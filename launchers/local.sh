#!/usr/bin/env bash
# Local, sequential: Hydra's basic launcher runs the sweep's jobs one after another in this process.
#   launchers/local.sh window=native,w192 quant=bf16,int4 [more overrides]
exec fastgemma -m hydra/launcher=basic "$@"
