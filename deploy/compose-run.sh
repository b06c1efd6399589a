#!/usr/bin/env bash
# The compose cluster end to end, as CI runs it: installs and starts a Docker engine if none
# runs (Debian's docker.io, docker-compose and debootstrap), builds the images without a registry
# (deploy/offline-images.sh), brings deploy/docker-compose.yml up with NODES nodes, runs TRADES
# trades through it with one node killed mid-run, checks the outcome (one CLS per trade, every
# count as the generator expected) and every shard's rows against the routing rule, and brings
# the cluster down with its volumes.
#
#   deploy/compose-run.sh [TRADES] [NODES]      # default 100000 trades, 4 nodes
#
# With `sweep`, the same Docker engine and images serve the scale-out experiment on the compose
# cluster instead: `driver sweep --nodes LEVELS --db-counts 1,4 --compose deploy/docker-compose.yml`
# (the driver binary from STE_BIN, default target/release), its series in runs/compose-sweep;
# with NODE_CPUS, every node container capped at that many cores (`--node-cpus`, compose's
# `cpus:`), its series in runs/compose-sweep-capped.
#
#   deploy/compose-run.sh sweep [LEVELS] [TRADES] [NODE_CPUS]   # default 1,2,4,8, 100000, no cap
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"
mode=run
if [ "${1:-}" = sweep ]; then
  mode=sweep
  shift
  levels=${1:-1,2,4,8}
  trades=${2:-100000}
  node_cpus=${3:-}
  nodes=0
else
  trades=${1:-100000}
  nodes=${2:-4}
fi
project=ste-compose-run
compose=(docker-compose -p "$project" -f deploy/docker-compose.yml)
export STE_TRADES=$trades STE_DASHBOARD_PORT=${STE_DASHBOARD_PORT:-18686}
log=${STE_COMPOSE_LOG:-/tmp/ste-compose-run}
mkdir -p "$log"

echo "== Docker engine"
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io docker-compose debootstrap >/dev/null \
    || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io docker-compose debootstrap >/dev/null; }
fi
started_dockerd=
if ! docker info >/dev/null 2>&1; then
  dockerd --iptables=false >"$log/dockerd.log" 2>&1 &
  started_dockerd=$!
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker version --format 'docker {{.Server.Version}}'
docker-compose version --short

cleanup() {
  "${compose[@]}" logs --no-color >"$log/cluster.log" 2>&1 || true
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  if [ -n "$started_dockerd" ]; then kill "$started_dockerd" 2>/dev/null || true; fi
}
trap cleanup EXIT

echo "== images (deploy/offline-images.sh)"
deploy/offline-images.sh

if [ "$mode" = sweep ]; then
  echo "== sweep: $levels nodes on 1 and 4 shards, $trades trades a level${node_cpus:+, nodes capped at $node_cpus cores}"
  "${STE_BIN:-target/release}/driver" sweep --nodes "$levels" --db-counts 1,4 --trades "$trades" \
    ${node_cpus:+--node-cpus "$node_cpus"} --compose deploy/docker-compose.yml \
    --out "runs/compose-sweep${node_cpus:+-capped}" --quiet
  exit 0
fi

echo "== up: secrets, 3 NATS servers, 4 shards, the schema, keys, $nodes nodes, monitor"
"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
"${compose[@]}" up -d --no-build --scale node="$nodes" secrets nats-0 nats-1 nats-2 shard-0 shard-1 shard-2 shard-3 migrate keys node monitor
"${compose[@]}" ps

echo "== secrets: in their volumes only, readable by their owner only"
# Every secret value the cluster holds (the seeds, the passwords, the private keys' bodies).
secret_values=$(docker run --rm --network none --entrypoint sh -v "${project}_secrets:/s:ro" ste:0.1 -c \
  'cat /s/*.nk /s/*.password; grep -hv "^-----" /s/*.key')
containers=$("${compose[@]}" ps -q)
environments=$(for container in $containers; do docker inspect --format '{{json .Config.Env}}' "$container"; done)
images=$(for image in ste:0.1 postgres:15 nats:2.15.1-alpine; do docker image inspect "$image"; docker history --no-trunc "$image"; done)
leaked=0
while read -r value; do
  [ -n "$value" ] || continue
  if grep -qF -- "$value" <<<"$environments$images"; then leaked=$((leaked + 1)); fi
done <<<"$secret_values"
[ "$leaked" -eq 0 ] || { echo "FAIL $leaked secret values in the containers' environment or the images"; exit 1; }
echo "ok   no secret in any container's environment or in the images ($(wc -l <<<"$secret_values") values checked)"
modes=$("${compose[@]}" exec -T node sh -c 'stat -c "%a %n" /run/secrets/*.nk /run/secrets/pgpass' | sed -n 1,20p)
echo "$modes" | sed 's/^/     /'
if grep -qv '^600 ' <<<"$modes"; then echo "FAIL a node's secret readable by others"; exit 1; fi
echo "ok   a node's seed and passwords are mode 0600"
if "${compose[@]}" exec -T node sh -c 'ls /run/secrets' | grep -qE 'nats-(sink|load|monitor|gateway)|pg-owner|\.key$'; then
  echo "FAIL a node holds another role's secrets"; exit 1
fi
echo "ok   a node holds its own role's secrets only"

echo "== driver: $trades trades, one node killed mid-run"
"${compose[@]}" run --rm --no-deps -T driver >"$log/summary.json" 2>"$log/driver.err" &
driver=$!
# Kill a node once a quarter of the run has been acknowledged.
victim=$("${compose[@]}" ps -q node | sed -n 1p)
killed=
for _ in $(seq 1 600); do
  if ! kill -0 "$driver" 2>/dev/null; then break; fi
  acknowledged=$(grep -o '\] [0-9]* messages acknowledged' "$log/driver.err" | tail -n 1 | grep -o '[0-9]*' | tail -n 1 || true)
  if [ -z "$killed" ] && [ "${acknowledged:-0}" -ge $((trades * 7 / 4)) ]; then
    echo "killing node container ${victim:0:12} at $acknowledged messages acknowledged"
    docker kill "$victim" >/dev/null
    killed=yes
  fi
  sleep 1
done
status=0
wait "$driver" || status=$?
tail -n 5 "$log/driver.err"
# A node killed between a commit and its answers leaves those messages to be answered again, as
# duplicates: the driver then reports that the counts differ from the generator's. The checks
# below are the ones that hold whatever a failure did.
if [ "$status" -ne 0 ] && ! grep -q "differs" "$log/driver.err"; then
  echo "the driver failed ($status)"
  exit 1
fi
[ -n "$killed" ] || { echo "the run ended before a node could be killed"; exit 1; }

echo "== checks"
python3 - "$log/summary.json" "$trades" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))
trades = int(sys.argv[2])
expected = summary["expected"]
stored = sum(shard["stored_messages"] for shard in summary["shards"])
answered = summary["accepted"] + summary["duplicates"]
checks = {
    f"one CLS per trade ({summary['cls']} for {trades})": summary["cls"] == expected["cls"] == trades,
    "every message answered once, accepted or (after the kill) duplicate":
        summary["conserved"] and answered == expected["accepted"] + expected["duplicates"],
    "exceptions and trade states as the generator expected":
        summary["exceptions"] == expected["exceptions"]
        and all(summary[s] == expected[s] for s in ("mismatched_trades", "pending_trades", "cancelled_trades")),
    f"every accepted message stored once ({stored} stored)": stored == expected["accepted"],
    "every shard holds only the trades the routing rule sends there": summary.get("misrouted_trades") == 0,
}
for check, held in checks.items():
    print(("ok   " if held else "FAIL ") + check)
print(f"{summary['throughput_msg_s']:.0f} msg/s, CLS p50 {summary['latency_ms']['p50']:.0f} ms, "
      f"p99 {summary['latency_ms']['p99']:.0f} ms; answered again as duplicates after the kill: "
      f"{summary['duplicates'] - expected['duplicates']}; CLS emitted again and dropped by the sink: "
      f"{summary['cls_repeats']}")
sys.exit(0 if all(checks.values()) else 1)
PY

echo "== down (volumes too)"
