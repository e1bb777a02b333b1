#!/usr/bin/env bash
# One host, several GPUs: one job per GPU at a time (submitit's local executor, batches of N jobs;
# device=auto gives job n GPU n % N). N = $GPUS, else every GPU nvidia-smi lists.
#   launchers/gpus.sh window=native,w256,w192,w188,w160,w128 quant=bf16,int4
set -euo pipefail
n="${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}"
if [ -z "$n" ] || [ "$n" -lt 1 ]; then
  echo "launchers/gpus.sh: no GPU found (nvidia-smi -L lists none); use launchers/local.sh, or set GPUS=N" >&2
  exit 1
fi
source "$(dirname "${BASH_SOURCE[0]}")/_require.sh"
require_fastgemma launchers/gpus.sh
exec fastgemma -m hydra/launcher=gpus hydra.launcher.gpus_per_node="$n" hydra.sweeper.max_batch_size="$n" "$@"
