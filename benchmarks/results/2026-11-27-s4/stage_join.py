"""Join the stage probe's stamps (probe-and-prototype.patch) with bench.lanes'
dump of each urgent request's and result's LogAppendTime; print each stage's
p50 / p90 / p99 in ms and, with --fetches, how long no fetch request that
included the urgent partitions was in flight.

    python stage_join.py /tmp/dump.lanes-0 /tmp/probe.<pid> [--fetches]

Stamps: F handed over by getmany (partition, offset), J Job made, B batch cut,
X dispatched, Y engine done, E encoded; R a fetch response for an urgent
partition (fetch offset); S / D a fetch request sent / done (Q1: it included
an urgent partition). Benchmark tooling, not shipped.
"""

from __future__ import annotations

import collections
import itertools
import json
import sys

import numpy as np

STAGES = "FJBXYE"
NAMES = (
    "append->response", "response->getmany", "getmany->job", "job->cut", "cut->dispatch",
    "dispatch->done", "done->encoded", "encoded->appended", "total",
)  # fmt: skip


def main(dump_path: str, probe_path: str, fetches: bool) -> None:
    with open(dump_path) as fh:
        requests = {key: (appended, answered) for key, appended, answered in json.load(fh)}
    stamps: dict[str, dict[str, tuple[float, list[str]]]] = collections.defaultdict(dict)
    responses: dict[int, list[tuple[int, float]]] = collections.defaultdict(list)
    sent: list[tuple[float, str]] = []
    done: list[tuple[float, str]] = []
    with open(probe_path) as fh:
        for line in fh:
            key, stage, at, *rest = line.split()
            if stage == "R":
                responses[int(key[1:])].append((int(rest[0]), float(at)))
            elif stage in "SD":
                (sent if stage == "S" else done).append((float(at), key))
            else:
                stamps[key].setdefault(stage, (float(at), rest))
    rows = []
    for key, (appended, answered) in requests.items():
        s = stamps.get(key)
        if not s or not all(x in s for x in STAGES):
            continue
        t = {x: s[x][0] for x in STAGES}
        part, offset = (int(v) for v in s["F"][1])
        delivering = [at for fo, at in responses[part] if fo <= offset and at <= t["F"] + 0.01]
        r = max(delivering, default=t["F"])
        steps = [t[b] - t[a] for a, b in itertools.pairwise(STAGES)]
        rows.append((r - appended, t["F"] - r, *steps, answered - t["E"], answered - appended))
    a = np.array(rows)
    print(len(rows), "records")
    for i, name in enumerate(NAMES):
        p50, p90, p99 = np.percentile(a[:, i], [50, 90, 99])
        print(f"  {name:20s} p50 {p50:7.1f} p90 {p90:7.1f} p99 {p99:7.1f}")
    if fetches:
        events = sorted([(at, +1) for at, q in sent if q == "Q1"]
                        + [(at, -1) for at, q in done if q == "Q1"])  # fmt: skip
        inflight, last, gaps = 0, events[0][0], []
        for at, step in events:
            if inflight == 0:
                gaps.append(at - last)
            inflight, last = inflight + step, at
        print(f"fetch requests {len(sent)}, with urgent {sum(q == 'Q1' for _, q in sent)}; "
              f"span {events[-1][0] - events[0][0]:.0f} ms, no urgent fetch in flight "
              f"{sum(gaps):.0f} ms; gap p50 {np.percentile(gaps, 50):.1f} "
              f"p99 {np.percentile(gaps, 99):.1f} max {max(gaps):.1f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--fetches" in sys.argv[3:])
