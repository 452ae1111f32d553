#!/usr/bin/env python3
"""The code a request runs through the layer, in 64-byte lines, against no layer.

A request that comes after the CPU was idle finds little of its code in the caches: what it
costs then grows with the code it runs, not with the instructions it executes (see
docs/BENCHMARKS.md, "The layer in process"). This counts that code: it runs the layer bench's profile loop
(`--profile <variant> N`) under callgrind, collecting only inside the profiled requests
(`common::profiled::poll_profiled`), and counts the distinct instruction addresses and 64-byte code lines
executed, per variant, and per function for the lines a layered request adds.

    cargo bench --bench layer --no-run
    scripts/footprint.py target/release/deps/layer-<hash> [N]

Needs valgrind. Under valgrind the sha2 crate runs its portable SHA-256 (valgrind hides the
SHA extensions), whose code is larger than the SHA-NI code a real CPU runs: its lines are
shown apart.
"""

import collections
import os
import re
import subprocess
import sys
import tempfile


def parse(path):
    """Code lines (address >> 6) executed, per function, from a callgrind file written with
    --dump-instr=yes."""
    per_fn = collections.defaultdict(set)
    names = {}
    fn = None
    last = 0
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            m = re.match(r"^(fn|cfn|ob|cob|fl|fi|fe|cfi|cfl)=(.*)$", line)
            if m:
                kind, value = m.groups()
                if kind in ("fn", "cfn"):
                    named = re.match(r"\((\d+)\)(?: (.*))?", value)
                    if named and named.group(2):
                        names[named.group(1)] = named.group(2)
                    if kind == "fn":
                        fn = names.get(named.group(1), value) if named else value
                continue
            if line.startswith("calls="):
                continue
            token = line.split()[0]
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
            last = address
            per_fn[fn].add(address >> 6)
    return per_fn


def run(binary, variant, n, out):
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--dump-instr=yes",
            "--collect-atstart=no",
            "--toggle-collect=*::poll_profiled*",
            f"--callgrind-out-file={out}",
            binary,
            "--profile",
            variant,
            str(n),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return parse(out)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    with tempfile.TemporaryDirectory() as tmp:
        runs = {v: run(binary, v, n, os.path.join(tmp, v)) for v in ("none", "execute", "replay")}
    none = set().union(*runs["none"].values())
    print(f"| variant | code lines run ({n} requests) | KiB | lines beyond no layer | of them sha2 (portable) |")
    print("| --- | --- | --- | --- | --- |")
    for variant, per_fn in runs.items():
        lines = set().union(*per_fn.values())
        sha = set().union(*(v for k, v in per_fn.items() if k and "sha2" in k)) - none
        print(
            f"| {variant} | {len(lines)} | {len(lines) * 64 // 1024} | {len(lines - none)} | {len(sha)} |"
        )
    print("\nLines an execute request adds, by function (the 25 largest):\n")
    added = runs["execute"]
    rows = sorted(((len(v - none), k) for k, v in added.items()), reverse=True)
    for count, name in rows[:25]:
        name = re.sub(r" *\[.*", "", name or "?")[:140]
        print(f"{count:5d}  {name}")


if __name__ == "__main__":
    main()
