"""The cycle collector's census in a worker process (BENCHMARKS.md, "The cycle
collector", 2026-11-26, night). Put this directory on the worker's PYTHONPATH
and set GCX through a drain variant, e.g.:

    .venv/bin/python -m bench.drain --broker kafka --records 100000 --repeat 1 --peers \\
        --variant gclog:PYTHONPATH=benchmarks/results/2026-11-26-night/gc-census,GCX=log \\
        --variant gcthr:PYTHONPATH=benchmarks/results/2026-11-26-night/gc-census,GCX=thr

GCX=log counts with CPython's defaults; GCX=thr sets the thresholds 10,000 /
50 / 100 and freezes what exists 6 s after start (the worker itself now does
both once started, worker/app/collector.py); thrq does the same without
counting. Counts and times per generation go to /tmp/gcx/tot-MODE-PID.txt.
SWITCH=seconds sets sys.setswitchinterval (tried for the lanes' p99: no
effect beyond the noise).
"""

import gc
import os
import sys
import threading
import time

_mode = os.environ.get("GCX", "")
if _mode.startswith("thr"):
    gc.set_threshold(10_000, 50, 100)
    threading.Timer(6.0, gc.freeze).start()
if _mode in ("thr", "log"):
    os.makedirs("/tmp/gcx", exist_ok=True)
    _started = [0.0]
    _totals = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    _path = f"/tmp/gcx/tot-{_mode}-{os.getpid()}.txt"

    def _count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        gen = info["generation"]
        _totals[gen][0] += 1
        _totals[gen][1] += time.perf_counter() - _started[0]
        if _totals[gen][0] % 50 == 1 or gen == 2:
            with open(_path, "w") as fh:
                fh.write(" ".join(f"g{g}:{n}:{s * 1e3:.0f}ms" for g, (n, s) in _totals.items()))

    gc.callbacks.append(_count)
if os.environ.get("SWITCH"):
    sys.setswitchinterval(float(os.environ["SWITCH"]))
