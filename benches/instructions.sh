#!/usr/bin/env bash
# Instructions and heap allocations per operation, counted (not timed): the same numbers on a
# busy or an idle machine. Needs valgrind (installed when missing, as root).
#   bash benches/instructions.sh [OPS]
set -euo pipefail
cd "$(dirname "$0")/.."
OPS=${1:-20000}
if ! command -v valgrind >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
fi
BIN=$(cargo bench -p tower-ratelimits-benches --bench instructions --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*instructions[^"]*\)".*/\1/p' | tail -1)
[ -x "$BIN" ] || { echo "could not build the instructions bench"; exit 1; }
declare -A ALLOCS
while read -r variant allocs _; do ALLOCS[$variant]=$allocs; done < <("$BIN" --ops "$OPS" | tail -n +2)
declare -A IR
for variant in "${!ALLOCS[@]}"; do
  out=$(mktemp)
  valgrind --tool=callgrind --toggle-collect=trl_measured --callgrind-out-file="$out" \
    "$BIN" --variant "$variant" --ops "$OPS" >/dev/null 2>&1
  IR[$variant]=$(awk '/^summary:/ {print $2}' "$out")
  rm -f "$out"
done
per() { echo $(( ${IR[$1]} / OPS )); }
row() { # variant, baseline variant (ratio), subtract variant (added instructions)
  local v=$1 base=$2 sub=${3:-}
  local n; n=$(per "$v")
  local ratio; ratio=$(awk -v a="$n" -v b="$(per "$base")" 'BEGIN {printf "%.2f", a / b}')
  local added=""
  [ -n "$sub" ] && added=$(( n - $(per "$sub") ))
  printf '| %s | %s | %s | %s | %s |\n' "$v" "$n" "${ALLOCS[$v]}" "$ratio" "$added"
}
echo "Instructions per operation (callgrind, $OPS operations, 1,000 keys, every call allowed)"
echo
echo "| variant | instructions | allocations | ratio | added over bare axum |"
echo "|---|---:|---:|---:|---:|"
row governor_check_key governor_check_key
row ours_spend_one governor_check_key
row ours_limiter governor_check_key
row http_request_only http_bare
row http_bare http_bare http_bare
row http_ours_1_rule http_bare http_bare
row http_ours_1_rule_no_headers http_bare http_bare
row http_ours_3_rules http_bare http_bare
row http_tower_governor http_bare http_bare
