#!/usr/bin/env bash
# Instructions per decision on Redis, counted (not timed): the server's (redis-server under
# callgrind, counters zeroed after the warm-up and dumped after the run, so the count is the run
# alone, networking and command parsing included) and the client's (the driver under callgrind,
# `trl_measured` only). Needs valgrind and redis-server (installed when missing, as root).
#   bash benches/redis_instructions.sh [OPS] [CONCURRENCY] [VARIANT...]
# CLUSTER=1: the server is a Redis Cluster of one master holding every slot (what each master
# of a cluster runs per command: the slot checks and routing included).
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
OPS=${1:-5000}
C=${2:-16}
shift $(( $# > 2 ? 2 : $# )) || true
VARIANTS=("$@")
[ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(baseline_evalsha ours_1_rule ours_3_rules tower_rate_limit_fred ours_1_rule_coalesced ours_calendar)
need valgrind redis-server
BIN=$(cargo bench -p tower-ratelimits-benches --bench redis_calls --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*redis_calls[^"]*\)".*/\1/p' | tail -1)
[ -x "$BIN" ] || { echo "could not build the redis_calls driver"; exit 1; }
DIR=$(mktemp -d)
SERVER=""
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; if [ -n "${TRL_KEEP:-}" ]; then echo "dumps kept in $DIR"; else rm -rf "$DIR"; fi; true; }
trap cleanup EXIT
echo "Instructions per decision on Redis${CLUSTER:+ Cluster (one master)} (callgrind; $OPS decisions at concurrency $C, 1,000 keys, all allowed)"
echo
echo "| variant | server instructions | client instructions |"
echo "|---|---:|---:|"
for v in "${VARIANTS[@]}"; do
  redis_under_callgrind "$DIR/server.$v.%p" "$([ -n "${CLUSTER:-}" ] && echo cluster)"
  READY="$DIR/ready.$v"
  : > "$READY"
  TRL_READY_FILE="$READY" valgrind --tool=callgrind --toggle-collect=trl_measured \
    --callgrind-out-file="$DIR/client.$v" "$BIN" --url "$URL" \
    --variant "$v" --ops "$OPS" --concurrency "$C" >"$DIR/client.$v.log" 2>&1 &
  CLIENT=$!
  # The client says when its warm-up is over; if it fails before (a bad variant, no Redis),
  # say why instead of waiting forever. 10 minutes at most for the warm-up under valgrind.
  waited=0
  until [ "$(cat "$READY")" = ready ]; do
    if ! kill -0 "$CLIENT" 2>/dev/null; then
      wait "$CLIENT" || true
      echo "the $v client failed before its measured loop:"
      grep -v '^==' "$DIR/client.$v.log" | grep -A2 -m1 'panicked' || tail -20 "$DIR/client.$v.log"
      exit 1
    fi
    if [ "$waited" -ge 6000 ]; then
      kill "$CLIENT" 2>/dev/null || true
      echo "the $v client did not finish its warm-up in 10 minutes:"; tail -20 "$DIR/client.$v.log"; exit 1
    fi
    sleep 0.1; waited=$((waited + 1))
  done
  callgrind_control -z "$SERVER" >/dev/null 2>&1
  echo go > "$READY"
  wait "$CLIENT"
  callgrind_control -d "$SERVER" >/dev/null 2>&1
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=""
  # The dump made by -d (the newest server file with a part number).
  DUMP=$(ls -t "$DIR"/server."$v".*.* 2>/dev/null | head -1)
  s=$(callgrind_total "$DUMP"); c=$(callgrind_total "$DIR/client.$v")
  printf '| %s | %s | %s |\n' "$v" $(( s / OPS )) $(( c / OPS ))
done
