#!/usr/bin/env bash
# Runs the whole test suite. Installs redis-server (Debian package) when it is missing and no
# REDIS_URL is given: integration tests start their own redis-server processes on loopback ports.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "test.sh: redis-server not found; installing Debian's redis-server package" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y --no-install-recommends redis-server >/dev/null 2>&1 \
    || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y --no-install-recommends redis-server >/dev/null; }
  command -v redis-server >/dev/null 2>&1 || { echo "test.sh: could not install redis-server" >&2; exit 1; }
fi
echo "test.sh: using $(redis-server --version | cut -d' ' -f1-3)" >&2

cargo test --workspace --all-features --all-targets "$@"
cargo test --workspace --all-features --doc "$@"

