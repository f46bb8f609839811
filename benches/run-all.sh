#!/usr/bin/env bash
# Every benchmark behind BENCHMARKS.md, in one command (about 20 minutes on 2 cores):
#
#   bash benches/run-all.sh
#
# Writes each part's output to target/bench-results/ and prints the tables. Needs the
# Debian packages valgrind, wrk and redis-server (installed when missing, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/common.sh
OUT=target/bench-results
mkdir -p "$OUT"
need valgrind wrk redis-server
{
  echo "Machine: $(nproc) cores ($(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)), $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(uname -sr)"
  rustc --version
  redis-server --version
  date -u
} | tee "$OUT/machine.txt"

step() { printf '\n==> %s\n' "$*" >&2; }
step "instructions and allocations per operation (callgrind)"
bash benches/instructions.sh | tee "$OUT/instructions.md"
step "how cost grows with keys: the in-memory decision at 100k, 1M and 10M keys (callgrind)"
for keys in 100000 1000000 10000000; do
  bash benches/instructions.sh 20000 "$keys" governor_check_key ours_spend_one ours_limiter
done | tee "$OUT/instructions-keys.md"
step "bytes per live key in memory, ours and governor, at 1M and 10M keys"
bash benches/memory.sh | tee "$OUT/memory.md"
step "over a socket, counted: the whole server under callgrind, allowed and refused"
bash benches/socket_instructions.sh | tee "$OUT/socket_instructions.md"
step "criterion: GCRA, memory backend vs governor, middleware, burst tiers, Redis"
cargo bench -p tower-ratelimits-benches --bench gcra --bench memory_backend --bench middleware \
  --bench tiers --bench redis_backend -- --noplot 2>&1 | tee "$OUT/criterion.log" |
  grep -vE '^(Benchmarking|Found|  [0-9]+ \(|Warning|.*Gnuplot)' || true
python3 benches/report.py | tee "$OUT/criterion.md"
step "over a socket: tower_governor vs ours like for like vs the quickstart vs no limit (wrk)"
bash benches/load.sh | tee "$OUT/load.md"
step "under attack: axum_redis with the deny cache on and off"
bash benches/attack.sh | tee "$OUT/attack.md"
bash benches/redis_instructions.sh | tee "$OUT/redis_instructions.md"
step "a hot key on Redis, with and without prefetched tokens (alternating timed rounds)"
cargo bench -p tower-ratelimits-benches --bench redis_rounds | tee "$OUT/redis_rounds.md"
step "stored overrides at scale: a change's cost, memory per override (200,000 on 20 instances)"
cargo bench -p tower-ratelimits-benches --bench overrides_scale -- --overrides 200000 --instances 20 | tee "$OUT/overrides_scale.md"
step "long requests' lease renewals on Redis: store calls per second"
cargo bench -p tower-ratelimits-benches --bench redis_renewals | tee "$OUT/redis_renewals.md"
echo
echo "Results in $OUT/"
