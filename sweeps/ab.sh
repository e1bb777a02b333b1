#!/usr/bin/env bash
# Before and after on one GPU machine: parts of sweeps/h200.sh run with an earlier revision's package,
# then with this checkout's, part by part (base then new), logs under $OUT/base and $OUT/new (or
# ./results/h200/{base,new}); each call prints its part's tables, base first.
#
#   bash sweeps/ab.sh prepare REV      here, before the GPU call: REV's src/fastgemma and conf/ into .ab/<short sha>
#                                      (git-ignored through .git/info/exclude); carry ".ab" with the call
#   bash sweeps/ab.sh REV PART...      on the GPU machine: each PART (h200.sh's names) for REV, then for
#                                      this checkout; h200.sh's variables (STACK_ARGS, SPEC_ARGS, MMA_TRY,
#                                      <PART>_S, ...) apply to both
#
# AB_DIR (default .ab) is where revisions are kept. Two processes per part on one machine, base first
# (AB_FIRST=new: this checkout first). The first process also fills the compile caches, and the order
# can show in the figures (runs FB / FC: the second int4 step 0.02-0.03 ms faster whichever code it
# ran), so repeat a part with the order swapped when its rows are close. The int4, mma and fold parts
# import kernels.w4a16_bench / mma_bench / mma_table, which revisions before a2bb2b0 do not have.
set -u
cd "$(dirname "$0")/.."
ab_dir="${AB_DIR:-.ab}"

if [ $# -lt 2 ]; then
  echo "usage: bash sweeps/ab.sh prepare REV | bash sweeps/ab.sh REV PART..." >&2
  exit 2
fi

if [ "$1" = prepare ]; then
  sha=$(git rev-parse --short "$2^{commit}" 2>/dev/null) || { echo "ab.sh: $2 is not a commit here" >&2; exit 2; }
  mkdir -p "$ab_dir/$sha"
  # conf/ beside src/: the CLI (the cli part) reads its config groups from there
  git archive "$sha" src/fastgemma conf | tar -x -C "$ab_dir/$sha" || exit 1
  if [ "$ab_dir" = .ab ] && ! grep -qx "/.ab/" .git/info/exclude 2>/dev/null; then
    echo "/.ab/" >> .git/info/exclude
  fi
  echo "$2 = $sha in $ab_dir/$sha: src, conf ($(du -sh "$ab_dir/$sha" | cut -f1)); on the GPU: bash sweeps/ab.sh $sha PART... (carry \"$ab_dir\")"
  exit 0
fi

rev=$1; shift
case $ab_dir in /*) base_src="$ab_dir/$rev/src" ;; *) base_src="$PWD/$ab_dir/$rev/src" ;; esac
if [ ! -f "$base_src/fastgemma/__init__.py" ]; then
  echo "ab.sh: no package for $rev under $ab_dir/$rev/src: run 'bash sweeps/ab.sh prepare $rev' first and carry \"$ab_dir\"" >&2
  exit 2
fi
out="${OUT:-$PWD/results/h200}"
base() {
  echo "########## $1: base ($rev)"
  PYTHONPATH="$base_src${PYTHONPATH:+:$PYTHONPATH}" OUT="$out/base" bash sweeps/h200.sh "$1"
}
new() {
  echo "########## $1: new (this checkout)"
  OUT="$out/new" bash sweeps/h200.sh "$1"
}
case "${AB_FIRST:-base}" in
  base|new) ;;
  *) echo "ab.sh: AB_FIRST is base or new, got '$AB_FIRST'" >&2; exit 2 ;;
esac
for p in "$@"; do
  if [ "${AB_FIRST:-base}" = new ]; then new "$p"; base "$p"; else base "$p"; new "$p"; fi
done
