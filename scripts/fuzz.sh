#!/usr/bin/env bash
# Runs every coverage-guided fuzz target (libFuzzer through cargo-fuzz) for SECONDS each
# (default 30), from the committed seeds and the corpus earlier runs left in fuzz/corpus:
#   scripts/fuzz.sh [SECONDS] [TARGET...]
# Targets: codec, validate, frame, soap, fix. A crash stops the script with the input kept in
# fuzz/artifacts/TARGET; each target's statistics (executions, coverage) end its log in
# fuzz/logs/TARGET.log and are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(codec validate frame soap fix)
command -v cargo-fuzz >/dev/null 2>&1 || cargo install --locked cargo-fuzz
# cargo fuzz builds with -Z flags (sanitizer coverage, AddressSanitizer); the toolchain here is
# stable, which takes them when told to.
export RUSTC_BOOTSTRAP=1
mkdir -p fuzz/logs
cargo fuzz build --fuzz-dir fuzz
for target in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$target"
  if ! cargo fuzz run --fuzz-dir fuzz "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
      -max_total_time="$seconds" -print_final_stats=1 -max_len=70000 >"fuzz/logs/$target.log" 2>&1; then
    tail -n 40 "fuzz/logs/$target.log"
    echo "fuzz target $target failed" >&2
    exit 1
  fi
  executions=$(grep -E '^stat::number_of_executed_units' "fuzz/logs/$target.log" | awk '{print $2}')
  coverage=$(grep -E '^#[0-9]+.*(DONE|pulse)' "fuzz/logs/$target.log" | tail -n 1 | grep -oE 'cov: [0-9]+' || true)
  echo "fuzz $target: ${executions:-?} executions in ${seconds} s, ${coverage:-cov: ?}, no crash"
done
