"""One pipeline step run over a batch's live requests, off the pipeline's loop
of steps (``worker.compute.pipeline``, which decides which step runs where and
for whom).

A function step runs on each live request's chosen units, on the stage's
threads (the batch's requests split among them), or, vectorized, once on all
their rows; a model step runs their units as one batch of that model's own
stage (``Stage.run_batch``). Each leaves a request's units with the step's
outputs added, or the request answered where the step failed it:
``inference_failed`` naming the step, or, for an optional step, the request
going on without its outputs (``worker.compute.branches.Partial``).

``Progress`` is one batch on its way through the steps, written by one thread
at a time: the batch's task, or the stage thread it handed a step (or a run of
steps) to and awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog

from worker.compute.branches import Partial
from worker.compute.columns import Kept, chosen_rows, run_function_columns
from worker.compute.resident import OnDevice
from worker.compute.steps import (
    FunctionStep,
    ModelStep,
    Step,
    Tensors,
    call_each,
    fed,
    read_only,
    request_tensors,
    unpinned,
)
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.errors import RecordError
from worker.flow.messages import Answer, Batch, Job
from worker.obs import metrics

log = structlog.get_logger(__name__)


@dataclass
class Progress:
    """One batch on its way through the steps."""

    batch: Batch[Job]
    jobs: list[Job]
    bases: list[Tensors]  # per request: its own tensors
    units: list[list[Tensors]]  # per request: itself, or one unit per region
    answers: list[Answer | None]  # per request: its answer, once it has one
    timings: list[dict[str, int]]  # per request: its first model step's stage times
    # Per request: the steps that did not run for it (a branch not taken, an input
    # from such a step, an optional step that failed it), as its answer names them.
    partial: Partial
    engine_rows: int = 0
    deadlines: bool = True  # whether any request of the batch has a deadline to check
    # Columnar model steps' outputs as whole arrays, for the model steps after them.
    columns: Kept = field(default_factory=dict)
    device: OnDevice | None = None  # GPU steps' outputs left on the device


class StepRunner:
    """Runs a pipeline's steps, one at a time, for a batch's live requests."""

    def __init__(self, pipeline: str, steps: tuple[Step, ...], *, first_takes_request: bool,
                 pool: ThreadPoolExecutor, threads: int) -> None:  # fmt: skip
        """``first_takes_request``: whether the first step takes the request as
        it came (checked at intake as its model's); ``pool``: the stage's
        threads, ``threads`` of them."""
        self._pipeline = pipeline
        self._first_takes_request = first_takes_request
        self._pool = pool
        self._threads = threads
        self._step_failures = {
            s.name: metrics.PIPELINE_STEP_FAILURES.labels(pipeline, s.name) for s in steps
        }

    async def function_step(
        self, step: FunctionStep, p: Progress, live: Mapping[int, list[bool]]
    ) -> None:
        """Run a function on each live request's chosen units, on the stage's
        threads: the batch's requests split among them, one hand-off per thread
        (a hand-off per request cost about 70 us each, more than many functions)."""
        loop = asyncio.get_running_loop()
        if step.vectorized:  # the batch's rows at once, on one thread
            await loop.run_in_executor(self._pool, self.call_function, step, p, live)
            return
        order = list(live)
        # An op on the device takes the batch at once; a function, its share of it.
        threads = 1 if step.batched is not None else self._threads
        share = -(-len(order) // threads)  # requests per thread, rounded up
        parts = [order[k : k + share] for k in range(0, len(order), share)]
        done = await asyncio.gather(*(
            loop.run_in_executor(self._pool, call_each, step,
                                 [(p.units[i], live[i]) for i in part])
            for part in parts
        ))  # fmt: skip
        for part, results in zip(parts, done, strict=True):
            self._kept(step, p, part, results)

    def call_function(self, step: FunctionStep, p: Progress,
                      live: Mapping[int, list[bool]]) -> None:  # fmt: skip
        """A function on the live requests' chosen units, on this thread: a
        vectorized one once on all their rows where it can be, else (and any
        other) once per unit."""
        if step.vectorized:
            rows = chosen_rows(p.units, live)
            if not rows or run_function_columns(step, rows, p.columns):
                return
        self._kept(step, p, list(live), call_each(step, [(p.units[i], keep)
                                                         for i, keep in live.items()]))

    def _kept(self, step: FunctionStep, p: Progress, live: list[int],
              results: list[list[Tensors] | str]) -> None:  # fmt: skip
        """A function step's results for ``live`` requests: their units after it,
        or their answers where it failed them."""
        for i, got in zip(live, results, strict=True):
            if isinstance(got, str):
                p.answers[i] = self._failed(p.jobs[i], i, step, got, p.units[i], p.partial)
            else:
                p.units[i] = got

    async def model_step(
        self, step: ModelStep, index: int, p: Progress, live: Mapping[int, list[bool]]
    ) -> int:
        """Run every live request's chosen units through ``step``'s model, as one
        batch of it; returns the rows its engine ran."""
        jobs, units, answers, timings, partial = p.jobs, p.units, p.answers, p.timings, p.partial
        fed_to: list[tuple[int, Tensors]] = []  # (request, unit) of each step job
        step_jobs: list[Job] = []
        for i, keep in live.items():
            job = jobs[i]
            if index == 0 and self._first_takes_request:  # checked at intake as its model's
                units[i][0].update(request_tensors(job))
                fed_to.append((i, units[i][0]))
                step_jobs.append(unpinned(job))
                continue
            mine = [unit for unit, k in zip(units[i], keep, strict=True) if k]
            try:
                made = [fed(job, step, unit) for unit in mine]
            except RecordError as exc:
                answers[i] = self._failed(job, i, step, str(exc), units[i], partial)
                continue
            fed_to += [(i, unit) for unit in mine]
            step_jobs += made
        if not step_jobs:
            return 0
        batch = p.batch
        done = await step.stage.run_batch(Batch(step_jobs, batch.formed_at, batch.reason,
                                                seq=batch.seq))  # fmt: skip
        for (i, unit), answer in zip(fed_to, done.answers, strict=True):
            if answers[i] is not None or not partial.ran(i)(f"{step.name}."):
                continue  # another unit of it failed already
            error = answer.error
            if index == 0 and self._first_takes_request and (answer.job.failure is not None or (
                    error is not None and error.code != ErrorCode.INFERENCE_FAILED)):
                answers[i] = answer  # the request's own fault: answered as the model does
            elif error is not None and error.code == ErrorCode.DEADLINE_EXCEEDED:
                answers[i] = Answer(jobs[i], None, error, answer.timing_us)
            elif error is not None:  # the step failed on it, or it was not what it takes
                answers[i] = self._failed(jobs[i], i, step, error.message, units[i], partial)
            else:
                if not timings[i]:  # the first model step's stage times: the answer's
                    timings[i] = dict(answer.timing_us)
                assert answer.outputs is not None
                for name, value in answer.outputs.items():
                    unit[f"{step.name}.{name}"] = read_only(value)
        return done.engine_rows

    def _failed(
        self, job: Job, i: int, step: Step, problem: str, units: list[Tensors],
        partial: Partial,
    ) -> Answer | None:
        """Request ``i``'s answer where ``step`` failed it: ``inference_failed``
        naming the step, or (an optional step) None: it goes on without the
        step's outputs (dropped from every unit: some of its regions may have
        them), and its answer names the step (``partial.failed``)."""
        self._step_failures[step.name].inc()
        log.warning("pipeline_step_failed", pipeline=self._pipeline, step=step.name,
                    error=problem, optional=step.optional)  # fmt: skip
        if step.optional:
            if partial.fail(i, step.name, ErrorCode.INFERENCE_FAILED, problem):
                prefix = f"{step.name}."
                for unit in units:
                    for key in [k for k in unit if k.startswith(prefix)]:
                        del unit[key]
            return None
        error = ErrorInfo(ErrorCode.INFERENCE_FAILED, f"step {step.name!r}: {problem}")
        return Answer(job, None, error)
