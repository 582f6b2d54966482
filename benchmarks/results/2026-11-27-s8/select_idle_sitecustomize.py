"""Throwaway probe (BENCHMARKS.md, "Fetched once"): the time the worker's event
loop spends waiting in ``select`` (idle), written to /tmp/selstats-<pid>.txt at
exit. Put on the worker's PYTHONPATH as ``sitecustomize.py``: ``python -m
bench.drain ... --variant sel:PYTHONPATH=/tmp/selsite``."""

import atexit
import collections
import os
import selectors
import threading
import time

_orig = selectors.EpollSelector.select
st = {"n": 0, "idle": 0.0, "t0": None, "zero": 0}
hist = collections.Counter()


def select(self, timeout=None):
    if threading.current_thread() is not threading.main_thread():
        return _orig(self, timeout)
    t = time.perf_counter()
    if st["t0"] is None:
        st["t0"] = t
    r = _orig(self, timeout)
    dt = time.perf_counter() - t
    st["n"] += 1
    st["idle"] += dt
    if timeout == 0:
        st["zero"] += 1
    b = 0 if dt < 1e-4 else 1 if dt < 1e-3 else 2 if dt < 5e-3 else 3 if dt < 2e-2 else 4
    hist[b] += dt
    st["last"] = time.perf_counter()
    return r


selectors.EpollSelector.select = select


def dump():
    if st["n"] < 1000:
        return
    with open(f"/tmp/selstats-{os.getpid()}.txt", "w") as f:
        f.write(repr(st) + "\n")
        for b in sorted(hist):
            f.write(f"{['<0.1ms', '<1ms', '<5ms', '<20ms', '>=20ms'][b]}: {hist[b]:.3f} s\n")


atexit.register(dump)
