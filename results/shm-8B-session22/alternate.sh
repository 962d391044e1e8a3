#!/bin/bash
# usage: multi.sh ROUNDS bin1 bin2 ... : alternate; print lat per bin with cl; summary of fast-phase medians
rounds=$1; shift
bins="$@"
for r in $(seq $rounds); do
  for x in $bins; do
    o=$(/tmp/s21/$x-bench pingpong --transport shm --progress busy --runs 1 --recv-into --send-from --max 8 --no-peer --idle-gap 0 --target-ms 300 2>&1)
    l=$(echo "$o" | grep "summary: 8 B" | awk '{print $6}'); c=$(echo "$o" | grep "^reference: cache" | awk '{print $8}'); t=$(echo "$o" | grep "cma=off" | awk '{print $11}')
    echo "$r $x $l $c $t"
  done
done | tee /tmp/s22/multi.last
python3 - <<'PY'
import collections,statistics
d=collections.defaultdict(list)
for line in open('/tmp/s22/multi.last'):
    r,x,l,c,t=line.split()
    l=float(l);c=float(c)
    if c<0.05 and l<0.2: d[x].append(l)
for x,v in d.items(): print(f"{x}: fast n={len(v)} median {statistics.median(v):.4f} min {min(v):.3f}")
PY
