"""Which steps of a pipeline run for each request of a batch, and what its
answer says of those that did not (``partial``).

A step runs for a request unless it reads a tensor of a step that did not run
for it (a branch not taken, an optional step that failed it: recorded, named by
the answer) or its branch (``when``) is false for the request. A branch on a
per-region tensor (after a fan-out) is decided per region: the step runs on the
regions where it is true, the others pass it by, and so do the steps reading
its outputs; that is the branch's purpose, not a partial answer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from worker.compute.ops import Regional
from worker.compute.steps import Step, Tensors


class Partial:
    """A batch's record of the steps that did not run for each request."""

    def __init__(self, requests: int) -> None:
        self._not_run: list[set[str]] = [set() for _ in range(requests)]
        self._skipped: list[list[str]] = [[] for _ in range(requests)]
        self._failed: list[list[dict[str, str]]] = [[] for _ in range(requests)]

    def chosen(self, i: int, step: Step, units: list[Tensors], regional: Mapping[str, Regional],
               plain: bool = False) -> list[bool] | None:  # fmt: skip
        """The units of request ``i`` that ``step`` runs on (a flag a unit), or
        None where it does not run for the request at all (recorded as skipped:
        a branch per request not taken, or an input from a step that did not
        run for it). ``plain``: the step has no branch and reads no per-region
        tensor (``plain_step``), so where every step ran for the request so far
        it runs on every unit, with nothing to look up."""
        not_run = self._not_run[i]
        if plain and not not_run:
            return _every(len(units))
        reads = [*step.sources.values(), *([step.when] if step.when else [])]
        if any(s.partition(".")[0] in not_run for s in reads) or (
            units and step.when and step.when not in regional and step.when in units[0]
            and not _true(units[0][step.when])
        ):
            not_run.add(step.name)
            self._skipped[i].append(step.name)
            return None
        # Per region: every per-region tensor it reads is there (a region a branch
        # passed by has none of that step's), and its branch, if per region, true.
        mine = [s for s in reads if s in regional]
        per_region = bool(step.when) and step.when in regional
        return [all(s in unit for s in mine) and (not per_region or _true(unit[step.when]))
                for unit in units]  # fmt: skip

    def fail(self, i: int, step: str, code: str, message: str) -> bool:
        """Record an optional step's failure of request ``i`` (once: a model step
        fails per unit); whether it is new."""
        if step in self._not_run[i]:
            return False
        self._not_run[i].add(step)
        self._failed[i].append({"step": step, "code": code, "message": message})
        return True

    def ran(self, i: int) -> Callable[[str], bool]:
        """For request ``i``: whether the step of a source (``STEP.OUTPUT``) ran."""
        not_run = self._not_run[i]
        return lambda source: source.partition(".")[0] not in not_run

    def of(self, i: int) -> dict[str, list[Any]] | None:
        """Request ``i``'s ``partial`` field, or None where every step ran."""
        if not self._not_run[i]:
            return None
        out: dict[str, list[Any]] = {}
        if self._skipped[i]:
            out["skipped"] = list(self._skipped[i])
        if self._failed[i]:
            out["failed"] = list(self._failed[i])
        return out


def plain_step(step: Step, regional: Mapping[str, Regional]) -> bool:
    """No branch, and no per-region tensor read (``Partial.chosen``'s ``plain``)."""
    return not step.when and not any(s in regional for s in step.sources.values())


@functools.cache
def _every(n: int) -> list[bool]:
    """Every one of ``n`` units (shared: read, never changed)."""
    return [True] * n


def _true(value: np.ndarray) -> bool:
    """A branch's value: true where any of it is non-zero."""
    return bool(np.asarray(value).any())
