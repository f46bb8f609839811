#!/usr/bin/env bash
# Instructions and heap allocations per operation, counted (not timed): the same numbers on a
# busy or an idle machine. Needs valgrind (installed when missing, as root).
#   bash benches/instructions.sh [OPS] [KEYS] [VARIANT...]
# KEYS: keys cycled through (1,000 unless told; the growth table uses 1k to 10M with the three
# in-memory variants). VARIANTs: only those rows (all unless told).
# Counted with one codegen unit unless CARGO_PROFILE_BENCH_CODEGEN_UNITS says otherwise: with
# 16, a change anywhere in the crate moves helpers between units and the counts by up to 60.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
OPS=${1:-20000}
KEYS=${2:-1000}
shift $(( $# < 2 ? $# : 2 ))
ONLY=$(IFS=,; echo "$*")
export CARGO_PROFILE_BENCH_CODEGEN_UNITS=${CARGO_PROFILE_BENCH_CODEGEN_UNITS:-1}
need valgrind
BIN=$(cargo bench -p tower-ratelimits-benches --bench instructions --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*instructions[^"]*\)".*/\1/p' | tail -1)
[ -x "$BIN" ] || { echo "could not build the instructions bench"; exit 1; }
declare -A ALLOCS
while read -r variant allocs _; do ALLOCS[$variant]=$allocs; done < <("$BIN" --ops "$OPS" --keys "$KEYS" ${ONLY:+--variants "$ONLY"} | tail -n +2)
for v in "$@"; do
  [ -n "${ALLOCS[$v]:-}" ] || { echo "no such variant: $v (see VARIANTS in benches/instructions.rs)"; exit 1; }
done
declare -A IR
for variant in "${!ALLOCS[@]}"; do
  out=$(mktemp)
  valgrind --tool=callgrind --toggle-collect=trl_measured --callgrind-out-file="$out" \
    "$BIN" --variant "$variant" --ops "$OPS" --keys "$KEYS" >/dev/null 2>&1
  IR[$variant]=$(callgrind_total "$out")
  rm -f "$out"
done
per() { echo $(( ${IR[$1]} / OPS )); }
row() { # variant, baseline variant (ratio), subtract variant (added instructions)
  local v=$1 base=$2 sub=${3:-}
  [ -n "${IR[$v]:-}" ] || return 0
  local n; n=$(per "$v")
  local ratio=- added=
  [ -n "${IR[$base]:-}" ] && ratio=$(awk -v a="$n" -v b="$(per "$base")" 'BEGIN {printf "%.2f", a / b}')
  [ -n "$sub" ] && [ -n "${IR[$sub]:-}" ] && added=$(( n - $(per "$sub") ))
  printf '| %s | %s | %s | %s | %s |\n' "$v" "$n" "${ALLOCS[$v]}" "$ratio" "$added"
}
echo "Instructions per operation (callgrind, $OPS operations, $KEYS keys, every call allowed," \
  "$CARGO_PROFILE_BENCH_CODEGEN_UNITS codegen unit(s))"
echo
echo "| variant | instructions | allocations | ratio | added over bare axum |"
echo "|---|---:|---:|---:|---:|"
row governor_check_key governor_check_key
row ours_spend_one governor_check_key
row ours_calendar_spend governor_check_key
row ours_fair_share_spend governor_check_key
row ours_concurrency_slot governor_check_key
row ours_adaptive_slot governor_check_key
row ours_adaptive_pool_slot governor_check_key
row ours_limiter governor_check_key
row ours_limiter_penalty ours_limiter ours_limiter
row ours_stream_message ours_limiter ours_limiter
row ours_stream_message_ahead ours_limiter ours_limiter
row http_request_only http_bare
row http_bare http_bare http_bare
row http_ours_1_rule http_bare http_bare
row http_ours_1_rule_no_headers http_bare http_bare
row http_ours_1_rule_count_when http_ours_1_rule http_ours_1_rule
row http_ours_1_rule_count_when_penalty http_ours_1_rule_count_when http_ours_1_rule_count_when
row http_ours_2_rules http_bare http_bare
row http_ours_2_rules_same_header http_bare http_bare
row http_ours_3_rules http_bare http_bare
row http_ours_4_rules http_bare http_bare
row http_ours_8_rules http_bare http_bare
row http_tower_governor http_bare http_bare
row http_ours_1_rule_refused http_bare http_bare
row http_ours_1_rule_refused_no_body http_bare http_bare
row http_tower_governor_refused http_bare http_bare
row http_handwritten http_bare http_bare
row http_handwritten_fields http_bare http_bare
row http_handwritten_refused http_bare http_bare
