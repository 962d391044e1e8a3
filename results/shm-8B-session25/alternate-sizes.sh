#!/bin/bash
# rounds bins... ; per run: round bin then best-trial ns for sizes 1..64 ; cache-line ref
rounds=$1; shift
for r in $(seq $rounds); do for b in "$@"; do
 o=$("$b" pingpong --transport shm --progress busy --runs 1 --recv-into --send-from --max 64 --no-peer --idle-gap 0 --target-ms 150 --json /tmp/s25/alt4.json 2>&1)
 c=$(awk '/^reference: cache/ {print $8}' <<<"$o")
 echo "$r $(basename $b) $c $(python3 -c "
import json; d=json.load(open('/tmp/s25/alt4.json')); print(' '.join(f\"{x['bytes']}:{x['ferrocomm_best_trial_us']*1000:.0f}\" for x in d['rows']))")"
done; done
