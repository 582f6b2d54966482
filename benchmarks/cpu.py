"""CPU seconds a process tree spent, from ``/proc`` (Linux): the drain's "worker
CPU per record", records per core measured directly. Benchmark code, not shipped.

A drain's rate on a small machine is shared: the broker, the bench's own
collector and the worker all run on the same cores, so records per second move
with whatever else runs. The CPU the worker's processes spent per record over
the same window is its own cost alone, and much steadier between drains.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime seconds) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def host_cpu_seconds() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine since boot, every core
    (``/proc/stat``'s first line; idle and iowait are not busy)."""
    with open("/proc/stat") as fh:
        ticks = [int(t) for t in fh.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / _TICK, sum(ticks) / _TICK


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and every process below it (``run --procs N``
    members), as far as they are alive."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)], cpu[int(entry)] = st
    total, frontier = 0.0, [root]
    while frontier:
        pid = frontier.pop()
        total += cpu.get(pid, 0.0)
        frontier += [child for child, parent in parents.items() if parent == pid]
    return total


@dataclass
class CpuWindow:
    """CPU of a process tree between the first and the last moment a count grew,
    sampled at most every ``every`` seconds (a /proc scan is not free)."""

    root: int
    every: float = 0.05
    first: tuple[int, float, float, float] | None = None  # (count, tree, host busy, host all)
    last: tuple[int, float, float, float] | None = None
    _at: float = field(default=0.0, repr=False)

    def sample(self, count: int, final: bool = False) -> None:
        now = time.monotonic()
        if count == 0 or (not final and now - self._at < self.every):
            return
        if self.last is not None and count == self.last[0]:
            return  # nothing arrived: idle time is not the records'
        self._at = now
        point = (count, tree_cpu_seconds(self.root), *host_cpu_seconds())
        if self.first is None:
            self.first = point
        self.last = point

    def us_per_record(self) -> float:
        """The tree's CPU per record."""
        return self._per_record(1)

    def host_us_per_record(self) -> float:
        """Every process's CPU per record (the broker's, the bench's): with the
        tree's, what the rest of the machine spent on each record."""
        return self._per_record(2)

    def _per_record(self, at: int) -> float:
        """Microseconds per record of the CPU field ``at`` of a point (1 the tree, 2
        the machine's busy time)."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return 0.0
        return (self.last[at] - self.first[at]) / (self.last[0] - self.first[0]) * 1e6

    def host_busy(self) -> float:
        """The machine's busy share over the window (1.0: every core busy)."""
        if self.first is None or self.last is None or self.last[3] <= self.first[3]:
            return 0.0
        return min(1.0, (self.last[2] - self.first[2]) / (self.last[3] - self.first[3]))
