import json, sys, collections
import numpy as np
dump = json.load(open(sys.argv[1])); probe = sys.argv[2]
req = {k: (a, r) for k, a, r in dump}
st = collections.defaultdict(dict); R = collections.defaultdict(list)
for line in open(probe):
    p = line.split()
    if p[1] == "R": R[int(p[0][1:])].append((int(p[3]), float(p[2]))); continue
    if p[1] in "SD": continue
    st[p[0]].setdefault(p[1], (float(p[2]), p[3:]))
rows = []
for k, (app, res) in req.items():
    s = st.get(k)
    if not s or not all(x in s for x in "FJBXYE"): continue
    f, (part, off) = s["F"][0], map(int, s["F"][1])
    c = [t for fo, t in R[part] if fo <= off and t <= f + 0.01]
    r = max(c) if c else f
    t = {x: s[x][0] for x in "FJBXYE"}
    rows.append((r-app, f-r, t["J"]-f, t["B"]-t["J"], t["X"]-t["B"], t["Y"]-t["X"], t["E"]-t["Y"], res-t["E"], res-app))
a = np.array(rows)
names = ["append->response","response->getmany","getmany->job","job->cut","cut->dispatch","dispatch->done","done->encoded","encoded->appended","total"]
print(len(rows), "records")
for i, n in enumerate(names):
    print(f"  {n:20s} p50 {np.percentile(a[:,i],50):7.1f} p90 {np.percentile(a[:,i],90):7.1f} p99 {np.percentile(a[:,i],99):7.1f}")
