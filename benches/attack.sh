#!/usr/bin/env bash
# Under attack: one client floods `axum_redis` (the quickstart on Redis: 20/s per IP) so that
# almost every request is denied, with the local deny cache on and then off. Reports Redis
# commands per denied request (from `INFO commandstats`, before and after), requests/s and
# p99. Starts its own redis-server on a free loopback port (or uses REDIS_URL's host:port if
# set); installs wrk and redis-server when missing (Debian, as root).
#
#   bash benches/attack.sh                    # DURATION=5s CONNECTIONS=16
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
DURATION=${DURATION:-5s}
CONNECTIONS=${CONNECTIONS:-16}

need wrk redis-server
cargo build -q --release --features redis --example axum_redis
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
wait_port() {
  for _ in $(seq 1 250); do listening "$1" && return 0; sleep 0.02; done
  echo "nothing listens on $1"; cat "$WORK"/*.log; exit 1
}

if [ -n "${REDIS_URL:-}" ]; then
  RPORT=$(sed -E 's#.*:([0-9]+)/?.*#\1#' <<<"$REDIS_URL")
else
  RPORT=$(free_port)
  redis-server --port "$RPORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" \
    >"$WORK/redis.log" 2>&1 &
  PIDS+=($!)
  wait_port "$RPORT"
  REDIS_URL="redis://127.0.0.1:$RPORT"
fi

# "<all command calls> <script calls>" so far, not counting INFO itself. Commands a script
# runs (TIME, GET, SET) count among all calls; script calls are the round trips.
calls() {
  redis-cli -p "$RPORT" info commandstats |
    awk -F'[:=,]' '/^cmdstat_/ && $1 != "cmdstat_info" {sum += $3}
      $1 == "cmdstat_evalsha" || $1 == "cmdstat_eval" {scripts += $3}
      END {print sum + 0, scripts + 0}'
}

echo "Machine: $(nproc) cores, $(uname -sr); Redis $(redis-server --version | awk '{print $3}')"
echo
echo "One client (wrk -t1 -c$CONNECTIONS, $DURATION) on one IP against axum_redis (20/s per IP)"
echo
echo "| deny cache | requests | denied (429) | Redis commands (in scripts too) | per denied request | round trips (EVALSHA) | per denied request | requests/s | p99 |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for cache in on off; do
  redis-cli -p "$RPORT" flushall >/dev/null
  port=$(free_port)
  ADDR="127.0.0.1:$port" REDIS_URL="$REDIS_URL" RATELIMITS_DENY_CACHE=$cache \
    "${CARGO_TARGET_DIR:-target}"/release/examples/axum_redis >"$WORK/app-$cache.log" 2>&1 &
  PIDS+=($!)
  wait_port "$port"
  read -r before scripts_before < <(calls)
  out=$(wrk -t1 -c"$CONNECTIONS" -d"$DURATION" --latency "http://127.0.0.1:$port/")
  read -r after scripts_after < <(calls)
  kill "${PIDS[-1]}"
  requests=$(awk '/requests in/ {print $1}' <<<"$out")
  denied=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
  rps=$(awk '/^Requests\/sec:/ {printf "%.0f", $2}' <<<"$out")
  p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
  commands=$((after - before))
  scripts=$((scripts_after - scripts_before))
  per() { awk -v c="$1" -v d="${denied:-0}" 'BEGIN {if (d > 0) printf "%.4f", c / d; else print "-"}'; }
  printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$cache" "$requests" "${denied:-0}" \
    "$commands" "$(per "$commands")" "$scripts" "$(per "$scripts")" "$rps" "$p99"
done
