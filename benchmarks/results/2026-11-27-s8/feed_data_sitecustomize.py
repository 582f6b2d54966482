"""Throwaway probe (BENCHMARKS.md, "Fetched once"): counts the bytes and time of
every asyncio ``StreamReader.feed_data`` in the worker and writes them to
/tmp/fdstats-<pid>.txt at exit. Put on the worker's PYTHONPATH as
``sitecustomize.py``: ``python -m bench.drain ... --variant fd:PYTHONPATH=/tmp/fdsite``."""

import asyncio
import atexit
import collections
import os
import time

_orig = asyncio.StreamReader.feed_data
stats = {"calls": 0, "bytes": 0, "ns": 0}
hist = collections.Counter()


def feed_data(self, data):
    n = len(data)
    before = len(self._buffer)
    t = time.perf_counter_ns()
    _orig(self, data)
    dt = time.perf_counter_ns() - t
    stats["calls"] += 1
    stats["bytes"] += n
    stats["ns"] += dt
    hist[(min(n.bit_length(), 30), min(before.bit_length(), 30))] += dt


asyncio.StreamReader.feed_data = feed_data


def dump():
    if stats["calls"] < 50:
        return
    with open(f"/tmp/fdstats-{os.getpid()}.txt", "w") as f:
        f.write(repr(stats) + "\n")
        for k, v in hist.most_common(15):
            f.write(f"chunk<2^{k[0]} buf<2^{k[1]}: {v / 1e6:.1f} ms\n")


atexit.register(dump)
