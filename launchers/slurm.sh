#!/usr/bin/env bash
# A SLURM cluster: every job of the sweep is an sbatch array task with one GPU (hydra-submitit-launcher).
# Cluster settings go on the command line or in conf/hydra/launcher/slurm.yaml:
#   launchers/slurm.sh hydra.launcher.partition=gpu hydra.launcher.account=me quant=bf16,int4
set -euo pipefail
if ! command -v sbatch >/dev/null; then
  echo "launchers/slurm.sh: sbatch not found: this is not a SLURM login node" >&2
  exit 1
fi
source "$(dirname "${BASH_SOURCE[0]}")/_require.sh"
require_fastgemma launchers/slurm.sh
exec fastgemma -m hydra/launcher=slurm "$@"
