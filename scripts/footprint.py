#!/usr/bin/env python3
"""The code a request runs, in 64-byte lines, and its instructions, through a layer against
no layer.

A request that comes after the CPU was idle finds little of its code in the caches: what it
costs then grows with the code it runs, not with the instructions it executes (see
docs/BENCHMARKS.md, "The performance goals, and where they stand"). This counts that code for any binary with a
`--profile <none|execute|replay> N` loop: the layer bench (ours) and the `idempotent` peer
(`benches/peers/idempotent`), so both are counted the same way.

The whole process is counted, so the work a request leaves to other tasks counts too (the
peer's store is an actor task, and a spawned task is polled outside the request's own future).
Each variant runs N, 2N and 3N requests under callgrind. A request's code is every 64-byte line
holding an instruction whose count grew by at least N from each run to the next, by about as
much both times (within 10%): code every request runs. Setup, timers, and work done now and
then (a table that doubles between two of the runs) are not counted; neither is code only
some requests run.

    cargo bench --bench layer --no-run
    scripts/footprint.py target/release/deps/layer-<hash> [N]
    scripts/footprint.py target/peers/release/idempotent-peer [N]

With `REDIS_URL` set, both binaries run on that Redis (or Valkey) instead of their memory
stores, with keys of their run only.

Needs valgrind. Under valgrind the sha2 crate runs its portable SHA-256 (valgrind hides the
SHA extensions), whose code is larger than the SHA-NI code a real CPU runs: its lines and
instructions are shown apart.
"""

import collections
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse


def parse(path):
    """Instructions executed per code address (keyed by object and address: callgrind writes
    addresses relative to their object, so two objects' addresses can coincide), and each
    address's function, from a callgrind file written with --dump-instr=yes."""
    counts = collections.Counter()
    function_of = {}
    names = {}
    objects = {}
    fn = None
    ob = None
    last = 0
    positions = 1
    call_cost_next = False
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            if line.startswith("positions:"):
                positions = len(line.split()) - 1
                continue
            m = re.match(r"^(fn|cfn|ob|cob|fl|fi|fe|cfi|cfl)=(.*)$", line)
            if m:
                kind, value = m.groups()
                named = re.match(r"\((\d+)\)(?: (.*))?", value)
                if kind in ("fn", "cfn"):
                    if named and named.group(2):
                        names[named.group(1)] = named.group(2)
                    if kind == "fn":
                        fn = names.get(named.group(1), value) if named else value
                elif kind in ("ob", "cob"):
                    if named and named.group(2):
                        objects[named.group(1)] = named.group(2)
                    if kind == "ob":
                        ob = objects.get(named.group(1), value) if named else value
                continue
            if line.startswith(("calls=", "jump=", "jcnd=")):
                # The next line is the call's position and its inclusive cost: not this
                # function's own, and not a position later lines are relative to.
                call_cost_next = True
                continue
            fields = line.split()
            token = fields[0]
            if token.startswith("0x"):
                address = int(token, 16)
            elif token.startswith("+"):
                address = last + int(token[1:])
            elif token.startswith("-"):
                address = last - int(token[1:])
            elif token == "*":
                address = last
            else:
                continue
            if call_cost_next:
                call_cost_next = False
                continue
            last = address
            if len(fields) > positions:
                counts[(ob, address)] += int(fields[positions])
                function_of[(ob, address)] = fn
    return counts, function_of


def run(binary, variant, n, out):
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--dump-instr=yes",
            f"--callgrind-out-file={out}",
            binary,
            "--profile",
            variant,
            str(n),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"footprint.py: {binary} --profile {variant} {n} failed:\n{done.stderr[-3000:]}")
    return parse(out)


def per_request(binary, variant, n, tmp):
    """The code lines every request runs, per function; its instructions, and of them the
    sha2 crate's."""
    (one, _), (two, _), (three, function_of) = (
        run(binary, variant, k * n, os.path.join(tmp, f"{variant}.{k * n}")) for k in (1, 2, 3)
    )
    lines = collections.defaultdict(set)
    for key, count in three.items():
        first, second = two.get(key, 0) - one.get(key, 0), count - two.get(key, 0)
        if min(first, second) >= n and abs(first - second) <= 0.1 * max(first, second):
            ob, address = key
            lines[function_of[key]].add((ob, address >> 6))
    if not lines:
        sys.exit(f"footprint.py: no code grew with the requests in {variant}")
    instructions = (sum(three.values()) - sum(one.values())) / (2 * n)
    sha = sum(c - one.get(k, 0) for k, c in three.items() if "sha2" in (function_of.get(k) or ""))
    return lines, instructions, sha / (2 * n)


# Where a function's code belongs, by the first pattern its name contains (ours and the peer's).
AREAS = [
    ("the layer: begin, response future, execution, tee, record, bodies", ("tower_idempotency::", "idempotent::middleware", "idempotent::fingerprint", "idempotent::key")),
    ("the lock and the store: lease, watchdog, fence, memory backend", ("distlock::", "idempotent::")),
    ("crypto", ("sha2::", "hkdf::", "hmac::", "ring::", "aes", "digest::")),
    ("the Redis client", ("redis::", "combine::")),
    ("tokio", ("tokio::", "tokio_util::", "mio::")),
    ("http, axum, tower, tracing", ("http::", "http_body", "axum", "tower::", "hyper", "tracing")),
    ("allocator, memcpy, collections, other", ("",)),
]


def area(name):
    for title, patterns in AREAS:
        if any(p in (name or "") for p in patterns):
            return title
    return AREAS[-1][0]


def redacted(url):
    """`url` without its user and password."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    with tempfile.TemporaryDirectory() as tmp:
        measured = {v: per_request(binary, v, n, tmp) for v in ("none", "execute", "replay")}
    runs = {v: lines for v, (lines, _, _) in measured.items()}
    none = set().union(*runs["none"].values())
    redis = os.environ.get("REDIS_URL")
    store = f"the Redis store at {redacted(redis)}" if redis else "the memory store"
    print(f"On {store}, {n}, {2 * n} and {3 * n} requests:\n")
    print("| variant | code lines a request runs | KiB | lines beyond no layer | of them sha2 (portable) | instructions beyond no layer | of them sha2 (portable) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for variant, per_fn in runs.items():
        lines = set().union(*per_fn.values())
        sha = set().union(*(v for k, v in per_fn.items() if k and "sha2" in k)) - none
        added = measured[variant][1] - measured["none"][1]
        sha_instructions = measured[variant][2] - measured["none"][2]
        print(
            f"| {variant} | {len(lines)} | {len(lines) * 64 // 1024} | {len(lines - none)} | {len(sha)} | {added:,.0f} | {sha_instructions:,.0f} |"
        )
    print("\n| lines an execute request adds, by area | lines |")
    print("| --- | --- |")
    by_area = collections.defaultdict(set)
    for name, lines in runs["execute"].items():
        by_area[area(name)] |= lines - none
    for title, _ in AREAS:
        print(f"| {title} | {len(by_area[title])} |")
    print("\nLines an execute request adds, by function (the 25 largest):\n")
    added = runs["execute"]
    rows = sorted(((len(v - none), k) for k, v in added.items()), reverse=True)
    for count, name in rows[:25]:
        name = re.sub(r" *\[.*", "", name or "?")[:140]
        print(f"{count:5d}  {name}")


if __name__ == "__main__":
    main()
