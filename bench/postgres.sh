#!/usr/bin/env bash
# End-to-end throughput on N local PostgreSQL instances, next to what PostgreSQL itself ingests
# here: after each driver run, the stored messages are copied out and loaded back with psql
# \copy into an empty table of the same shape (partitioned by month like `messages`, with every
# key and index of `messages`, copied from it), one stream per instance in parallel, and that
# load is timed.
#
#   bench/postgres.sh TRADES INSTANCES...      e.g.  bench/postgres.sh 250000 1 2 4
#   STE_BENCH_REPLAY=1 bench/postgres.sh ...    replay a set written once by `driver generate`,
#                                               sent with the signatures made beside it, so
#                                               that the engine's CPU holds no generating or
#                                               signing
#   STE_BENCH_ARGS="--batch-max 4096" bench/postgres.sh ...
#                                               more options for the timed run of the driver
#   STE_BENCH_COPIES=N bench/postgres.sh ...   time the COPY N times (default 3), and compare
#                                               the engine with the fastest
#   STE_BENCH_RUNS=N bench/postgres.sh ...      time the engine's run N times (default 1), the
#                                               shards' databases made afresh between, and
#                                               compare the fastest: each side its best
#   STE_BENCH_WARM=N bench/postgres.sh ...      first store N trades, untimed, and time the run
#                                               that follows (`--resume`): the shards then hold
#                                               their month partitions, as the COPY's table does
#                                               before its load is timed and as a database does
#                                               after its first day; without it the timed run
#                                               creates every month's partitions of every shard
#
# Before anything is timed, each instance's shared buffers are written through once (an
# unlogged table somewhat larger than shared_buffers, filled and dropped). A freshly started
# server maps its shared memory but touches a page of it only when a buffer is first used, and
# on this virtual machine that first touch is dear: in `perf record -a` of a run on fresh
# instances, the servers spent about 0.7 µs a message clearing new pages during the engine's
# run and almost none during the COPY after it, which found every buffer already touched.
#
# The load back is a binary COPY (psql \copy ... WITH (FORMAT binary)), the format the engine's
# writers use. Prints one line per instance count: engine msg/s, COPY rows/s (the fastest load),
# their ratio, and where the CPU went: the engine process's and the PostgreSQL servers' CPU
# microseconds per message during the run, the servers' per row during the fastest COPY (every
# backend's CPU, read from /proc: the postmasters' own and reaped children's, and their live
# children's), and every load's rate. Then every row the engine committed (its messages, trades'
# statuses, CLS outbox and exceptions) is loaded the same way, four tables an instance, and the
# next two columns give the fastest such load's time over the engine's (the engine's rate as a
# fraction of a raw COPY of all its rows) and every load's seconds; the last, every engine run's
# msg/s (the fastest is the one compared, with its CPU). The driver's summaries are kept under
# runs/bench-postgres-*.
set -euo pipefail
cd "$(dirname "$0")/.."

trades=${1:?usage: bench/postgres.sh TRADES INSTANCES...}
shift
[ $# -gt 0 ] || { echo "usage: bench/postgres.sh TRADES INSTANCES..." >&2; exit 2; }
copies=${STE_BENCH_COPIES:-3}
[[ "$copies" =~ ^[1-9][0-9]*$ ]] || { echo "STE_BENCH_COPIES must be a whole number of at least 1" >&2; exit 2; }
runs=${STE_BENCH_RUNS:-1}
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "STE_BENCH_RUNS must be a whole number of at least 1" >&2; exit 2; }
cluster_dir=${STE_BENCH_CLUSTER_DIR:-/tmp/ste-bench-cluster}
first_port=${STE_BENCH_PORT:-56432}
cargo build --release --bin driver >/dev/null 2>&1
source_args=(--trades "$trades")
if [ -n "${STE_BENCH_REPLAY:-}" ]; then
  set_file="runs/bench-postgres-set-$trades.xml"
  mkdir -p runs
  [ -e "$set_file.signatures" ] ||
    ./target/release/driver generate --trades "$trades" --out "$set_file" >/dev/null
  source_args=(--input "$set_file")
fi

# CPU seconds the PostgreSQL servers under $cluster_dir have used so far.
pg_cpu_s() {
  python3 - "$cluster_dir" <<'PY'
import glob, os, sys
tick = os.sysconf("SC_CLK_TCK")
def fields(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()
total = 0
for pidfile in glob.glob(os.path.join(sys.argv[1], "shard-*", "postmaster.pid")):
    postmaster = int(open(pidfile).readline())
    f = fields(postmaster)
    total += sum(int(x) for x in f[11:15])  # utime stime cutime cstime
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                g = fields(pid)
            except OSError:
                continue
            if int(g[1]) == postmaster:
                total += int(g[11]) + int(g[12])
print(total / tick)
PY
}

# Every instance's dirty buffers written out and the kernel's dirty pages with them, before the
# engine's run and before each timed load, so that none of them pays for the writing of what
# came before it (without this, each round of loads ran slower than the one before).
# CHECKPOINT is the superuser's, reachable through each instance's socket as the postgres user.
settle() {
  local port_file as_postgres=()
  [ "$(id -u)" = 0 ] && as_postgres=(runuser -u postgres --)
  for port_file in "$cluster_dir"/shard-*.port; do
    "${as_postgres[@]}" psql -h "$cluster_dir" -p "$(cat "$port_file")" -U postgres -d postgres -qc CHECKPOINT
  done
  sync
}

# The tables the engine writes a run's rows to, and the columns it writes.
tables=(messages trades cls_outbox exceptions)
declare -A columns=(
  [messages]="trade_date, trade_key, sender, msg_id, msg_type, function, related_id, injected_ns, raw, received_on"
  [trades]="trade_date, trade_key, status"
  [cls_outbox]="id, trade_date, cls_id, trade_key, body"
  [exceptions]="received_on, trade_key, sender, msg_id, code, detail, raw"
)
copies_of_tables=$(printf 'copy_%s, ' "${tables[@]}")
copies_of_tables=${copies_of_tables%, }
# Where table $2's rows of the instance at URL $1 are written out.
copy_file() { local port=${1##*:}; echo "$cluster_dir/$2-${port%%/*}.copy"; }
# The \copy that loads table $1's rows of the instance at URL $2 into its copy.
load() { echo "\\copy copy_$1 (${columns[$1]}) FROM '$(copy_file "$2" "$1")' WITH (FORMAT binary)"; }

# Empties the copies, settles, and loads table by table the rows of every table named, each
# instance's in one session, all instances at once; prints the seconds it took and the CPU
# seconds the servers spent meanwhile.
timed_load() {
  local url table started cpu_before pids=() loads
  for url in "${url_list[@]}"; do psql "$url" -qc "TRUNCATE $copies_of_tables"; done
  settle
  cpu_before=$(pg_cpu_s)
  started=$(date +%s.%N)
  for url in "${url_list[@]}"; do
    loads=()
    for table in "$@"; do loads+=(-c "$(load "$table" "$url")"); done
    psql "$url" -q -v ON_ERROR_STOP=1 "${loads[@]}" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  python3 -c "print(f'{$(date +%s.%N) - $started:.3f} {$(pg_cpu_s) - $cpu_before}')"
}

printf '%-9s %-9s %-12s %-14s %-14s %-12s %-34s %-24s %-16s %-22s %s\n' trades instances messages "engine_msg/s" "copy_rows/s" "engine/copy" "cpu_us/msg(engine,pg_run,pg_copy)" "every_copy_rows/s" "all_rows_copy/engine" "every_all_rows_copy_s" "every_engine_msg/s"
for instances in "$@"; do
  deploy/local-cluster.sh down --dir "$cluster_dir" >/dev/null 2>&1 || true
  rm -rf "$cluster_dir"
  urls=$(deploy/local-cluster.sh up "$instances" --dir "$cluster_dir" --port "$first_port" | paste -sd,)
  # The roles' passwords; the raw COPY's tables are made as the role that owns the schema.
  export PGPASSFILE="$cluster_dir/secrets/pgpass"
  owner_urls=$(deploy/local-cluster.sh owner-urls --dir "$cluster_dir" | paste -sd,)
  IFS=, read -r -a url_list <<< "$owner_urls"
  mkdir -p runs
  touching=()
  for url in "${url_list[@]}"; do
    psql "$url" -q -v ON_ERROR_STOP=1 \
      -c "CREATE UNLOGGED TABLE bench_touch (n bigint)" \
      -c "INSERT INTO bench_touch SELECT generate_series(1, pg_size_bytes(current_setting('shared_buffers')) / 32)" \
      -c "DROP TABLE bench_touch" &
    touching+=($!)
  done
  for pid in "${touching[@]}"; do wait "$pid"; done
  read -r -a extra_args <<< "${STE_BENCH_ARGS:-}"
  # The engine's run is timed STE_BENCH_RUNS times (1 by default), every shard's database
  # made afresh between, and the fastest is the one compared, as the fastest COPY is.
  engine_rate=0
  engine_rates=()
  for run in $(seq "$runs"); do
    [ "$run" -eq 1 ] || deploy/local-cluster.sh reset --dir "$cluster_dir" >/dev/null
    run_dir="runs/bench-postgres-${trades}-${instances}-$(date +%Y%m%dT%H%M%S)"
    resume=()
    if [ -n "${STE_BENCH_WARM:-}" ]; then
      STE_DATABASE_URLS=$urls ./target/release/driver --trades "$STE_BENCH_WARM" \
        --store postgres --run-dir "$run_dir-warm" --json --quiet --probe-s 0 > "$run_dir-warm.json"
      resume=(--resume)
    fi
    settle
    pg_before=$(pg_cpu_s)
    STE_DATABASE_URLS=$urls ./target/release/driver "${source_args[@]}" --store postgres \
      "${resume[@]}" "${extra_args[@]}" --run-dir "$run_dir" --json --quiet --probe-s 0 > "$run_dir.json"
    this_pg=$(python3 -c "print($(pg_cpu_s) - $pg_before)")
    this_rate=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['throughput_msg_s']))" "$run_dir.json")
    engine_rates+=("$this_rate")
    if [ "$this_rate" -gt "$engine_rate" ]; then
      engine_rate=$this_rate
      pg_run=$this_pg
      engine_cpu=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['process_cpu_s'])" "$run_dir.json")
      messages=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['messages_in'])" "$run_dir.json")
    fi
  done

  # The same rows, out to files and back in through \copy, all instances at once: the
  # messages alone, and every row the engine committed (its trades' statuses, its CLS in the
  # outbox and its exceptions too). Each table gets an empty copy of its shape, partitioned
  # like it (its key read from the catalog) and with all its keys and indexes.
  for table in "${tables[@]}"; do
    for url in "${url_list[@]}"; do
      psql "$url" -qc "\\copy (SELECT ${columns[$table]} FROM $table) TO '$(copy_file "$url" "$table")' WITH (FORMAT binary)"
      psql "$url" -q -v ON_ERROR_STOP=1 <<SQL
SELECT format('CREATE TABLE copy_$table (LIKE $table INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES) PARTITION BY %s',
              pg_get_partkeydef('$table'::regclass)) \\gexec
SELECT format('CREATE TABLE %I PARTITION OF copy_$table FOR VALUES FROM (%L) TO (%L)',
              'copy_' || c.relname, m.lo, m.lo + interval '1 month')
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid,
     LATERAL (SELECT to_date(right(c.relname, 6), 'YYYYMM') AS lo) m
WHERE i.inhparent = '$table'::regclass \\gexec
SQL
    done
  done
  # Rows the COPY loads: the timed run's, and with STE_BENCH_WARM the warm-up's as well.
  copied=0
  for url in "${url_list[@]}"; do
    copied=$((copied + $(psql "$url" -Atc "SELECT count(*) FROM messages")))
  done
  # The load is timed STE_BENCH_COPIES times (3 by default), the table emptied between, and
  # the fastest is the one compared: on this shared host one load of the same rows has taken
  # 6 and 10 µs of the servers' CPU a row minutes apart, and the engine is held to the faster.
  copy_rate=0
  copy_rates=()
  all_copy_s=
  all_copy_seconds=()
  for _ in $(seq "$copies"); do
    result=$(timed_load messages)
    read -r this_s this_cpu <<< "$result"
    this_rate=$(python3 -c "print(round($copied / $this_s))")
    copy_rates+=("$this_rate")
    if [ "$this_rate" -gt "$copy_rate" ]; then
      copy_rate=$this_rate
      pg_copy=$this_cpu
    fi
    # Then every row the engine committed, not only its messages, in the same round. The
    # fastest such load's seconds are compared with the engine's own (messages ÷ its rate).
    result=$(timed_load "${tables[@]}")
    read -r this_s _ <<< "$result"
    all_copy_seconds+=("$this_s")
    if [ -z "$all_copy_s" ] || python3 -c "import sys; sys.exit(0 if $this_s < $all_copy_s else 1)"; then
      all_copy_s=$this_s
    fi
  done
  all_ratio=$(python3 -c "print(f'{$all_copy_s * $engine_rate / $messages:.2f}')")
  ratio=$(python3 -c "print(f'{$engine_rate / $copy_rate:.2f}')")
  cpu=$(python3 -c "m=$messages; print(f'{1e6*$engine_cpu/m:.1f},{1e6*$pg_run/m:.1f},{1e6*$pg_copy/$copied:.1f}')")
  printf '%-9s %-9s %-12s %-14s %-14s %-12s %-34s %-24s %-16s %-22s %s\n' "$trades" "$instances" "$messages" "$engine_rate" "$copy_rate" "$ratio" "$cpu" "$(IFS=/; echo "${copy_rates[*]}")" "$all_ratio" "$(IFS=/; echo "${all_copy_seconds[*]}")" "$(IFS=/; echo "${engine_rates[*]}")"
done
deploy/local-cluster.sh down --dir "$cluster_dir" >/dev/null 2>&1 || true
