"""Join the stage probe's stamps (lanes-stage-probe.patch) with bench.lanes' dump.

    python lanes_stage_probe.py /tmp/dump.lanes-0 /tmp/probe.<worker pid>

The dump holds (key, request LogAppendTime, result LogAppendTime) per urgent
request; the probe file "key stage wall-ms" lines, stage F (handed over by
getmany), J (Job made), E (encoded), A (acknowledged). Prints each stage's
p50 / p90 / p99 in ms. Benchmark code, not shipped.
"""

import collections
import json
import sys

import numpy as np

NAMES = ("append->fetched", "fetched->job", "job->encoded", "encoded->acked", "total",
         "encoded->res-append", "res-append->acked")  # fmt: skip


def stages(dump: str, probe: str) -> np.ndarray:
    with open(dump) as fh:
        appended = {k: (req, res) for k, req, res in json.load(fh)}
    stamps: dict[str, dict[str, float]] = collections.defaultdict(dict)
    with open(probe) as fh:
        for line in fh:
            key, stage, t = line.split()
            stamps[key].setdefault(stage, float(t))
    rows = []
    for key, (r, p) in appended.items():
        s = stamps.get(key)
        if s and all(x in s for x in "FJEA"):
            f, j, e, a = s["F"], s["J"], s["E"], s["A"]
            rows.append((f - r, j - f, e - j, a - e, p - r, p - e, a - p))
    return np.array(rows)


def main() -> None:
    a = stages(sys.argv[1], sys.argv[2])
    print(sys.argv[1], sys.argv[2], len(a))
    for i, name in enumerate(NAMES):
        p50, p90, p99 = np.percentile(a[:, i], [50, 90, 99])
        print(f"  {name:22s} p50 {p50:7.1f} p90 {p90:7.1f} p99 {p99:7.1f}")


if __name__ == "__main__":
    main()
