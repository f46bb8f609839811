#!/usr/bin/env bash
# Recounts the in-process rows of BENCHMARKS.md ("Counted in process, checked by CI") and fails
# when one moved more than 0.3% (callgrind counts are exact for one toolchain and one build:
# rust-toolchain.toml pins the toolchain). CI runs it; after a change that moves a row, run it
# and copy the table it prints into BENCHMARKS.md with the commit.
#   bash benches/recount.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TABLE_START='<!-- recount: start -->'
TABLE_END='<!-- recount: end -->'
# The rows written: `| variant | instructions | allocations | commit |`.
written=$(sed -n "/$TABLE_START/,/$TABLE_END/p" BENCHMARKS.md | grep -E '^\| [a-z0-9_]+ \| [0-9,]+ \|' || true)
[ -n "$written" ] || { echo "BENCHMARKS.md has no rows between '$TABLE_START' and '$TABLE_END'"; exit 1; }
variants=$(echo "$written" | awk -F'|' '{gsub(/ /, "", $2); print $2}')
# shellcheck disable=SC2086
counted=$(bash benches/instructions.sh 20000 1000 $variants)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
failed=0
echo "| variant | instructions | allocations | measured at |"
echo "|---|---:|---:|---|"
while IFS='|' read -r _ variant was _ _; do
  variant=${variant// /}
  was=${was//[ ,]/}
  line=$(echo "$counted" | grep -E "^\| $variant \|" || true)
  [ -n "$line" ] || { echo "no count for $variant"; failed=1; continue; }
  now=$(echo "$line" | awk -F'|' '{gsub(/ /, "", $3); print $3}')
  allocs=$(echo "$line" | awk -F'|' '{gsub(/ /, "", $4); print $4}')
  echo "| $variant | $now | $allocs | $commit |"
  # More than 0.3% off the row (in either direction: a row that got cheaper is updated too).
  if awk -v a="$now" -v b="$was" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d * 1000 > b * 3) }'; then
    echo "  ^ $variant: written $was, counted $now (more than 0.3% off)" >&2
    failed=1
  fi
done <<< "$written"
if [ "$failed" -ne 0 ]; then
  echo "recount: rows of BENCHMARKS.md no longer reproduce; the table above is this build's" >&2
  exit 1
fi
echo "recount: every row within 0.3%"
