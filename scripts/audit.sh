#!/usr/bin/env bash
# Checks Cargo.lock against a local copy of the RustSec advisory database, offline:
#   scripts/audit.sh ADVISORY_DB_DIR
# (a checkout of the rustsec/advisory-db repository; cargo-audit is installed from crates.io if
# missing). RUSTSEC-2023-0071 (rsa, no fixed release) is in Cargo.lock only because Cargo locks
# the optional dependencies of sqlx, whose MySQL driver no build of this project enables; the
# script proves that with `cargo tree` before it lets the audit ignore it.
set -euo pipefail
cd "$(dirname "$0")/.."
db="${1:?usage: scripts/audit.sh ADVISORY_DB_DIR}"
command -v cargo-audit >/dev/null 2>&1 || cargo install --locked cargo-audit
if [ -n "$(cargo tree -i rsa --target all -e all 2>/dev/null)" ]; then
  echo "rsa is reachable: RUSTSEC-2023-0071 applies" >&2
  exit 1
fi
cargo audit --db "$db" --no-fetch --stale --deny warnings --ignore RUSTSEC-2023-0071
