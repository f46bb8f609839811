#!/usr/bin/env bash
# Instructions per request over a socket, counted (not timed): the whole server (`axum_peer`:
# the quickstart's hello-world app with ours, tower_governor or no limit) runs under callgrind,
# a client sends requests on one keep-alive connection, and the server's counters are zeroed
# after the warm-up and dumped after exactly OPS requests: accept loop, hyper, axum, the
# limiter and the response, everything but the kernel. Allowed (a quota no run uses up) and
# refused (1 a second, burst 1: after the warm-up every request but about one a second is
# refused; the client checks the statuses). Needs valgrind (installed when missing, as root).
#   bash benches/socket_instructions.sh [OPS] [VARIANT...]
# VARIANTs: none, ours_1_rule, tower_governor, handwritten, handwritten_fields, ours_1_rule_refused,
# ours_1_rule_refused_no_body (429s without a body: ErrorBody::Empty), tower_governor_refused,
# handwritten_refused.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
OPS=${1:-5000}
shift $(( $# > 0 ? 1 : 0 )) || true
VARIANTS=("$@")
[ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(none ours_1_rule tower_governor handwritten handwritten_fields ours_1_rule_refused ours_1_rule_refused_no_body tower_governor_refused handwritten_refused)
need valgrind
# One codegen unit unless told otherwise, as benches/instructions.sh: with 16, a change anywhere
# in the crate moves code between units and a row by up to 2%, more than most levers.
export CARGO_PROFILE_RELEASE_CODEGEN_UNITS=${CARGO_PROFILE_RELEASE_CODEGEN_UNITS:-1}
cargo build -q --release -p tower-ratelimits-benches --example axum_peer
BIN=${CARGO_TARGET_DIR:-target}/release/examples/axum_peer
DIR=$(mktemp -d)
SERVER=""
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"; true; }
trap cleanup EXIT
# drive PORT N EXPECT: N GETs on one keep-alive connection; prints the count of each status.
drive() {
  python3 - "$@" <<'PY'
import http.client, sys, collections
port, n, expect = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
seen = collections.Counter()
for _ in range(n):
    c.request("GET", "/")
    r = c.getresponse()
    r.read()
    seen[r.status] += 1
print(" ".join(f"{k}:{v}" for k, v in sorted(seen.items())))
if expect != "any" and seen[int(expect)] < 0.99 * n:
    sys.exit(f"expected status {expect} for nearly every request, saw {dict(seen)}")
PY
}
echo "Instructions per request over a socket (callgrind, the whole axum_peer server; $OPS requests on one keep-alive connection; $CARGO_PROFILE_RELEASE_CODEGEN_UNITS codegen unit(s))"
echo
echo "| variant | instructions per request | statuses |"
echo "|---|---:|---|"
for v in "${VARIANTS[@]}"; do
  case "$v" in
    *_refused_no_body) PEER=${v%_refused_no_body}_no_body; PER=1; BURST=1; EXPECT=429 ;;
    *_refused) PEER=${v%_refused}; PER=1; BURST=1; EXPECT=429 ;;
    *) PEER=$v; PER=1000000; BURST=1000000; EXPECT=200 ;;
  esac
  PORT=$(free_port)
  ADDR="127.0.0.1:$PORT" PEER="$PEER" PER_SECOND=$PER BURST=$BURST \
    valgrind --tool=callgrind --callgrind-out-file="$DIR/$v.%p" "$BIN" >"$DIR/$v.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 600); do
    grep -q 'listening on' "$DIR/$v.log" 2>/dev/null && break
    if ! kill -0 "$SERVER" 2>/dev/null; then echo "axum_peer ($v) did not start:"; tail -5 "$DIR/$v.log"; exit 1; fi
    sleep 0.1
  done
  grep -q 'listening on' "$DIR/$v.log" || { echo "axum_peer ($v) did not listen within a minute"; exit 1; }
  drive "$PORT" 500 any >/dev/null
  callgrind_control -z "$SERVER" >/dev/null 2>&1
  statuses=$(drive "$PORT" "$OPS" "$EXPECT")
  callgrind_control -d "$SERVER" >/dev/null 2>&1
  kill -INT "$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
  SERVER=""
  # The dump `callgrind_control -d` made (`<file>.<pid>.1`) holds the measured requests
  # alone, every thread's part.
  dump=$(ls "$DIR/$v".*.1 2>/dev/null | head -1)
  [ -n "$dump" ] || { echo "no callgrind dump for $v"; ls "$DIR"; exit 1; }
  total=$(callgrind_total "$dump")
  echo "| $v | $(( total / OPS )) | $statuses |"
  rm -f "$DIR/$v".*
done
