#!/usr/bin/env bash
# Line and branch coverage of jaxrl/ over the fast, process and learning tiers, the `jaxrl`
# processes and launchers the tests start included (coverage.py's subprocess patch), of the
# tree TREE (default: this one; another checkout, an older commit's, is measured with this
# script's settings, so that two commits compare). docs/testing.md, "Coverage".
#
#   tests/coverage.sh [TREE] [-- extra pytest args]     # minutes to an hour on 2 cores
#
# Prints coverage's report and its total; the data stays in TREE/.coverage.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(cd "${1:-$here}" && pwd)"; shift || true
[ "${1:-}" != "--" ] || shift
rc="$(mktemp)"
cat > "$rc" <<EOF
[run]
source = $tree/jaxrl
branch = true
parallel = true
patch = subprocess
data_file = $tree/.coverage
[report]
precision = 2
EOF
export COVERAGE_RCFILE="$rc"
cd "$tree"
rm -f .coverage .coverage.*
for tier in "" process learning; do
  coverage run -m pytest -n 2 -q -p no:cacheprovider ${tier:+-m $tier} "$@" || {
    echo "coverage.sh: the ${tier:-fast} tier failed (exit $?); coverage is of what ran" >&2; }
done
coverage combine -q
coverage report --skip-covered --sort=cover | tail -25
coverage report --format=total
