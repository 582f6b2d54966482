"""What the CPU and GPU stages share: which requests of a batch run, and how a
failing run is narrowed down to the requests that cause it.

Both stages answer a batch the same way; only *how* a set of rows is run
differs (a worker thread over host buffers, or a slot's CUDA stream), so that is
the one thing they hand in: a ``RowRunner``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Final

import structlog

from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.errors import InferenceFailed
from worker.flow.messages import Batch, Completed, ExpiryRule, Job
from worker.model.rows import Row
from worker.obs import metrics

log = structlog.get_logger(__name__)

RowRunner = Callable[[list[Row]], Awaitable[None]]
"""Runs answers through the engine, filling their outputs and timings; raises
``InferenceFailed`` with none of them filled, or ``EngineDead``."""

ServiceTimeHook = Callable[[float], None]
"""Told each batch's service seconds (the batch policy flushes deadlines by it)."""


# What a request past its deadline (or its age limit) is answered with, by rule.
EXPIRED: Final[dict[ExpiryRule, str]] = {
    "deadline_ms": "deadline passed before inference",
    "max_record_age": "record older than batching.max_record_age_ms before inference",
}


def micros(seconds: float) -> int:
    return round(seconds * 1e6)


def triage(batch: Batch[Job], now: float, m: metrics.ModelMetrics) -> tuple[list[Row], list[Row]]:
    """One row per job, in batch order, and the rows that need the engine.

    Jobs that failed at intake pass through with their failure; jobs past their
    deadline are answered ``deadline_exceeded`` without spending engine time."""
    answers = [Row.of(job) for job in batch.items]
    runnable: list[Row] = []
    queued_s = [batch.formed_at - answer.job.arrived for answer in answers]
    metrics.observe_all(m.queue_seconds, queued_s)
    for answer, queued in zip(answers, queued_s, strict=True):
        job = answer.job
        answer.timing_us["queue"] = micros(queued)
        if job.failure is not None:
            continue
        if job.deadline is not None and now >= job.deadline:
            expiry = job.expiry or "deadline_ms"
            answer.error = ErrorInfo(ErrorCode.DEADLINE_EXCEEDED, EXPIRED[expiry])
            metrics.EXPIRED.labels(rule=job.expiry or "deadline_ms").inc()
            continue
        runnable.append(answer)
    return answers, runnable


def pinned(runnable: list[Row], version: str) -> list[Row]:
    """The rows ``version`` may answer: a request pinning another version of its
    model (``model.version``) is answered ``unknown_model`` naming the one that
    serves; checked where the batch runs, so a model swapped since intake cannot
    answer a request pinned to the version before."""
    kept = runnable
    for i, row in enumerate(runnable):
        request = row.job.request
        pin = None if request is None or request.model is None else request.model.version
        if pin is None or pin == version:
            if kept is not runnable:
                kept.append(row)
            continue
        if kept is runnable:
            kept = runnable[:i]
        row.error = ErrorInfo(
            ErrorCode.UNKNOWN_MODEL,
            f"model.version: {pin[:64]!r} is not served; {row.job.model or 'the model'!r} "
            f"serves version {version!r}",
        )
    return kept


def completed(
    batch: Batch[Job],
    rows: list[Row],
    engine_rows: int,
    service_s: float = 0.0,
    model_version: str | None = None,
) -> Completed:
    """What goes downstream for ``batch``: its rows' answers, frozen, in order."""
    answers = tuple(r.answer() for r in rows)
    return Completed(batch.seq, answers, engine_rows, service_s, model_version)


async def run_isolating(
    answers: list[Row],
    run: RowRunner,
    max_attempts: int,
    m: metrics.ModelMetrics,
    failed: InferenceFailed | None = None,
) -> None:
    """Run ``answers``; when the engine fails on them, split them in halves and run
    each, until the failing requests are alone. A request that fails alone is
    retried until it took part in ``max_attempts`` failed runs, then answered
    ``inference_failed``; everything else in the batch succeeds. At most
    2n - 1 + attempts runs. ``EngineDead`` propagates: nothing can run any more.
    ``failed``: the first run already happened, and failed so."""
    if failed is None:
        try:
            await run(answers)
            return
        except InferenceFailed as exc:
            failed = exc
    m.batch_failures.inc()
    log.warning("batch_failed", size=len(answers), error=str(failed))
    failure = failed
    if len(answers) > 1:
        half = len(answers) // 2
        for part in (answers[:half], answers[half:]):
            m.isolation_runs.inc()
            await run_isolating(part, run, max_attempts, m)
        return
    row = answers[0]
    row.attempts += 1
    if row.attempts < max_attempts:
        m.isolation_runs.inc()
        await run_isolating(answers, run, max_attempts, m)
        return
    row.error = ErrorInfo(failure.code, f"{failure} (after {row.attempts} attempts)")


def report_service_time(
    hook: ServiceTimeHook | None,
) -> Callable[[asyncio.Future[Completed]], None]:
    """A done-callback for a batch's future that tells ``hook`` its service time."""

    def done(fut: asyncio.Future[Completed]) -> None:
        if hook is None or fut.cancelled() or fut.exception() is not None:
            return
        completed = fut.result()
        if completed.engine_rows:
            hook(completed.service_s)

    return done
