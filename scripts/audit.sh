#!/usr/bin/env bash
# Checks Cargo.lock against a local copy of the RustSec advisory database, offline:
#   scripts/audit.sh ADVISORY_DB_DIR
# (a checkout of the rustsec/advisory-db repository; cargo-audit is installed from crates.io if
# missing). No advisory is ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
db="${1:?usage: scripts/audit.sh ADVISORY_DB_DIR}"
command -v cargo-audit >/dev/null 2>&1 || cargo install --locked cargo-audit
cargo audit --db "$db" --no-fetch --stale --deny warnings
