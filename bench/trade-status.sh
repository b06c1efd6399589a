#!/usr/bin/env bash
# What a trade's status row costs PostgreSQL, three ways, alternated ROUNDS times (default 3):
#   upsert  INSERT ... SELECT FROM UNNEST(...) ON CONFLICT (trade_key, trade_date) DO UPDATE,
#           250 rows a statement, as the writer writes a status that is not a trade's first;
#   insert  the same without ON CONFLICT;
#   copy    \copy of the same rows, as the writer loads a trade's first status.
# 70,000 new rows (the trades of 490,000 messages) into a table shaped as `trades` (the same key,
# range-partitioned by trade date), each way in one transaction on a fresh table, on the server
# DATABASE_URL names (default: the local one). Prints wall-clock µs a row, psql's own work
# included.
#   bench/trade-status.sh [ROUNDS]
set -euo pipefail
export PGOPTIONS="-c client_min_messages=warning"
rounds=${1:-3}
admin=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
rows=70000
dir=$(mktemp -d)
trap 'rm -rf "$dir"; psql "$admin" -qc "DROP DATABASE IF EXISTS ste_bench_trade_status" >/dev/null 2>&1 || true' EXIT
psql "$admin" -qc "DROP DATABASE IF EXISTS ste_bench_trade_status" -c "CREATE DATABASE ste_bench_trade_status" 2>/dev/null
db="${admin%/*}/ste_bench_trade_status"
python3 - "$dir" "$rows" <<'PY'
import sys
dir, n = sys.argv[1], int(sys.argv[2])
rows = [("2026-08-04", f"BRKRGB2L/T{i:09d}", "MATCHED") for i in range(n)]
with open(f"{dir}/rows.tsv", "w") as f:
    f.writelines("\t".join(r) + "\n" for r in rows)
for mode, tail in (("upsert", " ON CONFLICT (trade_key, trade_date) DO UPDATE SET status = excluded.status"), ("insert", "")):
    with open(f"{dir}/{mode}.sql", "w") as f:
        f.write("PREPARE rows(date[], text[], text[]) AS INSERT INTO t (trade_date, trade_key, status) "
                f"SELECT * FROM UNNEST($1, $2, $3){tail};\nBEGIN;\n")
        for k in range(0, n, 250):
            chunk = rows[k:k + 250]
            arrays = ["'{" + ",".join('"' + r[c] + '"' for r in chunk) + "}'" for c in range(3)]
            f.write(f"EXECUTE rows({','.join(arrays)});\n")
        f.write("COMMIT;\n")
PY
cat > "$dir/setup.sql" <<'SQL'
DROP TABLE IF EXISTS t;
CREATE TABLE t (trade_date DATE NOT NULL, trade_key TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('PENDING', 'MISMATCHED', 'MATCHED', 'CANCELLED', 'AGED')),
  PRIMARY KEY (trade_key, trade_date)) PARTITION BY RANGE (trade_date);
CREATE TABLE t_2026_08 PARTITION OF t FOR VALUES FROM ('2026-08-01') TO ('2026-09-01');
CHECKPOINT;
SQL
printf '%-6s %-8s %s\n' round way "µs/row"
for round in $(seq 1 "$rounds"); do
  for way in upsert insert copy; do
    psql "$db" -q -f "$dir/setup.sql"
    started=$(date +%s.%N)
    if [ "$way" = copy ]; then
      psql "$db" -q -v ON_ERROR_STOP=1 -c "\\copy t FROM '$dir/rows.tsv'"
    else
      psql "$db" -q -v ON_ERROR_STOP=1 -f "$dir/$way.sql"
    fi
    ended=$(date +%s.%N)
    printf '%-6s %-8s %s\n' "$round" "$way" "$(python3 -c "print(f'{($ended - $started) / $rows * 1e6:.2f}')")"
  done
done
