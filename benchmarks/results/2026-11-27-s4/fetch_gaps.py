import json, sys, bisect, collections
import numpy as np
dump = json.load(open(sys.argv[1])); probe = sys.argv[2]
req = {k: (a, r) for k, a, r in dump}
F = {}; J = {}; E={}; A={}; R = collections.defaultdict(list); S=[]; D=[]
for line in open(probe):
    p = line.split()
    if p[1] == "F": F[p[0]] = (float(p[2]), int(p[3]), int(p[4]))
    elif p[1] == "J": J[p[0]] = float(p[2])
    elif p[1] == "E": E[p[0]] = float(p[2])
    elif p[1] == "R": R[int(p[0][1:])].append((int(p[3]), float(p[2])))
    elif p[1] == "S": S.append((float(p[2]), p[0]))
    elif p[1] == "D": D.append((float(p[2]), p[0]))
rows = []
for k, (app, res) in req.items():
    if k not in F: continue
    f, part, off = F[k]
    cands = [t for fo, t in R[part] if fo <= off and t <= f + 0.01]
    if not cands: continue
    r = max(cands)
    rows.append((r - app, f - r, J.get(k, f) - f, E.get(k, f) - J.get(k, f), res - E.get(k, f), res - app))
a = np.array(rows)
names = ["append->response", "response->getmany", "getmany->job", "job->encoded", "encoded->appended", "total"]
for i, n in enumerate(names):
    print(f"  {n:20s} p50 {np.percentile(a[:,i],50):7.1f} p90 {np.percentile(a[:,i],90):7.1f} p99 {np.percentile(a[:,i],99):7.1f}")
# fetch requests: durations, how many with urgent, gaps
S.sort(); D.sort()
print("fetch requests", len(S), "with urgent", sum(1 for _, q in S if q == "Q1"))
# time with no urgent-including fetch in flight
ev = sorted([(t, +1) for t, q in S if q == "Q1"] + [(t, -1) for t, q in D if q == "Q1"])
inflight = 0; last = ev[0][0]; idle = 0.0; gaps=[]
for t, d in ev:
    if inflight == 0: idle += t - last; gaps.append(t-last)
    inflight += d; last = t
print(f"span {ev[-1][0]-ev[0][0]:.0f} ms, no urgent fetch in flight {idle:.0f} ms; gap p50 {np.percentile(gaps,50):.1f} p99 {np.percentile(gaps,99):.1f} max {max(gaps):.1f}")
durs = []
for (s, q), (d, q2) in zip(sorted(S), sorted(D)): durs.append(d - s)
print(f"fetch durations p50 {np.percentile(durs,50):.1f} p99 {np.percentile(durs,99):.1f}")
