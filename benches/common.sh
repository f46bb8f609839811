# What the bench scripts share, sourced by them (`. benches/common.sh` from the repository's
# root): installing the tools they need, finding a free port, and a redis-server counted by
# callgrind.

# need TOOL...: installs each missing tool (the Debian package of the same name, as root).
need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null ||
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$tool" >/dev/null ||
      { echo "$tool is needed: apt-get install -y $tool (as root)"; exit 1; }
  done
}

# Whether something listens on loopback port $1.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A loopback port nothing listens on.
free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 20000))
    listening "$p" || { echo "$p"; return; }
  done
}

# redis_under_callgrind OUT: a redis-server (no persistence) under callgrind on a free port,
# its dumps written to OUT (`%p` is its pid). Sets PORT and SERVER (the pid) and returns when
# the server answers; exits after a minute without an answer.
redis_under_callgrind() {
  PORT=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$1" \
    redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
  SERVER=$!
  local _
  for _ in $(seq 1 600); do
    redis-cli -p "$PORT" ping >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "redis-server under callgrind did not answer on port $PORT within a minute"
  exit 1
}

# The instructions a callgrind dump counted.
callgrind_total() { awk '/^(summary|totals):/ {print $2; exit}' "$1"; }
