#!/usr/bin/env bash
# What distribution costs on this machine: alternated runs of the same load through the
# in-process engine on 4 PostgreSQL instances, through a cluster of 1, 2 and 3 engine nodes on
# three NATS JetStream servers (deploy/local-cluster.sh; STE_CLUSTER_NATS_SERVERS=1 for one)
# and 4 PostgreSQL instances, and the raw JetStream rate of the same batches (jsbench), ROUNDS
# times in turn, every run on fresh instances. STE_NATS_REPLICAS=3 runs the streams with three
# copies each.
#
#   bench/cluster.sh TRADES ROUNDS [NODES...]     e.g.  bench/cluster.sh 100000 3 1 2 3
#   bench/cluster.sh memory TRADES [NODES]        e.g.  bench/cluster.sh memory 1000000 3
#
# Prints one line per run: msg/s, CLS p50/p99 ms, and the CPU each part of the system used
# over the run in cores (node processes, nats-server, PostgreSQL, the driver): on two shared
# cores, where the time goes. The driver's summaries and samples are kept under
# runs/bench-cluster-*. `memory` runs TRADES through NODES nodes (default 3) and prints each
# node's resident memory after warm-up, at its peak and at the end (the driver's report).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/sbin

dir=${STE_BENCH_CLUSTER_DIR:-/tmp/ste-bench-cluster}
first_port=${STE_BENCH_PORT:-56532}
nats_port=${STE_BENCH_NATS_PORT:-14777}
cargo build --release --bin engine --bin driver --bin jsbench >/dev/null 2>&1
command -v /usr/bin/time >/dev/null || { echo "needs /usr/bin/time (Debian: apt-get install time)" >&2; exit 1; }

# CPU ticks used so far by every process, grouped by program (one line: group ticks ...).
cpu_ticks() {
  python3 - <<'PY'
import os, collections
groups = collections.Counter()
for pid in os.listdir('/proc'):
    if not pid.isdigit():
        continue
    try:
        stat = open(f'/proc/{pid}/stat').read()
    except OSError:
        continue
    comm = stat[stat.index('(') + 1:stat.rindex(')')]
    fields = stat[stat.rindex(')') + 2:].split()
    # utime + stime, and the children's that it reaped (a postmaster's backends).
    ticks = sum(int(value) for value in fields[11:15])
    group = {'engine': 'nodes', 'nats-server': 'nats', 'postgres': 'postgres'}.get(comm)
    if group:
        groups[group] += ticks
print(' '.join(f'{g}={groups[g]}' for g in ('nodes', 'nats', 'postgres')))
PY
}

# Cores used per group between two cpu_ticks readings over $3 seconds; $4 is the driver's own
# CPU seconds (user and system, from /usr/bin/time).
cores_between() {
  python3 - "$1" "$2" "$3" "$4" <<'PY'
import os, sys
hz = os.sysconf('SC_CLK_TCK')
before = dict(kv.split('=') for kv in sys.argv[1].split())
after = dict(kv.split('=') for kv in sys.argv[2].split())
seconds = float(sys.argv[3])
used = {g: max(0, int(after[g]) - int(before[g])) / hz for g in after}
used['driver'] = sum(float(v) for v in sys.argv[4].split())
print(' '.join(f"{g}={cpu / seconds:.2f}" for g, cpu in used.items()))
PY
}

fresh_cluster() {
  deploy/local-cluster.sh down --dir "$dir" >/dev/null 2>&1 || true
  rm -rf "$dir"
  deploy/local-cluster.sh up 4 --dir "$dir" --port "$first_port" --nats-port "$nats_port" "$@" \
    2>/dev/null | paste -sd,
}

# The driver's --nats, --nats-placement and --secrets for the cluster deploy/local-cluster.sh
# started.
nats_args() {
  echo "--nats $(deploy/local-cluster.sh nats --dir "$dir" | sed -n 1p)" \
    "--nats-placement $(deploy/local-cluster.sh nats --dir "$dir" | sed -n 2p)" \
    "--secrets $dir/secrets"
}

# The shards' roles' passwords (deploy/local-cluster.sh makes them in DIR/secrets), for the
# in-process runs and the nodes alike.
export PGPASSFILE="$dir/secrets/pgpass"

db_args() {
  tr ',' '\n' <<<"$1" | sed 's/^/--db /' | paste -sd' '
}

field() {
  python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {'s': s}))" "$1" "$2"
}

# One run: $1 label, $2 run dir, then the driver's arguments.
timed_run() {
  local label=$1 run_dir=$2
  shift 2
  local before after started finished seconds
  before=$(cpu_ticks)
  started=$(date +%s.%N)
  /usr/bin/time -o "$run_dir.cpu" -f "%U %S" \
    ./target/release/driver "$@" --run-dir "$run_dir" --json --quiet >"$run_dir.json" 2>"$run_dir.err"
  finished=$(date +%s.%N)
  after=$(cpu_ticks)
  seconds=$(python3 -c "print($finished - $started)")
  printf '%-14s %10s %8s %8s   %s   %s\n' "$label" \
    "$(field "$run_dir.json" "round(s['throughput_msg_s'])")" \
    "$(field "$run_dir.json" "round(s['latency_ms']['p50'])")" \
    "$(field "$run_dir.json" "round(s['latency_ms']['p99'])")" \
    "$(cores_between "$before" "$after" "$seconds" "$(tail -n 1 "$run_dir.cpu")")" \
    "$(field "$run_dir.json" "'matched' if s['matches_expected'] else 'DIFFERS'")"
}

mkdir -p runs
stamp=$(date +%Y%m%dT%H%M%S)

if [ "${1:-}" = memory ]; then
  trades=${2:?usage: bench/cluster.sh memory TRADES [NODES]}
  nodes=${3:-3}
  urls=$(fresh_cluster --nodes "$nodes")
  sleep 3
  run_dir="runs/bench-cluster-memory-$trades-$nodes-$stamp"
  # Progress on stderr, the summary in the run directory, each node's memory printed at the end.
  # shellcheck disable=SC2046
  ./target/release/driver --trades "$trades" $(nats_args) \
    --keys "$dir/keys.csv" $(db_args "$urls") --run-dir "$run_dir" --json >"$run_dir.json"
  printf 'msg/s %s, CLS p50 %s ms, p99 %s ms, %s\n' \
    "$(field "$run_dir.json" "round(s['throughput_msg_s'])")" \
    "$(field "$run_dir.json" "round(s['latency_ms']['p50'])")" \
    "$(field "$run_dir.json" "round(s['latency_ms']['p99'])")" \
    "$(field "$run_dir.json" "'matched' if s['matches_expected'] else 'DIFFERS'")"
  deploy/local-cluster.sh down --dir "$dir" >/dev/null 2>&1
  exit 0
fi

trades=${1:?usage: bench/cluster.sh TRADES ROUNDS [NODES...]}
rounds=${2:?usage: bench/cluster.sh TRADES ROUNDS [NODES...]}
shift 2
node_counts=("$@")
[ ${#node_counts[@]} -gt 0 ] || node_counts=(1 2 3)

echo "$trades trades a run, $rounds rounds, $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-14s %10s %8s %8s   %s\n' run "msg/s" "p50_ms" "p99_ms" "cores used over the run"
for round in $(seq 1 "$rounds"); do
  urls=$(fresh_cluster)
  run_dir="runs/bench-cluster-$stamp-r$round-inprocess"
  STE_DATABASE_URLS=$urls timed_run "in-process" "$run_dir" --trades "$trades" --store postgres --shards 4
  for nodes in "${node_counts[@]}"; do
    urls=$(fresh_cluster --nodes "$nodes")
    sleep 3
    run_dir="runs/bench-cluster-$stamp-r$round-$nodes"
    # shellcheck disable=SC2046
    timed_run "$nodes node(s)" "$run_dir" --trades "$trades" \
      $(nats_args) --keys "$dir/keys.csv" $(db_args "$urls")
  done
  deploy/local-cluster.sh down --dir "$dir" >/dev/null 2>&1
  echo "jsbench, round $round:"
  ./target/release/jsbench --trades $((trades / 2)) | sed 's/^/  /'
done
