#!/usr/bin/env bash
# The least Valkey (or Redis) CPU an execution can cost when its lease is held while the handler
# runs, against what axum-idempotent's Redis store (ruts) sends to run a new key
# (docs/BENCHMARKS.md, "Why the Valkey goals are missed"). Starts its own server on a free
# loopback port and sends, 200,000 times each at 8 connections (as scripts/replay_floor.sh):
#
#   peer:  HGET of a new key's field (nothing found), then ruts' script storing the response
#          (HSET and HEXPIRE of one field), each on a new random key;
#   floor: a function that looks for a record and takes the lease (HMGET, SET NX PX) on a new
#          key, then one that checks the lease is ours, stores the record with its expiry and
#          releases (GET, HSET, PEXPIRE, DEL) on a key whose lease is held (4,000,000 leases
#          set beforehand; a call that lands on one it already released, about 2.5%, stops at
#          the GET, which flatters it). No fence, no announcement, no parts;
#   ours:  the lock's own `begin` and `complete` functions (the library `distlock::function_library`
#          prints), the same way: 10 commands with the fence, the in-flight tag, the parts
#          cleared, the announcement.
#
# Prints the server's whole CPU per execution (INFO cpu, user + system, as the HTTP bench counts
# it) for both, and the ratio, over ROUNDS rounds (default 3).
#
#   scripts/execute_floor.sh [path/to/valkey-server]    # default: valkey-server from the
#                                                       # virtualenv scripts/test.sh installs
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=execute_floor.sh
# shellcheck source=scripts/floor_server.sh
source scripts/floor_server.sh "$@"
ROUNDS="${ROUNDS:-3}"
N=200000
cli -x function load replace < scripts/execute_floor.lua >/dev/null
LIBRARY="$(mktemp)"
cargo run -q -p distlock --example acl -- --library > "$LIBRARY"
OURS="$(head -n 1 "$LIBRARY" | sed 's/.*name=//')"
cli -x function load replace < "$LIBRARY" >/dev/null
rm -f "$LIBRARY"
PEER_SHA="$(cli script load "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HEXPIRE', KEYS[1], ARGV[3], 'FIELDS', 1, ARGV[1])
return 1")"
RECORD="$(head -c 300 /dev/zero | tr '\0' x)"
bench() { redis-benchmark -p "$PORT" -c 8 -n "$N" -r 4000000 -q "$@" >/dev/null; }
# One command sent N times: "<the server's whole CPU per call> <the command's own per call>", µs.
per_call() {
  local before after
  cli config resetstat >/dev/null
  before="$(cpu)"
  bench "$@"
  after="$(cpu)"
  echo "$(python3 -c "print(f'{($after - $before) * 1e6 / $N:.2f}')") $(usec "$1")"
}
sum() { python3 -c "import sys; a, b, c, d = map(float, sys.argv[1:]); print(a + c, b + d)" $1 $2; }
peer() {
  sum "$(per_call hget "{p:__rand_int__}:s" h)" \
    "$(per_call evalsha "$PEER_SHA" 1 "{p:__rand_int__}:s" h "$RECORD" 86400)"
}
floor() {
  cli fcall hold 0 4000000 c >/dev/null
  sum "$(per_call fcall begin_min 2 "{b:__rand_int__}" "{b:__rand_int__}:s" token 10000)" \
    "$(per_call fcall complete_min 2 "{c:__rand_int__}" "{c:__rand_int__}:s" token "$RECORD" 86400000)"
}
TAG="$(head -c 32 /dev/zero | tr '\0' t)"
ours() {
  cli fcall hold 0 4000000 d >/dev/null
  sum "$(per_call fcall "${OURS}_begin" 3 "{o:__rand_int__}" "{o:__rand_int__}:state" "{o:__rand_int__}:parts" token 10000 86400000 "$TAG" 1700000000000000)" \
    "$(per_call fcall "${OURS}_complete" 3 "{d:__rand_int__}" "{d:__rand_int__}:state" "{d:__rand_int__}:parts" token "$RECORD" 86400000 0)"
}
ROWS=()
for round in $(seq "$ROUNDS"); do
  if (( round % 2 )); then
    p="$(peer)"; f="$(floor)"; o="$(ours)"
  else
    o="$(ours)"; f="$(floor)"; p="$(peer)"
  fi
  ROWS+=("$p $f $o")
  cli flushall >/dev/null
done
"$SERVER" --version | cut -d' ' -f1-3
printf '%s\n' "${ROWS[@]}" > "$TMP"
python3 - "$TMP" <<'PY'
import statistics, sys
rows = [list(map(float, line.split())) for line in open(sys.argv[1]) if line.strip()]
def mmm(values, fmt="{:.1f}"):
    v = sorted(values)
    return " / ".join(fmt.format(x) for x in (v[0], statistics.median(v), v[-1]))
col = lambda i: [r[i] for r in rows]
print(f"{len(rows)} rounds of 200,000 executions at 8 connections")
print("| per execution, min / median / max | server CPU | the commands' own |")
print("| --- | --- | --- |")
print(f"| peer: HGET, then its HSET + HEXPIRE script | {mmm(col(0))} µs | {mmm(col(1))} µs |")
print(f"| floor: HMGET + SET NX PX, then GET + HSET + PEXPIRE + DEL, two functions | {mmm(col(2))} µs | {mmm(col(3))} µs |")
print(f"| ours: begin (5 commands), then complete (5), two functions | {mmm(col(4))} µs | {mmm(col(5))} µs |")
print(f"| floor / peer | {mmm([r[2] / r[0] for r in rows], '{:.2f}')} | {mmm([r[3] / r[1] for r in rows], '{:.2f}')} |")
print(f"| ours / peer | {mmm([r[4] / r[0] for r in rows], '{:.2f}')} | {mmm([r[5] / r[1] for r in rows], '{:.2f}')} |")
PY
