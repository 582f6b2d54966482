"""What one result boils down to for a comparison, and how an output ranks classes.

A ``ResultRow`` keeps what the comparison reads of a ``Result`` (its source,
status, error code, model, outputs and timings) and the label its echoed
``meta`` carries, so the records themselves can be dropped as they are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from worker.contract import Result

Side = Literal["baseline", "candidate"]
SIDES: Final[tuple[Side, Side]] = ("baseline", "candidate")

#: A request's identity: the ``source`` (topic, partition, offset) every result
#: carries, the wire contract's idempotency key. Request ids are chosen by
#: clients and need not be unique, so they are never joined on.
Key = tuple[str, int, int]

#: The contract's top-k outputs (docs/reference/wire-contract.md): ``topk_indices`` ranks
#: classes, best first; ``topk_scores`` are their scores, sorted, so they rank
#: nothing (their arg-max is always 0) and are compared as plain tensors.
TOPK_INDICES: Final = "topk_indices"
TOPK_SCORES: Final = "topk_scores"


@dataclass(frozen=True, slots=True)
class ResultRow:
    """One result as the comparison reads it."""

    key: Key
    status: str  # "ok" | "error"
    code: str | None  # the error code, when status is "error"
    model: str  # "name@version": the version is the model file's content hash
    outputs: Mapping[str, npt.NDArray[Any]]
    timing_us: Mapping[str, int]
    label: object = None  # meta[label_key] as the result echoes it, if asked for

    @classmethod
    def of(cls, result: Result, label_key: str | None = None) -> ResultRow:
        s = result.source
        label = None
        if label_key is not None and result.meta is not None:
            label = result.meta.get(label_key)
        return cls(
            key=(s.topic, s.partition, s.offset),
            status=result.status,
            code=None if result.error is None else result.error.code,
            model=f"{result.model.name}@{result.model.version}",
            outputs={name: t.to_numpy() for name, t in result.outputs.items()},
            timing_us=dict(result.timing_us),
            label=label,
        )

    @property
    def outcome(self) -> str:
        """``ok``, or ``error:<code>``: what two sides must agree on."""
        return "ok" if self.status == "ok" else f"error:{self.code}"


def ranking(name: str, arr: npt.NDArray[Any]) -> npt.NDArray[np.int64] | None:
    """The classes an output ranks, best first, or None when it ranks none.

    Classifier-like are the contract's ``topk_indices`` (integers, already
    ranked) and any floating output holding one row of class scores per result
    (``[classes]``, or ``[1, classes]``, with at least two classes: logits,
    probabilities), ranked by score, ties to the lower index as the worker's
    own top-k does. ``topk_scores`` ranks nothing (see above)."""
    if name == TOPK_SCORES:
        return None
    row = arr[0] if arr.ndim == 2 and arr.shape[0] == 1 else arr
    if row.ndim != 1:
        return None
    if name == TOPK_INDICES:
        if not np.issubdtype(row.dtype, np.integer) or row.size == 0:
            return None
        return row.astype(np.int64, copy=False)
    if not np.issubdtype(row.dtype, np.floating) or row.size < 2:
        return None
    return np.argsort(-row.astype(np.float64), kind="stable").astype(np.int64)


def class_of(label: object) -> int | None:
    """A label as a class index: an int, or a string of decimal digits (meta
    values are whatever the client wrote); None when it is neither."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label
    if isinstance(label, str) and label.strip().isascii() and label.strip().isdecimal():
        return int(label.strip())
    return None
