#!/usr/bin/env bash
# The memory a request moves: libc's memmove calls and bytes per request, without the layer and
# through it (execute, replay), and the most frequent sizes, from the layer bench's in-process
# profile loop.
#
#   cargo bench --bench layer --no-run
#   scripts/moves.sh target/release/deps/layer-<hash> [N]
#
# Needs perf with uprobes (root): it adds the probe probe_libc:memmove_len on
# __memmove_avx_unaligned_erms (the variant glibc picks on this machine; memcpy is an alias of
# it) and removes it at exit.
set -euo pipefail
binary=${1:?usage: scripts/moves.sh target/release/deps/layer-<hash> [N]}
n=${2:-2000}
libc=$(ldd "$binary" | awk '/libc\.so/ {print $3}')
tmp=$(mktemp -d)
cleanup() {
  perf probe -q -d probe_libc:memmove_len 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
perf probe -q -x "$libc" 'memmove_len=__memmove_avx_unaligned_erms len=%dx:u64'
for variant in none execute replay; do
  perf record -q -e probe_libc:memmove_len -o "$tmp/$variant.data" -- \
    "$binary" --profile "$variant" "$n" >/dev/null 2>&1
  # One request ("stored") before the loop: counted as part of the n.
  perf script -i "$tmp/$variant.data" 2>/dev/null | grep -o 'len=[0-9]*' |
    python3 -c '
import collections, sys
variant, n = sys.argv[1], int(sys.argv[2])
sizes = collections.Counter(int(line.strip()[4:]) for line in sys.stdin)
calls, total = sum(sizes.values()), sum(k * v for k, v in sizes.items())
top = ", ".join(f"{size} B x {count / n:.1f}" for size, count in sizes.most_common(5))
print(f"{variant}: {calls / n:.1f} calls, {total / n:.0f} bytes per request; most frequent: {top}")
' "$variant" "$n"
done
