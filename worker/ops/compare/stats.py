"""The statistics of a comparison, accumulated pair by pair (no I/O).

Each accumulator takes one joined pair (or one side's result) at a time and
keeps only sums, counts and maxima, except the latencies, whose percentiles
need every timing (integers, one per stage and result).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from worker.flow.codes import ErrorCode
from worker.ops.compare.results import ResultRow, Side, ranking

#: The stages a result's ``timing_us`` names (docs/reference/wire-contract.md), in
#: pipeline order; any other key a worker adds follows, sorted.
STAGES: Final = ("queue", "decode", "preprocess", "infer", "d2h", "total")
PERCENTILES: Final = (50, 95, 99)


# Outputs whose values are class numbers (the worker's top-k): compared by
# agreement only, never by difference or cosine.
INDEX_OUTPUTS = frozenset({"topk_indices"})


@dataclass(frozen=True)
class OutputSummary:
    """How one output agreed over the pairs both sides answered ``ok``.

    ``rows``: pairs whose output had the same shape on both sides (the tensor
    statistics are over these); ``ranked``: pairs where it ranks classes on
    both sides (``results.ranking``), over which ``top1`` and ``topk`` (the
    mean share of the top ``k`` classes both sides name) are measured.
    ``max_abs_diff`` is infinite when two differing tensors hold NaN or
    infinities (``non_finite`` rows); ``mean_cosine`` leaves those rows out.
    A statistic over no rows is None, never a number that looks like one."""

    rows: int
    only_baseline: int  # pairs where only the baseline's result carried it
    only_candidate: int
    shape_mismatch: int
    non_finite: int
    max_abs_diff: float | None
    mean_cosine: float | None
    ranked: int
    top1: float | None
    topk: float | None
    k: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "only_baseline": self.only_baseline,
            "only_candidate": self.only_candidate,
            "shape_mismatch": self.shape_mismatch,
            "non_finite": self.non_finite,
            # JSON has no infinity: a string says it, and a reader's float() reads it.
            "max_abs_diff": "inf" if self.max_abs_diff == math.inf else self.max_abs_diff,
            "mean_cosine": self.mean_cosine,
            "ranked": self.ranked,
            "top1_agreement": self.top1,
            "topk_agreement": self.topk,
            "k": self.k,
        }


@dataclass
class OutputAgreement:
    """The running statistics of one output (see ``OutputSummary``)."""

    top_k: int
    rows: int = 0
    only_baseline: int = 0
    only_candidate: int = 0
    shape_mismatch: int = 0
    non_finite: int = 0
    max_abs_diff: float = 0.0
    cosine_sum: float = 0.0
    cosine_rows: int = 0
    ranked: int = 0
    top1_agree: int = 0
    topk_sum: float = 0.0
    k: int | None = None

    def add(self, name: str, a: npt.NDArray[Any] | None, b: npt.NDArray[Any] | None) -> None:
        """One pair's values of this output (None: that side's result lacks it)."""
        if a is None or b is None:
            if a is not None:
                self.only_baseline += 1
            elif b is not None:
                self.only_candidate += 1
            return
        self._rank(name, a, b)
        if name in INDEX_OUTPUTS:
            return  # class numbers: their agreement is counted above; a difference means nothing
        if a.shape != b.shape:
            self.shape_mismatch += 1
            return
        self.rows += 1
        x = a.astype(np.float64).ravel()
        y = b.astype(np.float64).ravel()
        if np.array_equal(x, y, equal_nan=True):
            self.cosine_sum += 1.0
            self.cosine_rows += 1
        elif not (np.isfinite(x).all() and np.isfinite(y).all()):
            self.non_finite += 1
            self.max_abs_diff = math.inf
        else:
            self.max_abs_diff = max(self.max_abs_diff, float(np.max(np.abs(x - y))))
            self.cosine_sum += cosine(x, y)
            self.cosine_rows += 1

    def _rank(self, name: str, a: npt.NDArray[Any], b: npt.NDArray[Any]) -> None:
        ra, rb = ranking(name, a), ranking(name, b)
        if ra is None or rb is None:
            return
        k = min(self.top_k, len(ra), len(rb))
        self.k = k if self.k is None else min(self.k, k)
        self.ranked += 1
        self.top1_agree += int(ra[0] == rb[0])
        self.topk_sum += len(set(ra[:k].tolist()) & set(rb[:k].tolist())) / k

    def summary(self) -> OutputSummary:
        return OutputSummary(
            rows=self.rows,
            only_baseline=self.only_baseline,
            only_candidate=self.only_candidate,
            shape_mismatch=self.shape_mismatch,
            non_finite=self.non_finite,
            max_abs_diff=self.max_abs_diff if self.rows else None,
            mean_cosine=self.cosine_sum / self.cosine_rows if self.cosine_rows else None,
            ranked=self.ranked,
            top1=self.top1_agree / self.ranked if self.ranked else None,
            topk=self.topk_sum / self.ranked if self.ranked else None,
            k=self.k,
        )


def cosine(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> float:
    """The cosine similarity of two finite vectors that differ: 0 when one of
    them is all zeros (it points nowhere), clipped to [-1, 1] against rounding."""
    nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    if nx == 0.0 or ny == 0.0:
        return 0.0
    return max(-1.0, min(1.0, float(np.dot(x, y)) / (nx * ny)))


@dataclass
class StatusAgreement:
    """Pairs whose outcome differs: one side ``ok`` and the other an error
    (``status_differs``), or both errors with different codes
    (``code_differs``); ``changes`` counts each "baseline -> candidate" kind.
    A pair where one side alone answered ``deadline_exceeded`` is counted apart
    (``expired``): that side read the request past its deadline (a shadow
    started on a backlog), which says nothing about its model."""

    joined: int = 0
    status_differs: int = 0
    code_differs: int = 0
    expired: int = 0
    changes: Counter[str] = field(default_factory=Counter)

    def add(self, a: ResultRow, b: ResultRow) -> None:
        self.joined += 1
        if a.outcome == b.outcome:
            return
        self.changes[f"{a.outcome} -> {b.outcome}"] += 1
        if ErrorCode.DEADLINE_EXCEEDED in (a.code, b.code):
            self.expired += 1
            return
        if a.status != b.status:
            self.status_differs += 1
        else:
            self.code_differs += 1

    @property
    def differs(self) -> int:
        return self.status_differs + self.code_differs

    def to_dict(self) -> dict[str, Any]:
        return {
            "joined": self.joined,
            "differs": self.differs,
            "status_differs": self.status_differs,
            "error_code_differs": self.code_differs,
            "expired_on_one_side": self.expired,
            "changes": dict(sorted(self.changes.items())),
        }


@dataclass
class Latency:
    """Every ``ok`` result's timings, per side, model and stage. Error results
    are left out: most never reach the engine, and would pull the percentiles
    of the answers that did down."""

    us: dict[Side, dict[str, dict[str, list[int]]]] = field(default_factory=dict)

    def add(self, side: Side, row: ResultRow) -> None:
        if row.status != "ok":
            return
        stages = self.us.setdefault(side, {}).setdefault(row.model, {})
        for stage, value in row.timing_us.items():
            stages.setdefault(stage, []).append(int(value))

    def summary(self) -> dict[str, dict[str, dict[str, dict[str, float | int]]]]:
        """``{side: {model: {stage: {"n", "p50_us", "p95_us", "p99_us"}}}}``."""
        out: dict[str, dict[str, dict[str, dict[str, float | int]]]] = {}
        for side, models in self.us.items():
            for model, stages in models.items():
                order = sorted(stages, key=lambda s: (STAGES.index(s) if s in STAGES else 99, s))
                out.setdefault(side, {})[model] = {
                    stage: percentiles(stages[stage]) for stage in order
                }
        return out


def percentiles(values: list[int]) -> dict[str, float | int]:
    """``n`` and the percentiles of ``values`` (linear interpolation, NumPy's
    default), in microseconds as the results carry them."""
    arr = np.asarray(values, dtype=np.float64)
    ps = np.percentile(arr, PERCENTILES)
    return {
        "n": len(values),
        **{f"p{p}_us": round(float(v), 1) for p, v in zip(PERCENTILES, ps, strict=True)},
    }
