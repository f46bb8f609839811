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

# redis_under_callgrind OUT [cluster]: a redis-server (no persistence) under callgrind on a
# free port, its dumps written to OUT (`%p` is its pid); with `cluster`, a Redis Cluster of that
# one master, holding every slot (each master of a larger cluster runs the same code per
# command). Sets PORT, SERVER (the pid) and URL, and returns when the server answers (the
# cluster: when its state is ok); exits after a minute without an answer.
redis_under_callgrind() {
  PORT=$(free_port)
  local extra=() _
  if [ "${2:-}" = cluster ]; then
    extra=(--cluster-enabled yes --cluster-config-file "$(dirname "$1")/nodes.$PORT.conf")
  fi
  valgrind --tool=callgrind --callgrind-out-file="$1" \
    redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no "${extra[@]}" \
    >/dev/null 2>&1 &
  SERVER=$!
  URL="redis://127.0.0.1:$PORT"
  for _ in $(seq 1 600); do
    redis-cli -p "$PORT" ping >/dev/null 2>&1 && break
    sleep 0.1
  done
  redis-cli -p "$PORT" ping >/dev/null 2>&1 ||
    { echo "redis-server under callgrind did not answer on port $PORT within a minute"; exit 1; }
  [ "${2:-}" = cluster ] || return 0
  URL="redis-cluster://127.0.0.1:$PORT"
  redis-cli -p "$PORT" cluster addslotsrange 0 16383 >/dev/null
  for _ in $(seq 1 600); do
    redis-cli -p "$PORT" cluster info 2>/dev/null | grep -q cluster_state:ok && return 0
    sleep 0.1
  done
  echo "the one-master cluster on port $PORT was not ok within a minute"
  exit 1
}

# The instructions a callgrind dump counted.
callgrind_total() { awk '/^(summary|totals):/ {print $2; exit}' "$1"; }
