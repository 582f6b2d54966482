import json, sys, collections, numpy as np
def an(dump, probe):
    d = {k:(r,p) for k,r,p in json.load(open(dump))}
    st = collections.defaultdict(dict)
    for line in open(probe):
        k,s,t = line.split(); st[k].setdefault(s, float(t))
    rows=[]
    for k,(r,p) in d.items():
        s=st.get(k)
        if not s or not all(x in s for x in "FJEA"): continue
        rows.append((s["F"]-r, s["J"]-s["F"], s["E"]-s["J"], s["A"]-s["E"], p-r, p-s["E"], s["A"]-p))
    a=np.array(rows)
    names=["append->fetched","fetched->job","job->encoded","encoded->acked","total","encoded->res-append","res-append->acked"]
    print(dump, probe, len(a))
    for i,n in enumerate(names):
        print(f"  {n:22s} p50 {np.percentile(a[:,i],50):7.1f} p90 {np.percentile(a[:,i],90):7.1f} p99 {np.percentile(a[:,i],99):7.1f}")
an(sys.argv[1], sys.argv[2])
