#!/bin/bash
# Alternates bench binaries run by run on the 8 B shared-memory ping-pong and prints, per binary,
# the median one-way latency of its runs in the host's fast phase (cache-line reference below
# 0.05 us, latency below 0.2 us) and in the slow phase.
#
# usage: alternate.sh ROUNDS BIN[@GAP]...   (GAP: the FC_GAP environment variable of the poll-gap
#                                            experiment; ignored by other builds)
# Raw lines (round, binary, latency, cache-line reference, transport alone) go to alternate.last.
rounds=$1; shift
out=${OUT:-alternate.last}
for r in $(seq "$rounds"); do
  for v in "$@"; do
    b=${v%@*}; g=0; [[ $v == *@* ]] && g=${v#*@}
    o=$(FC_GAP=$g "$b" pingpong --transport shm --progress busy --runs 1 --recv-into --send-from --max 8 \
        --no-peer --idle-gap 0 --target-ms 300 2>&1)
    l=$(echo "$o" | grep "summary: 8 B" | awk '{print $6}')
    c=$(echo "$o" | grep "^reference: cache" | awk '{print $8}')
    t=$(echo "$o" | grep "cma=off" | awk '{print $11}')
    echo "$r $v $l $c $t"
  done
done | tee "$out"
python3 - "$out" <<'PY'
import collections, statistics, sys
fast, slow = collections.defaultdict(list), collections.defaultdict(list)
for line in open(sys.argv[1]):
    r, x, l, c, t = line.split()
    (fast if float(c) < 0.05 and float(l) < 0.2 else slow)[x].append(float(l))
for x in sorted(set(fast) | set(slow)):
    f, s = fast.get(x, []), slow.get(x, [])
    med = lambda v: f"{statistics.median(v):.4f}" if v else "-"
    print(f"{x}: fast n={len(f)} median {med(f)} | slow n={len(s)} median {med(s)}")
PY
