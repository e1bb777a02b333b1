# Sourced by the launchers and sweeps/_common.sh: stop with one line when fastgemma is not on PATH.
require_fastgemma() {  # require_fastgemma WHO
  command -v fastgemma >/dev/null && return 0
  echo "$1: fastgemma is not on PATH: activate the environment it is installed in (. .venv/bin/activate)," \
       "or install it there (pip install -e .)" >&2
  exit 127
}
