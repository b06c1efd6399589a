#!/usr/bin/env bash
# End-to-end throughput on N local PostgreSQL instances, next to what PostgreSQL itself ingests
# here: after each driver run, the stored messages are copied out and loaded back with psql
# \copy into an empty table of the same shape (partitioned by month like `messages`, with the
# same keys and indexes), one stream per instance in parallel, and that load is timed.
#
#   bench/postgres.sh TRADES INSTANCES...      e.g.  bench/postgres.sh 250000 1 2 4
#
# Prints one line per instance count: engine msg/s, \copy rows/s, and their ratio; the driver's
# summaries are kept under runs/bench-postgres-*.
set -euo pipefail
cd "$(dirname "$0")/.."

trades=${1:?usage: bench/postgres.sh TRADES INSTANCES...}
shift
[ $# -gt 0 ] || { echo "usage: bench/postgres.sh TRADES INSTANCES..." >&2; exit 2; }
cluster_dir=${STE_BENCH_CLUSTER_DIR:-/tmp/ste-bench-cluster}
first_port=${STE_BENCH_PORT:-56432}
cargo build --release --bin driver >/dev/null 2>&1

printf '%-9s %-9s %-12s %-14s %-14s %s\n' trades instances messages "engine_msg/s" "copy_rows/s" "engine/copy"
for instances in "$@"; do
  deploy/local-cluster.sh down --dir "$cluster_dir" >/dev/null 2>&1 || true
  rm -rf "$cluster_dir"
  urls=$(deploy/local-cluster.sh up "$instances" --dir "$cluster_dir" --port "$first_port" | paste -sd,)
  # The roles' passwords; the raw COPY's tables are made as the role that owns the schema.
  export PGPASSFILE="$cluster_dir/secrets/pgpass"
  owner_urls=$(deploy/local-cluster.sh owner-urls --dir "$cluster_dir" | paste -sd,)
  mkdir -p runs
  run_dir="runs/bench-postgres-${trades}-${instances}-$(date +%Y%m%dT%H%M%S)"
  STE_DATABASE_URLS=$urls ./target/release/driver --trades "$trades" --store postgres \
    --run-dir "$run_dir" --json --quiet > "$run_dir.json"
  engine_rate=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['throughput_msg_s']))" "$run_dir.json")
  messages=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['messages_in'])" "$run_dir.json")

  # The same rows, out to files and back in through \copy, all instances at once.
  IFS=, read -r -a url_list <<< "$owner_urls"
  copy_file() { local port=${1##*:}; echo "$cluster_dir/messages-${port%%/*}.copy"; }
  for url in "${url_list[@]}"; do
    psql "$url" -qc "\\copy (SELECT trade_date, trade_key, sender, msg_id, msg_type, function, related_id, injected_ns, raw FROM messages) TO '$(copy_file "$url")'"
    psql "$url" -q -v ON_ERROR_STOP=1 <<'SQL'
CREATE TABLE copy_messages (LIKE messages INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY RANGE (trade_date);
ALTER TABLE copy_messages ADD UNIQUE (sender, msg_id, trade_date);
CREATE INDEX ON copy_messages (id);
SELECT format('CREATE TABLE %I PARTITION OF copy_messages FOR VALUES FROM (%L) TO (%L)',
              'copy_' || c.relname, m.lo, m.lo + interval '1 month')
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid,
     LATERAL (SELECT to_date(right(c.relname, 6), 'YYYYMM') AS lo) m
WHERE i.inhparent = 'messages'::regclass \gexec
SQL
  done
  started=$(date +%s.%N)
  pids=()
  for url in "${url_list[@]}"; do
    psql "$url" -qc "\\copy copy_messages (trade_date, trade_key, sender, msg_id, msg_type, function, related_id, injected_ns, raw) FROM '$(copy_file "$url")'" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  finished=$(date +%s.%N)
  copy_rate=$(python3 -c "print(round($messages / ($finished - $started)))")
  ratio=$(python3 -c "print(f'{$engine_rate / $copy_rate:.2f}')")
  printf '%-9s %-9s %-12s %-14s %-14s %s\n' "$trades" "$instances" "$messages" "$engine_rate" "$copy_rate" "$ratio"
done
deploy/local-cluster.sh down --dir "$cluster_dir" >/dev/null 2>&1 || true
