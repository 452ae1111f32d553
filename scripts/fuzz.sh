#!/usr/bin/env bash
# Fuzzes key extraction, fingerprinting and the whole request path (`request`), and stored
# record decoding (`record`), each for SECONDS (default 60), with cargo-fuzz and libFuzzer.
#
#   scripts/fuzz.sh          # 60 s per target
#   scripts/fuzz.sh 600      # longer
#
# cargo-fuzz needs nightly-only compiler flags (sanitizer coverage); the stable toolchain
# accepts them with RUSTC_BOOTSTRAP=1, which this script sets for the fuzz build only.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
SECONDS_PER_TARGET="${1:-60}"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz" >&2
  cargo install --locked cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz
fi
export RUSTC_BOOTSTRAP=1
cargo fuzz build -O
for target in request record; do
  echo "fuzz.sh: $target for ${SECONDS_PER_TARGET}s" >&2
  log="$(mktemp)"
  if ! cargo fuzz run "$target" -O -- -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 >"$log" 2>&1; then
    grep -E "panicked|ERROR|SUMMARY" -A3 "$log" >&2 || tail -20 "$log" >&2
    echo "fuzz.sh: $target failed; the input is in fuzz/artifacts/$target/" >&2
    exit 1
  fi
  grep -E "^Done" "$log" >&2
  rm -f "$log"
done
