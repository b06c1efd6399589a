#!/bin/bash
# A shard's PostgreSQL under docker compose (deploy/docker-compose.yml), as the shard containers'
# entrypoint, in the public postgres image and in deploy/offline-images.sh's alike: on first
# start initdb with password authentication (scram-sha-256) over TLS only and the superuser
# reachable only through the socket as the postgres user; on every start the cluster's server
# certificate installed and the shard's roles and database brought up to date
# (deploy/shard-roles.sql, its passwords from the shard's secrets, on psql's standard input),
# then the server in the foreground with the command's options (`postgres -c ...`).
#
#   STE_SHARD   the shard's number (its run-time role is ste_shard_<STE_SHARD>)
#   /run/secrets: pg-server.pem, pg-server.key, pg-owner.password, pg-shard-<k>.password
set -euo pipefail
shard=${STE_SHARD:?the shard number}
secrets=${STE_SECRETS_DIR:-/run/secrets}
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
PGDATA=${PGDATA:-/var/lib/postgresql/data}
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  runuser -u postgres -- "$bin/initdb" -D "$PGDATA" -U postgres --auth-local=peer \
    --auth-host=scram-sha-256 -E UTF8 >/dev/null
  cat >"$PGDATA/pg_hba.conf" <<'HBA'
# STE shard: the superuser through the socket only; everyone else with a password
# (scram-sha-256) over TLS; nothing in the clear, nothing trusted.
local   all all              peer
hostssl all all 0.0.0.0/0    scram-sha-256
hostssl all all ::/0         scram-sha-256
HBA
fi
install -o postgres -g postgres -m 600 "$secrets/pg-server.pem" "$PGDATA/server.crt"
install -o postgres -g postgres -m 600 "$secrets/pg-server.key" "$PGDATA/server.key"
[ "${1:-}" = postgres ] && shift
# The roles and the database, with the server on its socket only.
runuser -u postgres -- "$bin/pg_ctl" -D "$PGDATA" -w -t 60 \
  -o "-c listen_addresses='' -k /run/postgresql" start >/dev/null
{
  echo "\\set db ste"
  echo "\\set shard_role ste_shard_$shard"
  echo "\\set shard_password '$(cat "$secrets/pg-shard-$shard.password")'"
  echo "\\set owner_password '$(cat "$secrets/pg-owner.password")'"
  cat "$(dirname "$0")/shard-roles.sql"
} | runuser -u postgres -- "$bin/psql" -h /run/postgresql -U postgres -d postgres -qtA >/dev/null
runuser -u postgres -- "$bin/pg_ctl" -D "$PGDATA" -w -m fast stop >/dev/null
exec runuser -u postgres -- "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' -c ssl=on \
  -c password_encryption=scram-sha-256 "$@"
