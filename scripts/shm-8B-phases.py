# Phase-matched 8 B comparison from a `pingpong --max 8 --runs N --json F` output: every
# per-run value of sizes 1-11 B is put in the machine's fast or slow phase by its size (this host's
# phases differ 3x at these sizes), then compared within each phase.
# python3 scripts/shm-8B-phases.py results/shm-8B-session20/alternating-send-from.json
import json, statistics as st, sys
d = json.load(open(sys.argv[1]))
cut = {'ferrocomm': 0.2, 'NPopenmpi': 0.2, 'NPmpich2': 0.25}
got = {k: {'fast': [], 'slow': []} for k in cut}
for r in d['rows']:
    vals = {'ferrocomm': r['ferrocomm_best_trial_runs_us']}
    vals.update({p: r['peers'][p]['runs_us'] for p in r['peers']})
    for k, vs in vals.items():
        for v in vs:
            got[k]['fast' if v < cut[k] else 'slow'].append(v)
for ph in ['fast', 'slow']:
    med = {k: st.median(got[k][ph]) if got[k][ph] else float('nan') for k in cut}
    print(f"{ph} phase: " + ", ".join(f"{k} {med[k]:.3f} us (n={len(got[k][ph])})" for k in cut)
          + f"; ferrocomm / NPopenmpi {med['ferrocomm'] / med['NPopenmpi']:.2f}, / NPmpich2 {med['ferrocomm'] / med['NPmpich2']:.2f}")
