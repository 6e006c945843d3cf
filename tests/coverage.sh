#!/usr/bin/env bash
# Line and branch coverage of jaxrl/ over the fast, process and learning tiers, the `jaxrl`
# processes and launchers the tests start included (coverage.py's subprocess patch), of the
# tree TREE (default: this one; another checkout, an older commit's, is measured with this
# script's settings, so that two commits compare). docs/testing.md, "Coverage".
#
#   tests/coverage.sh [TREE] [-- extra pytest args]     # an hour or more on 2 cores
#
# Prints coverage's report and its total. The data stays in TREE/.coverage (combined) and in
# TREE/.coverage-data/<tier>/ (each tier's files, kept).
#
# Each tier writes its data files in a folder of its own, combined only at the end: on
# 2026-12-06 the data files that runs wrote into TREE beside TREE/.coverage were gone before
# the last tier ended (which process removed them was not found), so no tier's data waits
# where another run writes.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
tree="$here"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then tree="$(cd "$1" && pwd)"; shift; fi
[ "${1:-}" != "--" ] || shift
data="$tree/.coverage-data"
rm -rf "$data" "$tree/.coverage"
mkdir -p "$data"
cd "$tree"
rcfile() {  # rcfile DATA_FILE [PATCH]: coverage's settings, its data in DATA_FILE
  printf '[run]\nsource = %s/jaxrl\nbranch = true\nparallel = true\ndata_file = %s\n%s\n' \
    "$tree" "$1" "${2:+patch = $2}"
  printf '[report]\nprecision = 2\n'
}
for tier in fast process learning; do
  mkdir -p "$data/$tier"
  rcfile "$data/$tier/.coverage" subprocess > "$data/$tier.rc"
  marker=(); [ "$tier" = fast ] || marker=(-m "$tier")
  echo "coverage.sh: the $tier tier ($(date -u +%H:%M:%S) UTC)" >&2
  COVERAGE_RCFILE="$data/$tier.rc" coverage run -m pytest -n 2 -q -p no:cacheprovider \
      "${marker[@]}" "$@" || echo "coverage.sh: the $tier tier failed; coverage is of what ran" >&2
  echo "coverage.sh: $(find "$data/$tier" -type f | wc -l) data files of the $tier tier" >&2
done
rcfile "$tree/.coverage" > "$data/all.rc"
export COVERAGE_RCFILE="$data/all.rc"
coverage combine -q --keep "$data/fast" "$data/process" "$data/learning"
coverage report --skip-covered --sort=cover | tail -25
coverage report --format=total
