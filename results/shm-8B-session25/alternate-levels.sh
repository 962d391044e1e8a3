#!/bin/bash
# rounds bins... ; prints round bin api cl tr hand
rounds=$1; shift
for r in $(seq $rounds); do for b in "$@"; do
 o=$("$b" pingpong --transport shm --progress busy --runs 1 --recv-into --send-from --max 8 --no-peer --idle-gap 0 --target-ms 300 2>&1)
 l=$(awk '/summary: 8 B/ {print $6}' <<<"$o"); c=$(awk '/^reference: cache/ {print $8}' <<<"$o"); t=$(awk '/cma=off/ {print $11, $25}' <<<"$o")
 echo "$r $(basename $b) $l $c $t"
done; done
