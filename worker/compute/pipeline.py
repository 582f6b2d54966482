"""A pipeline's stage: each batch through the pipeline's steps in turn, one answer
per request (``[pipelines.NAME]``, docs/guides/pipelines.md).

A model step runs the batch's requests as that model's own stage runs a batch
(``Stage.run_batch``, on the CPU stage or, for a GPU model, the GPU stage's
slots: rows of one length together, poison isolated by bisection, deadlines
honoured), so the crops of many requests form one batch of the next model; a
function step runs once per request on the stage's threads
(``worker.compute.steps``). Between steps the tensors stay in memory: a
request's tensors so far, by ``STEP.OUTPUT`` and ``request.NAME``, feed the next
step's inputs, checked as the next model checks a request's. After a fan-out
step a request is several units, one per region, each run by the steps after
it; its answer stacks their outputs. A request a step fails (any of its units)
is answered ``inference_failed`` naming the step (and the tensor, where one was
not what the step takes); the other requests of the batch go on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog

from worker.compute.ops import Regional
from worker.compute.stage import Described, Stage
from worker.compute.steps import (
    FunctionStep,
    ModelStep,
    Step,
    Tensors,
    call,
    fed,
    runs,
    stacked,
    unpinned,
)
from worker.compute.triage import ServiceTimeHook, micros
from worker.config.pipelines import REQUEST
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.errors import RecordError
from worker.flow.messages import Answer, Batch, Completed, Job, StepOutputs, TopicPartition
from worker.flow.room import Room
from worker.model.inputs.binding import Binding
from worker.model.io import EngineInfo
from worker.obs import metrics

log = structlog.get_logger(__name__)



class PipelineStage(Stage):
    """Batches of a pipeline's requests in, their answers out (one per request, the
    pipeline's ``outputs``), in dispatch order like any stage's."""

    def __init__(
        self,
        batches_in: asyncio.Queue[Batch[Job] | None],
        completed_out: asyncio.Queue[asyncio.Future[Completed] | None],
        info: EngineInfo,
        binding: Binding,
        steps: list[Step],
        outputs: Mapping[str, str],
        *,
        max_inflight: int,
        regional: Mapping[str, Regional] | None = None,
        described: Mapping[str, Described] | None = None,
        on_service_time: ServiceTimeHook | None = None,
        room: Room | None = None,
        first_takes_request: bool = True,
    ) -> None:
        """``info``: the pipeline as results name it; ``binding``: what a request
        is checked against at intake (its declared tensors', or its first step's
        model's); ``first_takes_request``: the first step is a model whose request
        is the pipeline's, checked at intake (else every step reads the request's
        tensors as ``request.NAME``, models' checked as fed); ``outputs``: the
        answer's outputs, each from "STEP.OUTPUT"; ``regional``: the sources that
        are per region (after a fan-out), each with its declared dtype and shape
        where fixed (a request without regions gets an empty tensor of it);
        ``described``: the outputs as declared, for the pipeline's card."""
        super().__init__(
            batches_in, completed_out, info, binding,
            max_attempts=1, on_service_time=on_service_time, room=room,
        )  # fmt: skip
        self._pipeline = info.name
        self._first_takes_request = first_takes_request
        self._steps = steps
        self._answer = dict(outputs)
        self._regional = dict(regional or {})
        self._described = dict(described or {})
        self._threads = max_inflight
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="step")
        self._step_seconds = {
            s.name: metrics.PIPELINE_STEP_SECONDS.labels(info.name, s.name) for s in steps
        }
        self._step_failures = {
            s.name: metrics.PIPELINE_STEP_FAILURES.labels(info.name, s.name) for s in steps
        }

    async def dispatch(self, batch: Batch[Job]) -> asyncio.Future[Completed]:
        return asyncio.ensure_future(self.run_batch(batch))

    async def run_batch(self, batch: Batch[Job]) -> Completed:
        started = time.monotonic()
        jobs = list(batch.items)
        # Per request: its own tensors, and its units (itself, or one per region).
        bases: list[Tensors] = [{} if self._first_takes_request else _request_tensors(job)
                                for job in jobs]  # fmt: skip
        units: list[list[Tensors]] = [[base] for base in bases]
        answers: list[Answer | None] = [self._pinned_elsewhere(job) for job in jobs]
        timings: list[dict[str, int]] = [{} for _ in jobs]
        # Per request: the steps that did not run for it (a branch not taken, an
        # input from such a step, an optional step that failed it), as its answer
        # names them (``partial``).
        partial = _Partial(len(jobs))
        engine_rows = 0
        for index, step in enumerate(self._steps):
            if step.until is not None:
                self._past_share(step.name, step.until, jobs, answers)
            live = [i for i, a in enumerate(answers) if a is None]
            live = [i for i in live if partial.runs(i, step, units[i])]
            if not any(a is None for a in answers):
                break
            if not live:
                continue
            step_started = time.monotonic()
            if isinstance(step, ModelStep):
                engine_rows += await self._model_step(
                    step, index, batch, jobs, live, units, answers, timings, partial
                )
            else:
                await self._function_step(step, jobs, live, units, answers, partial)
            self._step_seconds[step.name].observe(time.monotonic() - step_started)
        for i, job in enumerate(jobs):
            if answers[i] is None:
                ran = partial.ran(i)
                out = {name: self._value(bases[i], units[i], source)
                       for name, source in self._answer.items() if ran(source)}  # fmt: skip
                timing = {**timings[i], "infer": micros(time.monotonic() - started)}
                steps = tuple(self._step_outputs(bases[i], units[i], ran))
                answers[i] = Answer(job, out, None, timing, steps=steps,
                                    partial=partial.of(i))  # fmt: skip
        service_s = time.monotonic() - started
        done = tuple(a for a in answers if a is not None)
        return Completed(batch.seq, done, engine_rows, service_s)

    def _value(self, base: Tensors, units: list[Tensors], source: str) -> np.ndarray:
        """A request's tensor: its own, or its regions' stacked (after a fan-out)."""
        if source in self._regional:
            return stacked(units, source, self._regional[source])
        return base[source]

    async def _function_step(
        self,
        step: FunctionStep,
        jobs: list[Job],
        live: list[int],
        units: list[list[Tensors]],
        answers: list[Answer | None],
        partial: _Partial,
    ) -> None:
        """Run a function on each live request's units, on the stage's threads:
        the batch's requests split among them, one hand-off per thread (a hand-off
        per request cost about 70 us each, more than many functions)."""
        loop = asyncio.get_running_loop()
        share = -(-len(live) // self._threads)  # requests per thread, rounded up
        parts = [live[k : k + share] for k in range(0, len(live), share)]
        done = await asyncio.gather(*(
            loop.run_in_executor(self._pool, _call_each, step, [units[i] for i in part])
            for part in parts
        ))  # fmt: skip
        for part, results in zip(parts, done, strict=True):
            for i, got in zip(part, results, strict=True):
                if isinstance(got, str):
                    answers[i] = self._failed(jobs[i], i, step, got, units[i], partial)
                else:
                    units[i] = got

    async def _model_step(
        self,
        step: ModelStep,
        index: int,
        batch: Batch[Job],
        jobs: list[Job],
        live: list[int],
        units: list[list[Tensors]],
        answers: list[Answer | None],
        timings: list[dict[str, int]],
        partial: _Partial,
    ) -> int:
        """Run every live unit through ``step``'s model, as one batch of it."""
        fed_to: list[tuple[int, Tensors]] = []  # (request, unit) of each step job
        step_jobs: list[Job] = []
        for i in live:
            job = jobs[i]
            if index == 0 and self._first_takes_request:  # checked at intake as its model's
                units[i][0].update(_request_tensors(job))
                fed_to.append((i, units[i][0]))
                step_jobs.append(unpinned(job))
                continue
            try:
                made = [fed(job, step, unit) for unit in units[i]]
            except RecordError as exc:
                answers[i] = self._failed(job, i, step, str(exc), units[i], partial)
                continue
            fed_to += [(i, unit) for unit in units[i]]
            step_jobs += made
        if not step_jobs:
            return 0
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
                    unit[f"{step.name}.{name}"] = value
        return done.engine_rows

    def _step_outputs(
        self, base: Tensors, units: list[Tensors], ran: Callable[[str], bool]
    ) -> list[StepOutputs]:
        """The outputs of the steps that write them to a topic and ran, for one request."""
        out = []
        for step in self._steps:
            if step.topic and ran(f"{step.name}."):
                names = step.outputs if isinstance(step, FunctionStep) else step.produces
                mine = {n: self._value(base, units, f"{step.name}.{n}") for n in names}
                out.append(StepOutputs(step.topic, f"{self._pipeline}/{step.name}", mine))
        return out

    @staticmethod
    def _past_share(step: str, until: float, jobs: list[Job], answers: list[Answer | None]) -> None:
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

    def _pinned_elsewhere(self, job: Job) -> Answer | None:
        """A request pinning a version of the pipeline other than this one is
        answered ``unknown_model`` (its steps' models have versions of their own)."""
        ref = job.request.model if job.request is not None else None
        if ref is None or ref.version is None or ref.version == self.info.version:
            return None
        return Answer(job, None, ErrorInfo(ErrorCode.UNKNOWN_MODEL, (
            f"model.version: {ref.version[:64]!r} is not served; {self._pipeline!r} serves "
            f"version {self.info.version!r}")))  # fmt: skip

    def _failed(
        self, job: Job, i: int, step: Step, problem: str, units: list[Tensors],
        partial: _Partial,
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

    def described_outputs(self) -> Mapping[str, Described]:
        return self._described

    def forget(self, revoked: set[TopicPartition]) -> None:
        for step in self._steps:
            if isinstance(step, ModelStep):
                step.stage.forget(revoked)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for step in self._steps:
            if isinstance(step, ModelStep):
                step.stage.close()


def _request_tensors(job: Job) -> Tensors:
    """A request's tensors as the steps read them (``request.NAME``); an image
    sent as a file has none here (its first model decodes it)."""
    return {f"{REQUEST}.{k}": v for k, v in job.inputs.items() if isinstance(v, np.ndarray)}


def _call_each(step: FunctionStep, requests: list[list[Tensors]]) -> list[list[Tensors] | str]:
    """``call`` on each request's units in turn, on one stage thread."""
    return [_call_units(step, units) for units in requests]


def _call_units(step: FunctionStep, units: list[Tensors]) -> list[Tensors] | str:
    """One request's units after the step, or why it failed (its first unit that did)."""
    after: list[Tensors] = []
    for unit in units:
        got = call(step, unit)
        if isinstance(got, str):
            return got
        after += got
    return after


class _Partial:
    """A batch's record of the steps that did not run for each request."""

    def __init__(self, requests: int) -> None:
        self._not_run: list[set[str]] = [set() for _ in range(requests)]
        self._skipped: list[list[str]] = [[] for _ in range(requests)]
        self._failed: list[list[dict[str, str]]] = [[] for _ in range(requests)]

    def runs(self, i: int, step: Step, units: list[Tensors]) -> bool:
        """Whether ``step`` runs for request ``i`` (its branch is per request:
        every unit holds the same value); recorded as skipped where not."""
        if not units or runs(step, units[0], self._not_run[i]):
            return True
        self._not_run[i].add(step.name)
        self._skipped[i].append(step.name)
        return False

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
