#!/usr/bin/env bash
# The test command: installs and starts what the tests talk to, then runs `cargo test --workspace`
# (extra arguments go to cargo test). On a fresh Debian machine, as root:
#   - PostgreSQL on 127.0.0.1:5432 (started if it is installed but not running);
#   - NATS: Debian's nats-server for the tests of the JetStream carrier, and the pinned release
#     a cluster runs on (scripts/nats-server.sh) for the cluster's tests;
#   - Debian's chromium, for the dashboard's browser test;
#   - Debian's faketime (libfaketime), whose library jumps the clocks of the nemesis's nodes, and
#     e2fsprogs and util-linux (mkfs.ext4, mount, fallocate), with which it fills a shard's data
#     folder on a loop-mounted volume of its own;
#   - zeep, simplefix and quickfix from PyPI, the third-party SOAP and FIX clients of the bridge's
#     tests (quickfix builds its C++ engine from source the first time, several minutes; pip keeps
#     the wheel in its cache, so later runs on the same machine install it at once).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null \
    || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null; }
}

echo "== PostgreSQL"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
if ! command -v pg_isready >/dev/null 2>&1; then
  apt_install postgresql
fi
if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start
  for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432

echo "== NATS JetStream server binary (each test starts its own; Debian's nats-server)"
export PATH="$PATH:/usr/sbin"
if ! command -v nats-server >/dev/null 2>&1; then
  apt_install nats-server
fi
nats-server --version

echo "== the NATS release a cluster runs on (scripts/nats-server.sh: pinned, checked)"
STE_NATS_SERVER=$(scripts/nats-server.sh)
export STE_NATS_SERVER
"$STE_NATS_SERVER" --version

echo "== libfaketime, which jumps the clocks of the nemesis's nodes (Debian's faketime)"
if ! [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ] && [ -z "${STE_LIBFAKETIME:-}" ]; then
  apt_install faketime
fi

echo "== mkfs.ext4 and fallocate, with which the nemesis fills a shard's data folder"
export PATH="$PATH:/sbin"
command -v mkfs.ext4 >/dev/null 2>&1 || apt_install e2fsprogs
command -v fallocate >/dev/null 2>&1 || apt_install util-linux
losetup -f >/dev/null || { echo "no free loop device: the nemesis's fill-disk faults need one (and root)" >&2; exit 1; }

echo "== browser for the dashboard test (Debian's chromium)"
if [ -z "${STE_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium
fi
"${STE_CHROMIUM:-chromium}" --version

echo "== third-party clients of the bridge tests (zeep, simplefix, quickfix from PyPI)"
python="${STE_PYTHON:-python3}"
"$python" -m pip install --quiet --disable-pip-version-check -r bridge/tests/clients/requirements.txt
"$python" -c "import zeep, simplefix, quickfix; print('zeep', zeep.__version__, '/ quickfix with', quickfix.__file__)"

echo "== cargo test --workspace $*"
cargo test --workspace "$@"
