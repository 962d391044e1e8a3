#!/bin/bash
# Alternates bench binaries run by run on the 8 B shared-memory ping-pong, and gives each one's
# median one-way latency over its runs in the host's fast phase (cache-line reference below
# 0.05 us, latency below 0.2 us) and over the rest. Binaries are only comparable within one
# invocation: this host's fast-phase figure drifts by a few ns between batches minutes apart.
#
#   bash scripts/shm-8B-alternate.sh ROUNDS BIN...
#
# Raw lines (round, binary, latency, cache-line reference, transport alone, engine driven by hand,
# all in us) go to $OUT (default alternate.last).
set -euo pipefail
rounds=$1
shift
out=${OUT:-alternate.last}
for r in $(seq "$rounds"); do
    for b in "$@"; do
        o=$("$b" pingpong --transport shm --progress busy --runs 1 --recv-into --send-from --max 8 \
            --no-peer --idle-gap 0 --target-ms 300 2>&1)
        l=$(awk '/summary: 8 B/ {print $6}' <<<"$o")
        c=$(awk '/^reference: cache/ {print $8}' <<<"$o")
        t=$(awk '/cma=off/ {print $11, $25}' <<<"$o")
        echo "$r $b $l $c $t"
    done
done | tee "$out"
python3 - "$out" <<'PY'
import collections, statistics, sys
fast, slow = collections.defaultdict(list), collections.defaultdict(list)
order = []
for line in open(sys.argv[1]):
    r, b, l, c = line.split()[:4]
    order += [b] if b not in order else []
    (fast if float(c) < 0.05 and float(l) < 0.2 else slow)[b].append(float(l))
med = lambda v: f"{statistics.median(v):.4f}" if v else "-"
for b in order:
    print(f"{b}: fast n={len(fast[b])} median {med(fast[b])} | slow n={len(slow[b])} median {med(slow[b])}")
PY
