#!/usr/bin/env bash
# Local, sequential: Hydra's basic launcher runs the sweep's jobs one after another in this process.
#   launchers/local.sh window=native,w192 quant=bf16,int4 [more overrides]
source "$(dirname "${BASH_SOURCE[0]}")/_require.sh"
require_fastgemma launchers/local.sh
exec fastgemma -m hydra/launcher=basic "$@"
