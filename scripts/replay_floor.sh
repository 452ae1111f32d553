#!/usr/bin/env bash
# The least Valkey (or Redis) CPU a replay can cost when it is a server-side function call,
# against the one plain HGET a store without fencing sends (docs/BENCHMARKS.md, "Why the Valkey
# goals are missed"). Starts its own server on a free loopback port, stores a 300-byte record,
# then sends, 200,000 times each at 8 connections: HGET of it; a function that runs the same
# HGET; a function that runs the HMGET of four fields that the layer's `begin` runs first. Prints
# the server's whole CPU per call (INFO cpu, user + system, as the HTTP bench counts it: reading,
# parsing and answering included) and the command's own (INFO commandstats), and the ratios to
# HGET.
#
#   scripts/replay_floor.sh [path/to/valkey-server]     # default: valkey-server from the
#                                                       # virtualenv scripts/test.sh installs
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT=replay_floor.sh
# shellcheck source=scripts/floor_server.sh
source scripts/floor_server.sh "$@"
cli hset '{r}:s' d "$(head -c 300 /dev/zero | tr '\0' x)" n 7 >/dev/null
cli function load replace "#!lua name=floor
redis.register_function{function_name='hget1', flags={'no-writes'}, callback=function(keys)
  return redis.call('HGET', keys[1], 'd') end}
redis.register_function{function_name='look', flags={'no-writes'}, callback=function(keys)
  local s = redis.call('HMGET', keys[1], 'd', 'p', 'n', 'q')
  if s[1] then return s[1] end
  return 0 end}" >/dev/null
bench() { redis-benchmark -p "$PORT" -c 8 -n 200000 -q "$@" >/dev/null; }
# Runs one command 200,000 times; prints "<whole CPU per call> <the command's own per call>".
measure() {
  cli config resetstat >/dev/null
  local before after
  before="$(cpu)"
  bench "$@"
  after="$(cpu)"
  echo "$(python3 -c "print(f'{($after - $before) * 1e6 / 200000:.2f}')") $(usec "$1")"
}
read -r HGET HGET_OWN < <(measure hget '{r}:s' d)
read -r F1 F1_OWN < <(measure fcall hget1 1 '{r}:s')
read -r F2 F2_OWN < <(measure fcall look 1 '{r}:s')
ratio() { python3 -c "print(f'{$1 / $2:.2f}')"; }
"$SERVER" --version | cut -d' ' -f1-3
echo "| call | server CPU per call | / HGET | the command's own | / HGET |"
echo "| --- | --- | --- | --- | --- |"
echo "| HGET | $HGET µs | 1 | $HGET_OWN µs | 1 |"
echo "| FCALL of a function running that HGET | $F1 µs | $(ratio "$F1" "$HGET") | $F1_OWN µs | $(ratio "$F1_OWN" "$HGET_OWN") |"
echo "| FCALL of a function running begin's HMGET of 4 fields | $F2 µs | $(ratio "$F2" "$HGET") | $F2_OWN µs | $(ratio "$F2_OWN" "$HGET_OWN") |"
