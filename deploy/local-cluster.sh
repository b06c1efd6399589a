#!/usr/bin/env bash
# Starts or stops N local PostgreSQL instances, one per STE shard, natively (initdb + pg_ctl as
# the postgres user), on consecutive ports; with --nodes K, also a cluster of NATS JetStream
# servers (three by default, each with its own data folder, port and placement tag) and K
# engine nodes of an STE cluster on them.
#
#   deploy/local-cluster.sh up N [--nodes K] [--nats-servers S] [--dir DIR] [--port FIRST_PORT] [--nats-port PORT]
#   deploy/local-cluster.sh down [--dir DIR]          (nodes, NATS and the instances)
#   deploy/local-cluster.sh urls [--dir DIR]          (each shard's URL as its run-time role)
#   deploy/local-cluster.sh owner-urls [--dir DIR]    (as ste_owner, who migrates and may make databases)
#   deploy/local-cluster.sh nats [--dir DIR]      (the NATS URLs and placement tags, two lines)
#   deploy/local-cluster.sh crash K [--dir DIR]   (stop shard K's instance abruptly; `up N` restarts it)
#   deploy/local-cluster.sh start K [--dir DIR]   (start shard K's instance again, alone, on its port)
#   deploy/local-cluster.sh reset [--dir DIR]     (drop and recreate every shard's database)
#
# `up` prints the shard URLs, one per line, in shard order; pass them to the driver as
# `--db URL` each, or comma-separated in STE_DATABASE_URLS, with `--secrets DIR/secrets` (whose
# pgpass holds the roles' passwords). Data lives under DIR (default /tmp/ste-cluster); each
# instance listens on 127.0.0.1 only, over TLS with the cluster's certificate, and asks every
# client for its role's password (scram-sha-256); its superuser is reachable only through the
# instance's socket as the postgres user. The secrets (`driver secrets`: CA, certificates, NATS
# identities, database passwords) are made in DIR/secrets on first start and kept.
# With --nodes, the NATS servers listen on PORT, PORT+1, … (routes on PORT+10…, monitoring on
# PORT+20…), tagged ste:0, ste:1, …, the shards' streams spread over them by those tags; the
# nodes' logs are DIR/node-I.log, their shared key set DIR/keys.csv, and how to drive them is
# printed on stderr. The engine and driver binaries come from STE_BIN (default target/release;
# build them with cargo build --release); nats-server from STE_NATS_SERVER, else the pinned
# release scripts/nats-server.sh installs.
#
# STE_PG_OPTIONS adds server settings to every instance started, e.g.
# STE_PG_OPTIONS="-c shared_buffers=1GB".
set -euo pipefail

usage() {
  sed -n '2,30p' "$0" >&2
  exit 2
}

command=${1:-}
[ -n "$command" ] || usage
shift
count=""
shard_named=""
if [ "$command" = "crash" ] || [ "$command" = "start" ]; then
  shard_named=${1:-}
  [[ "$shard_named" =~ ^[0-9]+$ ]] || usage
  shift
fi
if [ "$command" = "up" ]; then
  count=${1:-}
  [[ "$count" =~ ^[1-9][0-9]*$ ]] || usage
  shift
fi
dir=${STE_CLUSTER_DIR:-/tmp/ste-cluster}
first_port=${STE_CLUSTER_PORT:-55432}
nats_port=${STE_CLUSTER_NATS_PORT:-14222}
nodes=0
nats_servers=${STE_CLUSTER_NATS_SERVERS:-3}
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --port) first_port=$2; shift 2 ;;
    --nats-port) nats_port=$2; shift 2 ;;
    --nats-servers) nats_servers=$2; [[ "$nats_servers" =~ ^[1-9]$ ]] || usage; shift 2 ;;
    --nodes) nodes=$2; [[ "$nodes" =~ ^[0-9]+$ ]] || usage; shift 2 ;;
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

# Shard $2's URL on port $1: its run-time role, TLS with the server's name checked against the
# cluster's CA; the role's password comes from the secrets' pgpass (--secrets, or PGPASSFILE).
url_of() {
  echo "postgres://ste_shard_$2@127.0.0.1:$1/ste?sslmode=verify-full&sslrootcert=$secrets/ca.pem"
}

# The same database as the role that owns and migrates it.
owner_url_of() {
  echo "postgres://ste_owner@127.0.0.1:$1/ste?sslmode=verify-full&sslrootcert=$secrets/ca.pem"
}

# Shard $1's instance, on port $2: made where missing (password authentication over TLS only;
# its superuser reachable only through the instance's socket, as the postgres user), given the
# cluster's server certificate, started, its roles and database brought up to date
# (deploy/shard-roles.sql) and its schema migrated as ste_owner.
start_instance() {
  local shard=$1 port=$2 data="$dir/shard-$1"
  if [ ! -f "$data/PG_VERSION" ]; then
    as_postgres "$bindir/initdb" -D "$data" -U postgres --auth-local=peer --auth-host=scram-sha-256 -E UTF8 >/dev/null
    {
      echo "# STE shard $shard: the superuser through the socket only; everyone else with a"
      echo "# password (scram-sha-256) over TLS; nothing in the clear, nothing trusted."
      echo "local   all all                peer"
      echo "hostssl all all 127.0.0.1/32   scram-sha-256"
      echo "hostssl all all ::1/128        scram-sha-256"
    } >"$data/pg_hba.conf"
  fi
  local owner=()
  [ "$(id -u)" = 0 ] && owner=(-o postgres)
  install "${owner[@]}" -m 600 "$secrets/pg-server.pem" "$data/server.crt"
  install "${owner[@]}" -m 600 "$secrets/pg-server.key" "$data/server.key"
  echo "$port" > "$dir/shard-$shard.port"
  if ! as_postgres "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    as_postgres "$bindir/pg_ctl" -D "$data" -l "$dir/shard-$shard.log" -w -t 60 start \
      -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c ssl=on -c password_encryption=scram-sha-256 -c shared_buffers=256MB -c max_wal_size=4GB -c checkpoint_timeout=15min ${STE_PG_OPTIONS:-}" >/dev/null
  fi
  {
    echo "\\set db ste"
    echo "\\set shard_role ste_shard_$shard"
    echo "\\set shard_password '$(cat "$secrets/pg-shard-$shard.password")'"
    echo "\\set owner_password '$(cat "$secrets/pg-owner.password")'"
    cat "$(dirname "$0")/shard-roles.sql"
  } | as_postgres "$bindir/psql" -h "$dir" -p "$port" -U postgres -d postgres -qtA >/dev/null
  "$bin/driver" migrate --secrets "$secrets" --db "$(owner_url_of "$port")" 2>/dev/null
}

bin=${STE_BIN:-target/release}
secrets="$(realpath -m "$dir")/secrets"

# Stops the process whose pid is in $1 (SIGTERM: a node finishes what it holds), then forgets it.
stop_pid_file() {
  local file=$1 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

# The NATS servers of the cluster ($nats_servers of them), clustered where more than one, each
# tagged ste:I; writes $dir/nats (line 1: the client URLs, line 2: the tags).
start_nats() {
  local nats_bin=${STE_NATS_SERVER:-}
  [ -n "$nats_bin" ] || nats_bin=$("$(dirname "$0")/../scripts/nats-server.sh")
  local urls=() tags=() routes=() i
  for ((i = 0; i < nats_servers; i++)); do
    urls+=("nats://127.0.0.1:$((nats_port + i))")
    tags+=("ste:$i")
    routes+=("nats-route://127.0.0.1:$((nats_port + 10 + i))")
  done
  for ((i = 0; i < nats_servers; i++)); do
    if [ -f "$dir/nats-$i.pid" ] && kill -0 "$(cat "$dir/nats-$i.pid")" 2>/dev/null; then
      continue
    fi
    mkdir -p "$dir/nats-$i"
    local tls="cert_file: \"$secrets/nats-server.pem\", key_file: \"$secrets/nats-server.key\", ca_file: \"$secrets/ca.pem\", timeout: 5"
    {
      echo "server_name: ste-nats-$i"
      echo "listen: 127.0.0.1:$((nats_port + i))"
      echo "http: 127.0.0.1:$((nats_port + 20 + i))"
      echo "server_tags: [\"ste:$i\"]"
      echo "jetstream { store_dir: \"$dir/nats-$i\" }"
      # Clients and routes on TLS with the cluster's certificates; only the identities of
      # driver secrets let in, each with its role's permissions.
      echo "tls { $tls }"
      echo "include \"secrets/nats-authorization.conf\""
      if [ "$nats_servers" -gt 1 ]; then
        echo "cluster {"
        echo "  name: ste"
        echo "  listen: 127.0.0.1:$((nats_port + 10 + i))"
        echo "  routes: [$(IFS=,; echo "${routes[*]}")]"
        echo "  tls { $tls, verify: true }"
        echo "}"
      fi
    } >"$dir/nats-$i.conf"
    "$nats_bin" -c "$dir/nats-$i.conf" >"$dir/nats-$i.log" 2>&1 &
    echo $! > "$dir/nats-$i.pid"
  done
  # Ready once every server answers its health check, which in a cluster waits for JetStream's
  # meta leader: before that, no stream can be made.
  for ((i = 0; i < nats_servers; i++)); do
    python3 - "$((nats_port + 20 + i))" <<'PY' || { echo "NATS server $i is not healthy (see $dir/nats-$i.log)" >&2; exit 1; }
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit(1)
PY
  done
  { (IFS=,; echo "${urls[*]}"); (IFS=,; echo "${tags[*]}"); } >"$dir/nats"
}

# NATS and K engine nodes on the shards whose URLs are in $dir/urls.
start_nodes() {
  local count=$1 shards=$2
  for binary in engine driver; do
    [ -x "$bin/$binary" ] || { echo "$bin/$binary is missing: cargo build --release (or set STE_BIN)" >&2; exit 1; }
  done
  start_nats
  local nats_urls placement
  nats_urls=$(sed -n 1p "$dir/nats")
  placement=$(sed -n 2p "$dir/nats")
  [ -f "$dir/keys.csv" ] || "$bin/driver" keys --out "$dir/keys.csv" >/dev/null
  local db_args=() url
  while read -r url; do db_args+=(--db "$url"); done < "$dir/urls"
  # Spare room on each node for the shards of one that fails.
  local max_shards=$shards
  if [ "$count" -gt 1 ]; then
    max_shards=$(( (shards + count - 2) / (count - 1) ))
  fi
  for ((node = 1; node <= count; node++)); do
    [ -f "$dir/node-$node.pid" ] && kill -0 "$(cat "$dir/node-$node.pid")" 2>/dev/null && continue
    "$bin/engine" --nats "$nats_urls" --nats-placement "$placement" --node-id "node-$node" \
      --secrets "$secrets" --keys "$dir/keys.csv" "${db_args[@]}" --max-shards "$max_shards" \
      >"$dir/node-$node.log" 2>&1 &
    echo $! > "$dir/node-$node.pid"
  done
  {
    echo "cluster: NATS on $nats_urls, $count nodes (logs $dir/node-*.log), $shards shards"
    echo "drive it with:"
    echo "  $bin/driver --trades 250000 --nats $nats_urls --nats-placement $placement --secrets $secrets --keys $dir/keys.csv $(printf '%q ' "${db_args[@]}")"
    echo "stop it with: $0 down --dir $dir"
  } >&2
}

case "$command" in
  up)
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    [ -x "$bin/driver" ] || { echo "$bin/driver is missing: cargo build --release (or set STE_BIN)" >&2; exit 1; }
    # The cluster's CA, certificates, identities and database passwords: made on first start,
    # kept after.
    "$bin/driver" secrets --dir "$secrets" --shards "$count" 2>/dev/null
    for ((shard = 0; shard < count; shard++)); do
      port=$((first_port + shard))
      start_instance "$shard" "$port"
      url_of "$port" "$shard"
    done | tee "$dir/urls"
    if [ "$nodes" -gt 0 ]; then
      start_nodes "$nodes" "$count"
    fi
    ;;
  nats)
    cat "$dir/nats"
    ;;
  urls)
    for port_file in $(ls "$dir"/shard-*.port 2>/dev/null | sort -V); do
      shard=${port_file##*/shard-}
      url_of "$(cat "$port_file")" "${shard%.port}"
    done
    ;;
  owner-urls)
    for port_file in $(ls "$dir"/shard-*.port 2>/dev/null | sort -V); do
      owner_url_of "$(cat "$port_file")"
    done
    ;;
  reset)
    for port_file in $(ls "$dir"/shard-*.port 2>/dev/null | sort -V); do
      shard=${port_file##*/shard-}
      shard=${shard%.port}
      as_postgres "$bindir/dropdb" -h "$dir" -p "$(cat "$port_file")" -U postgres --if-exists --force ste
      start_instance "$shard" "$(cat "$port_file")"
    done
    ;;
  start)
    [ -f "$dir/shard-$shard_named.port" ] || { echo "no shard $shard_named under $dir (up N makes it)" >&2; exit 1; }
    start_instance "$shard_named" "$(cat "$dir/shard-$shard_named.port")"
    ;;
  crash)
    as_postgres "$bindir/pg_ctl" -D "$dir/shard-$shard_named" -m immediate -w stop >/dev/null
    ;;
  down)
    for pid_file in "$dir"/node-*.pid; do stop_pid_file "$pid_file"; done
    for pid_file in "$dir"/nats-*.pid "$dir/nats.pid"; do stop_pid_file "$pid_file"; done
    # The instances' data folders (shard-N; shard-N.port and shard-N.log are files beside them).
    for data in "$dir"/shard-*; do
      [ -d "$data" ] || continue
      if as_postgres "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        as_postgres "$bindir/pg_ctl" -D "$data" -m fast -w stop >/dev/null
      fi
    done
    ;;
  *)
    usage
    ;;
esac
