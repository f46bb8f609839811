#!/usr/bin/env bash
# Over a socket: the quickstart app (`axum_memory`: two rules, `RateLimit` fields on every
# response) and ours like for like (`axum_peer` with PEER=ours_1_rule: one rule per IP, no fields
# on allowed responses) against the same app with tower_governor (`axum_peer`, one rule per IP,
# no fields) and with no limit, loaded by wrk over loopback. Each variant is run ROUNDS
# times for DURATION, alternating (A B C, then C B A, ...), and the median of the rounds is
# reported with its ratio. Installs wrk when missing (Debian, as root).
#
#   bash benches/load.sh                      # DURATION=5s ROUNDS=3 CONNECTIONS=16 THREADS=1
#   DURATION=10s ROUNDS=5 bash benches/load.sh
#
# Scenarios:
# - allowed: limits so large that every request is allowed (ours: 1,000,000/s per IP and per
#   /48, the quickstart's two rules; ours_1_rule and tower_governor: 1,000,000/s per IP);
# - denied: the quickstart's limits (20/s per IP; tower_governor 20/s burst 20), so wrk's
#   single client is refused almost always: the cost of answering a flood with 429s.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
DURATION=${DURATION:-5s}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-16}
THREADS=${THREADS:-1}

need wrk
# One invocation, so that the quickstart and the peers' app are built with the same axum: features
# unify across the packages a build names (tower_governor asks for axum's defaults, json, http2
# and tracing among them; the quickstart alone builds axum with http1 and tokio only).
cargo build -q --release -p tower-ratelimits -p tower-ratelimits-benches \
  --example axum_memory --example axum_peer
BIN=${CARGO_TARGET_DIR:-target}/release/examples

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

start() { # port, command...
  local port=$1; shift
  env ADDR="127.0.0.1:$port" "$@" >"$WORK/$port.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 250); do listening "$port" && return 0; sleep 0.02; done
  echo "server on port $port did not start:"; cat "$WORK/$port.log"; exit 1
}

cat >"$WORK/allowed.yaml" <<'YAML'
RequestsPerIPAddress: {kind: ip, burst: 1000000, count: 1000000, period: 1s}
RequestsPerIPv6Range: {kind: ipv6_range, burst: 1000000, count: 1000000, period: 1s}
YAML
echo "[]" >"$WORK/no-overrides.yaml"

# wrk's output -> "requests_per_second p99_microseconds non_2xx"
measure() {
  local out rps p99 value unit non2xx
  out=$(wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" --latency "http://127.0.0.1:$1/")
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  read -r value unit < <(awk '$1 == "99%" {v = $2; u = v; gsub(/[0-9.]/, "", u); gsub(/[a-z]/, "", v); print v, u}' <<<"$out")
  case $unit in us) p99=$value ;; ms) p99=$(awk -v v="$value" 'BEGIN {print v * 1000}') ;;
    s) p99=$(awk -v v="$value" 'BEGIN {print v * 1000000}') ;; *) p99=0 ;; esac
  non2xx=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
  echo "$rps $p99 ${non2xx:-0}"
}
median() { sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

run_scenario() { # name, then "label port" pairs
  local scenario=$1; shift
  local -a labels=() ports=()
  while [ $# -gt 0 ]; do labels+=("$1"); ports+=("$2"); shift 2; done
  local n=${#labels[@]}
  for i in $(seq 0 $((n - 1))); do : >"$WORK/$scenario.${labels[$i]}"; done
  wrk -t1 -c"$CONNECTIONS" -d1s "http://127.0.0.1:${ports[0]}/" >/dev/null # warm-up
  for r in $(seq 1 "$ROUNDS"); do
    for j in $(seq 0 $((n - 1))); do
      local i=$j
      [ $((r % 2)) = 0 ] && i=$((n - 1 - j))
      measure "${ports[$i]}" >>"$WORK/$scenario.${labels[$i]}"
    done
  done
  local ref_rps bare_rps=""
  ref_rps=$(cut -d' ' -f1 "$WORK/$scenario.${labels[0]}" | median)
  [ -f "$WORK/$scenario.bare" ] && bare_rps=$(cut -d' ' -f1 "$WORK/$scenario.bare" | median)
  echo
  echo "Scenario: $scenario ($ROUNDS rounds of $DURATION, wrk -t$THREADS -c$CONNECTIONS, medians)"
  echo
  echo "| variant | requests/s | p99 | non-2xx per round | requests/s vs ${labels[0]} | vs bare |"
  echo "|---|---:|---:|---:|---:|---:|"
  for i in $(seq 0 $((n - 1))); do
    local f="$WORK/$scenario.${labels[$i]}" rps p99 non
    rps=$(cut -d' ' -f1 "$f" | median)
    p99=$(cut -d' ' -f2 "$f" | median)
    non=$(cut -d' ' -f3 "$f" | median)
    printf '| %s | %.0f | %s µs | %s | %s | %s |\n' "${labels[$i]}" "$rps" "$p99" "$non" \
      "$(awk -v a="$rps" -v b="$ref_rps" 'BEGIN {printf "%.2f", a / b}')" \
      "$([ -n "$bare_rps" ] && awk -v a="$rps" -v b="$bare_rps" 'BEGIN {printf "%.2f", a / b}')"
  done
}

echo "Machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(uname -sr)"

P_OURS=$(free_port); start "$P_OURS" RATELIMITS_DEFAULTS="$WORK/allowed.yaml" \
  RATELIMITS_OVERRIDES="$WORK/no-overrides.yaml" "$BIN/axum_memory"
P_GOV=$(free_port); start "$P_GOV" PEER=tower_governor PER_SECOND=1000000 BURST=1000000 "$BIN/axum_peer"
P_ONE=$(free_port); start "$P_ONE" PEER=ours_1_rule PER_SECOND=1000000 BURST=1000000 "$BIN/axum_peer"
P_BARE=$(free_port); start "$P_BARE" PEER=none "$BIN/axum_peer"
run_scenario allowed tower_governor "$P_GOV" ours_1_rule "$P_ONE" ours "$P_OURS" bare "$P_BARE"

P_OURS_Q=$(free_port); start "$P_OURS_Q" "$BIN/axum_memory"
P_GOV_Q=$(free_port); start "$P_GOV_Q" PEER=tower_governor PER_SECOND=20 BURST=20 "$BIN/axum_peer"
P_ONE_Q=$(free_port); start "$P_ONE_Q" PEER=ours_1_rule PER_SECOND=20 BURST=20 "$BIN/axum_peer"
run_scenario denied tower_governor "$P_GOV_Q" ours_1_rule "$P_ONE_Q" ours "$P_OURS_Q"
