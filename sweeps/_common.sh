# Shared by the sweep scripts: run one multirun through $LAUNCHER, remember failures, keep going.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
launcher="${LAUNCHER:-local}"
launch="$here/../launchers/$launcher.sh"
if [ ! -x "$launch" ]; then
  echo "sweeps: LAUNCHER=$launcher: no launchers/$launcher.sh (local, gpus or slurm)" >&2
  exit 2
fi
source "$here/../launchers/_require.sh"
require_fastgemma sweeps
failed=0

sweep() {  # sweep <override>... : one multirun; a failed job is counted, the next sweep still runs
  echo "== fastgemma -m $*" >&2
  "$launch" "$@" || failed=$((failed + 1))
}

finish() {
  if [ "$failed" -gt 0 ]; then
    echo "sweeps: $failed multirun(s) had failed jobs (records with status error in results/results.jsonl)" >&2
    exit 1
  fi
}
