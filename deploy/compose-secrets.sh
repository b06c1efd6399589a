#!/bin/sh
# The compose cluster's secrets (deploy/docker-compose.yml's one-shot `secrets` service): made by
# `driver secrets` into the `secrets` volume on first start and kept, then each role's share
# copied into a volume of that role's own, which only its services mount (read-only, at
# /run/secrets): no service holds another role's keys.
#
#   /secrets/all      everything, the CA's key included (this service only)
#   /secrets/nats     the NATS servers' certificate and key, the CA, the authorization
#   /secrets/pg       PostgreSQL's certificate and key, the roles' passwords
#   /secrets/migrate  the CA, ste_owner's password (pgpass)
#   /secrets/node     the CA, the node identity, the shard roles' passwords (pgpass)
#   /secrets/driver   the CA, the load, sink and monitor identities, the shard roles' passwords
set -eu
all=/secrets/all
driver secrets --dir "$all" --shards 4
share() {
  role=$1
  shift
  mkdir -p "/secrets/$role"
  chmod 700 "/secrets/$role"
  for file in "$@"; do
    cp -p "$all/$file" "/secrets/$role/$file"
  done
}
share nats ca.pem nats-server.pem nats-server.key nats-authorization.conf
share pg ca.pem pg-server.pem pg-server.key pg-owner.password \
  pg-shard-0.password pg-shard-1.password pg-shard-2.password pg-shard-3.password
share migrate ca.pem
share node ca.pem nats-node.nk
share driver ca.pem nats-load-0.nk nats-load-1.nk nats-sink.nk nats-monitor.nk
umask 077
grep ':ste_owner:' "$all/pgpass" >/secrets/migrate/pgpass
grep -v ':ste_owner:' "$all/pgpass" >/secrets/node/pgpass
grep -v ':ste_owner:' "$all/pgpass" >/secrets/driver/pgpass
echo "secrets ready"
