#!/usr/bin/env bash
# Bytes per live key in memory, ours against governor: the RSS growth while N keys are added,
# divided by N, each store in a process of its own (so none reuses memory another freed), then
# the RSS once the keys went idle and were cleaned up.
#   bash benches/memory.sh [KEYS...]      (1,000,000 and 10,000,000 unless told)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- 1000000 10000000
export CARGO_PROFILE_BENCH_CODEGEN_UNITS=${CARGO_PROFILE_BENCH_CODEGEN_UNITS:-1}
BIN=$(cargo bench -p tower-ratelimits-benches --bench instructions --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*instructions[^"]*\)".*/\1/p' | tail -1)
[ -x "$BIN" ] || { echo "could not build the instructions bench"; exit 1; }
echo "| store | keys | bytes per live key | RSS before (MiB) | with the keys | after they went idle and were cleaned up |"
echo "|---|---:|---:|---:|---:|---:|"
for keys in "$@"; do
  for store in ours_numbers ours_text ours_banned governor; do
    "$BIN" --memory "$store" --keys "$keys" |
      awk '{printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6}'
  done
done
