#!/usr/bin/env bash
# Server instructions per call of a Lua script, counted: redis-server under callgrind, driven by
# redis-benchmark (EVALSHA on 1,000 random keys, one connection), counters zeroed after a
# warm-up of 3,000 calls. To count what a statement of the script costs, copy the script, change
# the statement, and run both here.
#   bash benches/redis_script_lab.sh [CALLS] [SCRIPT ARG1 ARG2]...
# With no script: the crate's script, its lean path alone (what a one-rule spend runs: the
# script's first file, ratelimit.lua), both called as 'g' (increment 10,000, burst offset 10,000,000:
# always allowed), and the peer's script (tower-rate-limit-fred: capacity 1,000, emission
# interval 10 ms) when cargo has fetched it. Random keys move a count by about 500 from run to
# run: compare runs of 20,000 calls (the default). Needs valgrind and redis-server (installed
# when missing, as root; redis-benchmark comes with redis-server).
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
CALLS=${1:-20000}
shift $(( $# > 0 ? 1 : 0 ))
need valgrind redis-server
DIR=$(mktemp -d)
SERVER=""
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"; true; }
trap cleanup EXIT
RUNS=()
if [ $# -eq 0 ]; then
  # The script's files in the order `SCRIPT` joins them (src/backend/redis/script.rs).
  sed -n 's/.*include_str!("\([a-z_]*\.lua\)").*/src\/backend\/redis\/\1/p' src/backend/redis/script.rs |
    xargs cat > "$DIR/crate.lua"
  cp src/backend/redis/ratelimit.lua "$DIR/crate_lean_path.lua"
  RUNS+=("$DIR/crate.lua" 10000 10000000 "$DIR/crate_lean_path.lua" 10000 10000000)
  PEER=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/tower-rate-limit-fred-*/scripts/rate_limit.lua 2>/dev/null | tail -1 || true)
  [ -n "$PEER" ] && RUNS+=("$PEER" 1000 10)
else
  RUNS=("$@")
fi
[ $(( ${#RUNS[@]} % 3 )) -eq 0 ] || { echo "give each script with its two arguments"; exit 1; }
echo "Server instructions per EVALSHA (callgrind; $CALLS calls, 1,000 random keys, one connection)"
echo
echo "| script | arguments | server instructions per call |"
echo "|---|---|---:|"
for ((r = 0; r < ${#RUNS[@]}; r += 3)); do
  script=${RUNS[r]} a1=${RUNS[r + 1]} a2=${RUNS[r + 2]}
  [ -r "$script" ] || { echo "cannot read $script"; exit 1; }
  redis_under_callgrind "$DIR/cg.%p"
  SHA=$(redis-cli -p "$PORT" SCRIPT LOAD "$(cat "$script")")
  [[ "$SHA" =~ ^[0-9a-f]{40}$ ]] || { echo "$script did not load: $SHA"; exit 1; }
  check=$(redis-cli -p "$PORT" EVALSHA "$SHA" 1 lab:check "$a1" "$a2" 2>&1 | head -1)
  [[ "$check" == *ERR* ]] && { echo "$script failed: $check"; exit 1; }
  bench() { redis-benchmark -p "$PORT" -n "$1" -c 1 -r 1000 EVALSHA "$SHA" 1 'lab:__rand_int__' "$a1" "$a2" >/dev/null 2>&1; }
  bench 3000
  callgrind_control -z "$SERVER" >/dev/null 2>&1
  bench "$CALLS"
  callgrind_control -d "$SERVER" >/dev/null 2>&1
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=""
  total=0
  for f in "$DIR"/cg.*; do
    n=$(callgrind_total "$f")
    # The dump after the zeroing is the one with the measured calls: the largest.
    [ "${n:-0}" -gt "$total" ] && total=$n
  done
  rm -f "$DIR"/cg.*
  echo "| $(basename "$script") | $a1 $a2 | $(( total / CALLS )) |"
done
