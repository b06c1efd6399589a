#!/usr/bin/env bash
# Builds every image deploy/docker-compose.yml names, for a machine that reaches Debian's
# packages but no container registry, so that the same compose file runs there unchanged:
#
#   ste-base:bookworm    Debian bookworm (debootstrap, minbase) with PostgreSQL 15, nats-server
#                        and wget: the base of the three below
#   postgres:15          PostgreSQL 15 with an entrypoint that honours POSTGRES_USER and
#                        POSTGRES_DB (no trust: passwords only; the compose file's shards use
#                        deploy/shard-start.sh as their entrypoint, in this image and the public)
#   nats:2.15.1-alpine   nats-server 2.15.1, the pinned release scripts/nats-server.sh installs
#                        and checks (arguments as the public image takes them)
#   ste:0.1              the engine, driver and monitor release binaries (cargo's target dir)
#
#   deploy/offline-images.sh           # builds the release binaries first (cargo build --release)
#
# Needs a running Docker engine and debootstrap (Debian: apt-get install docker.io debootstrap).
# The base is built once and kept; the others are rebuilt every time (ste:0.1 from the current
# binaries). Images build with --network none: nothing is fetched but Debian's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"
work=${STE_IMAGES_DIR:-/tmp/ste-images}
base=ste-base:bookworm
mkdir -p "$work"

echo "== release binaries"
cargo build --release --bin engine --bin driver --bin monitor 2>&1 | tail -n 1
release=${CARGO_TARGET_DIR:-target}/release

if ! docker image inspect "$base" >/dev/null 2>&1; then
  echo "== $base (debootstrap, about a minute)"
  rm -rf "$work/rootfs"
  debootstrap --variant=minbase --include=postgresql-15,nats-server,wget,ca-certificates \
    bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
  # The packages' own clusters and caches are not part of the image.
  rm -rf "$work/rootfs/var/lib/postgresql/15" "$work/rootfs/var/cache/apt/archives"/*.deb
  tar -C "$work/rootfs" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$base" >/dev/null
  rm -rf "$work/rootfs"
fi

echo "== postgres:15"
mkdir -p "$work/postgres"
cat >"$work/postgres/entrypoint.sh" <<'SH'
#!/bin/sh
# postgres:15 stand-in: initialises the data directory on first start, then runs the server as
# the postgres user with the command's options (`postgres -c ...`, as the public image).
set -e
PGDATA=${PGDATA:-/var/lib/postgresql/data}
bin=/usr/lib/postgresql/15/bin
[ "${1:-}" = postgres ] && shift
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  # No trust: the superuser through the socket as the postgres user, everyone else with a
  # password (the compose file's shards start with deploy/shard-start.sh instead).
  runuser -u postgres -- "$bin/initdb" -D "$PGDATA" -U "${POSTGRES_USER:-postgres}" \
    --auth-local=peer --auth-host=scram-sha-256 >/dev/null
  echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
  if [ -n "${POSTGRES_DB:-}" ] && [ "$POSTGRES_DB" != postgres ]; then
    echo "CREATE DATABASE \"$POSTGRES_DB\"" | runuser -u postgres -- "$bin/postgres" --single -D "$PGDATA" postgres >/dev/null
  fi
fi
exec runuser -u postgres -- "$bin/postgres" -D "$PGDATA" "$@"
SH
cat >"$work/postgres/Dockerfile" <<EOF
FROM $base
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod 755 /usr/local/bin/docker-entrypoint.sh
ENV PGDATA=/var/lib/postgresql/data
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
EOF
docker build -q --network none -t postgres:15 "$work/postgres" >/dev/null

echo "== nats:2.15.1-alpine"
rm -rf "$work/nats" && mkdir -p "$work/nats"
cp "$(scripts/nats-server.sh)" "$work/nats/nats-server"
cat >"$work/nats/Dockerfile" <<EOF
FROM $base
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["/usr/local/bin/nats-server"]
EOF
docker build -q --network none -t nats:2.15.1-alpine "$work/nats" >/dev/null

echo "== ste:0.1"
rm -rf "$work/ste" && mkdir -p "$work/ste"
for binary in engine driver monitor; do
  strip -o "$work/ste/$binary" "$release/$binary"
done
cat >"$work/ste/Dockerfile" <<EOF
FROM $base
COPY engine driver monitor /usr/local/bin/
WORKDIR /data
ENTRYPOINT ["driver"]
EOF
docker build -q --network none -t ste:0.1 "$work/ste" >/dev/null

docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^(ste-base|postgres|nats|ste):' || true
