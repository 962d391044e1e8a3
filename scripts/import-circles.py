#!/usr/bin/env python3
"""Import circles among the facade's top-level modules (src/<module>), from every `crate::`
path in its code (use lines and paths in expressions; comments skipped). Prints each module's
imports and any circle (a strongly connected component of more than one module); exits 1 if
there is one."""
import os, re, sys

root = sys.argv[1] if len(sys.argv) > 1 else 'src'
edges = {}
for dirpath, _, files in os.walk(root):
    for f in files:
        if not f.endswith('.rs'):
            continue
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, root).split(os.sep)
        if rel[0] in ('bin',) or rel == ['lib.rs']:
            continue
        module = rel[0][:-3] if rel[0].endswith('.rs') else rel[0]
        code = '\n'.join(l.split('//')[0] for l in open(path))
        targets = set(re.findall(r'\bcrate::(\w+)', code))
        for group in re.findall(r'\bcrate::\{([^}]*)\}', code):
            targets |= set(re.findall(r'(?:^|,)\s*(\w+)', group))
        edges.setdefault(module, set()).update(t for t in targets if t != module)

index, low, stack, on, sccs, n = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in sorted(edges.get(v, ())):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        sccs.append(comp)
for v in sorted(edges):
    if v not in index:
        visit(v)
for v in sorted(edges):
    print(f'{v:10} -> {", ".join(sorted(edges[v])) or "-"}')
circles = [sorted(c) for c in sccs if len(c) > 1]
for c in circles:
    print('circle:', ' <-> '.join(c))
print('no import circle' if not circles else f'{len(circles)} circle(s)')
sys.exit(1 if circles else 0)
