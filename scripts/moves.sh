#!/usr/bin/env bash
# The memory a request moves: libc's memmove calls and bytes per request, without the layer and
# through it (execute, replay), and the most frequent sizes, from the layer bench's in-process
# profile loop. Each variant runs N and 2N requests; a request's figures are the difference
# divided by N, so the process's setup is not counted.
#
#   cargo bench --bench layer --no-run
#   scripts/moves.sh target/release/deps/layer-<hash> [N]
#
# Needs perf with uprobes (root): it adds a probe probe_libc:memmove_len_<variant> on each of
# libc's __memmove_<variant> (glibc picks one by CPU at load: avx_unaligned_erms on the AMD EPYC
# of docs/BENCHMARKS.md, avx512_unaligned_erms on the Intel Xeon; memcpy is an alias of it), and
# removes them at exit.
set -euo pipefail
binary=${1:?usage: scripts/moves.sh target/release/deps/layer-<hash> [N]}
n=${2:-2000}
libc=$(ldd "$binary" | awk '/libc\.so/ {print $3}')
[ -n "$libc" ] || { echo "moves.sh: no libc in ldd $binary" >&2; exit 1; }
tmp=$(mktemp -d)
cleanup() {
  perf probe -q -d 'probe_libc:memmove_len*' 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
# A probe left by a run that was killed would make the add fail.
perf probe -q -d 'probe_libc:memmove_len*' 2>/dev/null || true
# Every variant but the checking ones (`__memmove_chk_*`, which go on into one of these).
variants=$(perf probe -x "$libc" --funcs --no-demangle --filter='*' 2>/dev/null \
  | sed -n 's/^__memmove_\([a-z0-9_]*\)$/\1/p' | grep -v '^chk' | sort -u || true)
[ -n "$variants" ] || { echo "moves.sh: no __memmove_* variant in $libc (perf probe --funcs)" >&2; exit 1; }
for v in $variants; do
  perf probe -x "$libc" "memmove_len_$v=__memmove_$v len=%dx:u64" 2>"$tmp/probe.err" \
    || { cat "$tmp/probe.err" >&2; echo "moves.sh: cannot add the memmove probe (root, uprobes?)" >&2; exit 1; }
done
sizes() { # variant requests -> one size per line
  perf record -q -e 'probe_libc:memmove_len*' -o "$tmp/$1.$2.data" -- \
    "$binary" --profile "$1" "$2" >/dev/null 2>"$tmp/$1.$2.err" \
    || { cat "$tmp/$1.$2.err" >&2; echo "moves.sh: $binary --profile $1 $2 failed" >&2; exit 1; }
  perf script -i "$tmp/$1.$2.data" 2>/dev/null | sed -n 's/.*len=\([0-9]*\).*/\1/p' > "$tmp/$1.$2.sizes"
}
for variant in none execute replay; do
  sizes "$variant" "$n"
  sizes "$variant" "$((2 * n))"
  python3 - "$variant" "$n" "$tmp/$variant.$n.sizes" "$tmp/$variant.$((2 * n)).sizes" <<'EOF'
import collections, sys
variant, n, one, two = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
count = lambda path: collections.Counter(int(line) for line in open(path))
a, b = count(one), count(two)
if not a or not b:
    sys.exit(f"moves.sh: no memmove counted for {variant}: does glibc pick another variant here?")
sizes = {size: (b[size] - a[size]) / n for size in set(a) | set(b)}
calls = sum(sizes.values())
total = sum(size * per for size, per in sizes.items())
top = ", ".join(f"{size} B x {per:.1f}" for size, per in sorted(sizes.items(), key=lambda s: -s[1])[:5])
print(f"{variant}: {calls:.1f} calls, {total:.0f} bytes per request; most frequent: {top}")
EOF
done
