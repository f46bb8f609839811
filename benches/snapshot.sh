#!/usr/bin/env bash
# Starting warm (docs/replay.md): how long `plan snapshot` takes to read N GCRA keys from a
# real redis-server (among as many keys of another program, which the SCAN walks too), and how
# long `plan --snapshot` takes to load them into both policies before a one-line log; the
# time and peak memory of each command (`/usr/bin/time`), 3 runs.
#   bash benches/snapshot.sh [KEYS]      (200,000 unless told; needs redis-server, redis-cli)
set -euo pipefail
cd "$(dirname "$0")/.."
KEYS=${1:-200000}
DIR=$(mktemp -d)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --pidfile "$DIR/redis.pid" --dir "$DIR" >/dev/null
trap 'kill "$(cat "$DIR/redis.pid" 2>/dev/null)" 2>/dev/null || true; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done
cargo build -q --release -p tower-ratelimits-simulator --features redis --example simulate
SIM=target/release/examples/simulate
# Keys as a deployment writes them: a TAT an hour ahead, expiring k = 23 ms after it.
python3 - "$KEYS" "$DIR/cmds.txt" <<'PY'
import sys, time
n, out = int(sys.argv[1]), sys.argv[2]
now = int(time.time() * 1e6)
with open(out, "w") as f:
    for i in range(n):
        ip = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"
        tat = now + 3_600_000_000 + i
        f.write(f"SET rl:{{PerIp:{ip}}} {tat} PXAT {(tat + 999) // 1000 + 23}\r\n")
    for i in range(n):
        f.write(f"SET other:key:{i} x\r\n")
PY
redis-cli -p "$PORT" --pipe < "$DIR/cmds.txt" | tail -1
printf 'PerIp: {kind: ip, burst: 6, count: 1, period: 1s}\nOther: {kind: ip, burst: 6, count: 1, period: 1s}\n' > "$DIR/limits.yaml"
printf -- '- {limit: PerIp, key: client_ip}\n' > "$DIR/rules.yaml"
for run in 1 2 3; do
  /usr/bin/time -f "snapshot of $KEYS keys: %e s, %M KiB" \
    "$SIM" plan snapshot --redis "redis://127.0.0.1:$PORT" --limits "$DIR/limits.yaml" --out "$DIR/state.jsonl" 2>&1 | tail -1
done
python3 - "$DIR/state.jsonl" "$DIR/log.jsonl" <<'PY'
import sys, json, datetime
instant = json.loads(open(sys.argv[1]).readline())["instant_us"] / 1e6 + 1
t = datetime.datetime.fromtimestamp(instant, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
open(sys.argv[2], "w").write(json.dumps({"time": t, "ip": "10.0.0.5"}) + "\n")
PY
for run in 1 2 3; do
  /usr/bin/time -f "plan from $KEYS keys: %e s, %M KiB" \
    "$SIM" plan --current "$DIR/limits.yaml" --candidate "$DIR/limits.yaml" --rules "$DIR/rules.yaml" \
    --log "$DIR/log.jsonl" --snapshot "$DIR/state.jsonl" --json "$DIR/plan.json" 2>&1 | tail -1
done
echo "keys in the store after: $(redis-cli -p "$PORT" dbsize) (before: $((2 * KEYS)): nothing written)"
