"""A pipeline's model step run as columns: the step's rows (every live request's
chosen units) stacked into whole-batch arrays, one run of the model's engine
(``Stage.run_columns``), and its outputs kept as row views of the run's arrays:
no job, no request check and no answer per row, and none of a model stage's
hand-offs. Where anything is not as the plan promised (a row of another shape,
a failing run), the step runs as a batch of jobs instead
(``worker.compute.pipeline``), which checks each row and isolates the failing
ones as a model stage does.

A step runs so (``columnar``) where its model's stage can (stateless, any batch
size, every input a tensor of fixed shape, no output cut to a request's length)
and it does not take the request as it is (the first model, checked at intake).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np

from worker.compute.steps import ModelStep, Tensors
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.errors import InferenceFailed
from worker.flow.messages import Answer, Job
from worker.obs import metrics

# What a model's stage answers a request past its deadline with (compute.triage).
_EXPIRED: Final = "deadline passed before inference"

Rows = list[tuple[int, Tensors]]  # (request, unit) of each row of the step's run


def expired(jobs: Sequence[Job], live: Mapping[int, list[bool]],
            answers: list[Answer | None]) -> None:  # fmt: skip
    """Answer ``deadline_exceeded`` the live requests past their deadline, as a
    model's stage does before a run (its expiries counted as its own)."""
    now = time.monotonic()
    for i in live:
        job = jobs[i]
        if job.deadline is not None and now >= job.deadline:
            answers[i] = Answer(job, None, ErrorInfo(ErrorCode.DEADLINE_EXCEEDED, _EXPIRED))
            metrics.EXPIRED.labels(rule=job.expiry or "deadline_ms").inc()


def run_columns(step: ModelStep, rows: Rows) -> bool:
    """Run ``rows`` through the step's model as one batch of arrays and keep
    each row's outputs in its unit (``STEP.OUTPUT``); False, with no unit
    touched, where they must run as jobs instead (a row not of the input's
    dtype and shape, a source missing, or the run failing)."""
    inputs = step.stage.binding.inputs.by_name
    arrays: dict[str, np.ndarray] = {}
    try:
        for name, source in step.sources.items():
            column = np.stack([unit[source] for _, unit in rows])
            desc = inputs[name].feeds[0]  # a tensor input of fixed shape: ``columnar``
            if column.dtype != desc.dtype or column.shape[1:] != desc.shape:
                return False
            arrays[name] = column
        out = step.stage.run_columns(arrays)
    except (KeyError, ValueError, InferenceFailed):
        return False
    prefix = f"{step.name}."
    for name, column in out.items():
        key = prefix + name
        for k, (_, unit) in enumerate(rows):
            unit[key] = column[k]
    return True
