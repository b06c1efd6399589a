#!/usr/bin/env bash
# Starts or stops N local PostgreSQL instances, one per STE shard, natively (initdb + pg_ctl as
# the postgres user), on consecutive ports.
#
#   deploy/local-cluster.sh up N [--dir DIR] [--port FIRST_PORT]
#   deploy/local-cluster.sh down [--dir DIR]
#   deploy/local-cluster.sh urls [--dir DIR]
#   deploy/local-cluster.sh crash K [--dir DIR]   (stop shard K's instance abruptly; `up N` restarts it)
#   deploy/local-cluster.sh reset [--dir DIR]     (drop and recreate every shard's database)
#
# `up` prints the shard URLs, one per line, in shard order; pass them to the driver as
# `--db URL` each, or comma-separated in STE_DATABASE_URLS. Data lives under DIR
# (default /tmp/ste-cluster); each instance listens on 127.0.0.1 only, with trust auth.
#
# STE_PG_OPTIONS adds server settings to every instance started, e.g.
# STE_PG_OPTIONS="-c shared_buffers=1GB".
set -euo pipefail

usage() {
  sed -n '2,14p' "$0" >&2
  exit 2
}

command=${1:-}
[ -n "$command" ] || usage
shift
count=""
shard_to_crash=""
if [ "$command" = "crash" ]; then
  shard_to_crash=${1:-}
  [[ "$shard_to_crash" =~ ^[0-9]+$ ]] || usage
  shift
fi
if [ "$command" = "up" ]; then
  count=${1:-}
  [[ "$count" =~ ^[1-9][0-9]*$ ]] || usage
  shift
fi
dir=${STE_CLUSTER_DIR:-/tmp/ste-cluster}
first_port=${STE_CLUSTER_PORT:-55432}
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --port) first_port=$2; shift 2 ;;
    *) usage ;;
  esac
done

bindir=$(pg_config --bindir 2>/dev/null || true)
if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
  bindir=$(dirname "$(ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1)")
fi
[ -x "$bindir/initdb" ] || { echo "no PostgreSQL server binaries (initdb) found" >&2; exit 1; }

# PostgreSQL refuses to run as root: run its tools as the postgres user when we are root.
as_postgres() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

url_of() {
  echo "postgres://postgres@127.0.0.1:$1/ste"
}

case "$command" in
  up)
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    for ((shard = 0; shard < count; shard++)); do
      port=$((first_port + shard))
      data="$dir/shard-$shard"
      if [ ! -f "$data/PG_VERSION" ]; then
        as_postgres "$bindir/initdb" -D "$data" -U postgres --auth=trust -E UTF8 >/dev/null
      fi
      echo "$port" > "$dir/shard-$shard.port"
      if ! as_postgres "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        as_postgres "$bindir/pg_ctl" -D "$data" -l "$dir/shard-$shard.log" -w -t 60 start \
          -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c shared_buffers=256MB -c max_wal_size=4GB -c checkpoint_timeout=15min ${STE_PG_OPTIONS:-}" >/dev/null
      fi
      as_postgres "$bindir/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -qtA \
        -c "SELECT 1 FROM pg_database WHERE datname = 'ste'" | grep -q 1 \
        || as_postgres "$bindir/createdb" -h 127.0.0.1 -p "$port" -U postgres ste
      url_of "$port"
    done
    ;;
  urls)
    for port_file in $(ls "$dir"/shard-*.port 2>/dev/null | sort -V); do
      url_of "$(cat "$port_file")"
    done
    ;;
  reset)
    for port_file in $(ls "$dir"/shard-*.port 2>/dev/null | sort -V); do
      port=$(cat "$port_file")
      as_postgres "$bindir/dropdb" -h 127.0.0.1 -p "$port" -U postgres --if-exists --force ste
      as_postgres "$bindir/createdb" -h 127.0.0.1 -p "$port" -U postgres ste
    done
    ;;
  crash)
    as_postgres "$bindir/pg_ctl" -D "$dir/shard-$shard_to_crash" -m immediate -w stop >/dev/null
    ;;
  down)
    for data in $(ls -d "$dir"/shard-* 2>/dev/null | grep -v '\.' | sort -V); do
      if as_postgres "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        as_postgres "$bindir/pg_ctl" -D "$data" -m fast -w stop >/dev/null
      fi
    done
    ;;
  *)
    usage
    ;;
esac
