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

import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from worker.compute.steps import FunctionStep, ModelStep, Tensors, declared_dtype, read_only
from worker.compute.triage import EXPIRED
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.errors import InferenceFailed
from worker.flow.messages import Answer, Job
from worker.obs import metrics

Rows = list[tuple[int, Tensors]]  # (request, unit) of each row of the step's run
# A batch's columnar runs' outputs by "STEP.OUTPUT": the rows each was made for, and
# the whole array (a later model step's input, as it is, where its rows are those).
Kept = dict[str, tuple[Rows, np.ndarray]]

# Per stage thread: the arrays a step's rows are stacked into, by (step, input),
# grown to the most rows seen. A thread runs one batch at a time, and a run's
# outputs are arrays of the engine's own, so the next batch on the thread may
# overwrite them: no allocation (and no page faults over fresh memory) per run.
_columns = threading.local()


def _column(step: str, name: str, rows: list[np.ndarray]) -> np.ndarray:
    """``rows`` stacked into this thread's array for (step, input)."""
    first = rows[0]
    buffers: dict[tuple[str, str], np.ndarray] = _columns.__dict__.setdefault("buffers", {})
    buf = buffers.get((step, name))
    if buf is None or len(buf) < len(rows) or buf.shape[1:] != first.shape or (
        buf.dtype != first.dtype
    ):
        buf = buffers[(step, name)] = np.empty((len(rows), *first.shape), first.dtype)
    return np.stack(rows, out=buf[: len(rows)])


def expired(jobs: Sequence[Job], live: Mapping[int, list[bool]],
            answers: list[Answer | None]) -> bool:  # fmt: skip
    """Answer ``deadline_exceeded`` the live requests past their deadline, as a
    model's stage does before a run (its expiries counted as its own); whether
    any was."""
    now = time.monotonic()
    found = False
    for i in live:
        job = jobs[i]
        if job.deadline is not None and now >= job.deadline:
            rule = job.expiry or "deadline_ms"
            answers[i] = Answer(job, None, ErrorInfo(ErrorCode.DEADLINE_EXCEEDED, EXPIRED[rule]))
            metrics.EXPIRED.labels(rule=rule).inc()
            found = True
    return found


def past_share(step: str, until: float, jobs: list[Job], answers: list[Answer | None]) -> None:
        """Answer ``deadline_exceeded`` the requests whose share of their deadline
        for the steps up to ``step`` is spent: the step does not start for them."""
        now = time.monotonic()
        for i, job in enumerate(jobs):
            if answers[i] is None and job.deadline is not None and (
                now >= job.arrived + until * (job.deadline - job.arrived)
            ):
                answers[i] = Answer(job, None, ErrorInfo(ErrorCode.DEADLINE_EXCEEDED, (
                    f"step {step!r}: the steps up to it had {until:.0%} of the request's "
                    "deadline, spent before it started")))  # fmt: skip
                metrics.EXPIRED.labels(rule="step_share").inc()  # as triage counts its own


def chosen_rows(units: Sequence[list[Tensors]], live: Mapping[int, list[bool]]) -> Rows:
    """The step's rows: each live request's chosen units, in order."""
    rows: Rows = []
    for i, keep in live.items():
        mine = units[i]
        if len(mine) == 1:  # no regions (yet): the request itself, where chosen
            if keep[0]:
                rows.append((i, mine[0]))
        else:
            rows += [(i, unit) for unit, k in zip(mine, keep, strict=True) if k]
    return rows


def run_columns(step: ModelStep, rows: Rows, kept: Kept) -> bool:
    """Run ``rows`` through the step's model as one batch of arrays and keep
    each row's outputs in its unit (``STEP.OUTPUT``), and the whole arrays in
    ``kept``; False, with no unit touched, where they must run as jobs instead
    (a row not of the input's dtype and shape, a source missing, or the run
    failing). An input that an earlier step's run made for these very rows, in
    this order, is that run's array as it is: no copy between two models."""
    inputs = step.stage.binding.inputs.by_name
    arrays: dict[str, np.ndarray] = {}
    try:
        for name, source in step.sources.items():
            column = same_rows(kept.get(source), rows)
            if column is None:
                column = _column(step.name, name, [unit[source] for _, unit in rows])
            desc = inputs[name].feeds[0]  # a tensor input of fixed shape: ``columnar``
            if column.dtype != desc.dtype or column.shape[1:] != desc.shape:
                return False
            arrays[name] = column
        out = step.stage.run_columns(arrays)
    except (KeyError, ValueError, InferenceFailed):
        return False
    keep(step.name, out, rows, kept)
    return True


def keep(step: str, out: Mapping[str, np.ndarray], rows: Rows, kept: Kept) -> None:
    """A step's outputs kept: each whole array (read only, as every step's
    outputs are to the steps after it) for later columns, a row view in each
    row's unit."""
    prefix = f"{step}."
    for name, column in out.items():
        key = prefix + name
        frozen = read_only(column)
        kept[key] = (rows, frozen)
        for (_, unit), row in zip(rows, frozen, strict=True):  # row views, made in C
            unit[key] = row


def same_rows(made: tuple[Rows, np.ndarray] | None, rows: Rows) -> np.ndarray | None:
    """An earlier run's whole output where it was made for ``rows`` (the same
    units in the same order: no request answered or region passed by since)."""
    if made is None or len(made[0]) != len(rows):
        return None
    if all(a[1] is b[1] for a, b in zip(made[0], rows, strict=True)):
        return np.ascontiguousarray(made[1])
    return None


def run_function_columns(step: FunctionStep, rows: Rows, kept: Kept) -> bool:
    """A vectorized function called once on ``rows`` (each input stacked, or an
    earlier run's array for the same rows as it is), its outputs kept as
    columns and row views; False, with no unit touched, where the rows must go
    one by one instead (an input missing or of shapes that do not stack, the
    function raising, an output not a row per row as declared), which names
    the request at fault."""
    try:
        args = {}
        for arg, source in step.sources.items():
            column = same_rows(kept.get(source), rows)
            if column is None:  # fresh, not the thread's: a function may answer with its input
                args[arg] = np.stack([u[source] for _, u in rows])
            else:  # an earlier step's own output, read only (``_keep``)
                args[arg] = column
        got = step.function(**args)
    except Exception:  # the user's code, or rows that do not stack: one by one, named
        return False
    if not isinstance(got, Mapping):
        return False
    out = {}
    for name, spec in step.outputs.items():
        value = got.get(name)
        if not isinstance(value, np.ndarray) or value.dtype != declared_dtype(spec.dtype) or (
            value.ndim != len(spec.shape) + 1 or value.shape[0] != len(rows)
        ) or any(isinstance(d, int) and d != n for d, n in zip(spec.shape, value.shape[1:],
                                                                  strict=True)):  # fmt: skip
            return False
        out[name] = value
    keep(step.name, out, rows, kept)
    return True
