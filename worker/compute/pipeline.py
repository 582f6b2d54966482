"""A pipeline's stage: each batch through the pipeline's steps in turn, one answer
per request (``[pipelines.NAME]``, docs/guides/pipelines.md).

A model step whose model takes fixed-shape tensors runs as columns
(``worker.compute.columns``): its rows stacked into one array (or an earlier
step's output array as it is), one engine run, its outputs kept as row views;
such steps and the functions beside them run on one stage thread a batch. Any
other model step runs the batch's requests as that model's own stage runs a
batch (``Stage.run_batch``, on the CPU stage or the GPU stage's slots: rows of
one length together, poison isolated by bisection, deadlines honoured), which
is also where a columnar step goes back to where its rows are not as promised.
Either way the crops of many requests form one batch of the next model. A
function step runs once per request on the stage's threads, or, vectorized,
once a batch (``worker.compute.steps``); a built-in op on the GPU runs a batch
at once (``worker.compute.ops.device``). Where a model runs on the GPU as
columns, the GPU steps leave their outputs on the device for each other, copied
to the host only where a host step or the answer reads them
(``worker.compute.resident``). Between steps the tensors stay in memory, read
only: a request's tensors so far, by ``STEP.OUTPUT`` and ``request.NAME``, feed
the next step's inputs. After a fan-out step a request
is several units, one per region, each run by the steps after it (a branch on
a per-region tensor runs a step on the regions where it is true:
``worker.compute.branches``); its answer stacks their outputs, or gives each
region's values and shape where the plan answers an output ragged
(``worker.compute.answers``). A request a step fails (any of its units) is
answered ``inference_failed`` naming the step (and the tensor, where one was
not what the step takes); the other requests of the batch go on.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog

from worker.compute.answers import answered
from worker.compute.branches import Partial, plain_step
from worker.compute.columns import (
    Kept,
    chosen_rows,
    expired,
    past_share,
    run_columns,
    run_function_columns,
)
from worker.compute.resident import (
    Home,
    OnDevice,
    answer_reads,
    device_steps,
    host_reads,
    on_a_thread,
    run_model,
    together,
)
from worker.compute.stage import Described, Stage
from worker.compute.steps import (
    FunctionStep,
    ModelStep,
    PipelinePlan,
    Step,
    Tensors,
    call_each,
    fed,
    read_only,
    request_tensors,
    unpinned,
)
from worker.compute.triage import ServiceTimeHook, micros
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.errors import RecordError
from worker.flow.messages import Answer, Batch, Completed, Job, TopicPartition
from worker.flow.room import Room
from worker.model.inputs.binding import Binding
from worker.model.io import EngineInfo
from worker.obs import metrics

log = structlog.get_logger(__name__)


@dataclass
class _Progress:
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


class PipelineStage(Stage):
    """Batches of a pipeline's requests in, their answers out (one per request, the
    pipeline's ``outputs``), in dispatch order like any stage's."""

    def __init__(
        self,
        batches_in: asyncio.Queue[Batch[Job] | None],
        completed_out: asyncio.Queue[asyncio.Future[Completed] | None],
        info: EngineInfo,
        binding: Binding,
        plan: PipelinePlan,
        *,
        max_inflight: int,
        on_service_time: ServiceTimeHook | None = None,
        room: Room | None = None,
    ) -> None:
        """``info``: the pipeline as results name it; ``binding``: what a request
        is checked against at intake (its declared tensors', or its first step's
        model's); ``plan``: its steps and answer, built and checked once."""
        super().__init__(
            batches_in, completed_out, info, binding,
            max_attempts=1, on_service_time=on_service_time, room=room,
        )  # fmt: skip
        self._pipeline = info.name
        self._plan = plan
        self._first_takes_request = plan.first_takes_request
        self._steps = plan.steps
        self._regional = plan.regional
        self._threads = max_inflight
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="step")
        # Decided once: the steps that run on the GPU handing each other device
        # arrays, and what each step (and the answer) reads on the host.
        self._on_device = device_steps(plan)
        self._home = Home.of(plan, self._on_device)
        self._reads = host_reads(plan, self._on_device)
        self._answer_reads = answer_reads(plan)
        self._together = together(self._steps, self._on_device)
        self._plain = [plain_step(s, self._regional) for s in self._steps]
        self._step_seconds = {
            s.name: metrics.PIPELINE_STEP_SECONDS.labels(info.name, s.name) for s in self._steps
        }
        self._step_failures = {
            s.name: metrics.PIPELINE_STEP_FAILURES.labels(info.name, s.name) for s in self._steps
        }

    async def dispatch(self, batch: Batch[Job]) -> asyncio.Future[Completed]:
        return asyncio.ensure_future(self.run_batch(batch))

    async def run_batch(self, batch: Batch[Job]) -> Completed:
        started = time.monotonic()
        jobs = list(batch.items)
        # Per request: its own tensors, and its units (itself, or one per region).
        bases: list[Tensors] = [{} if self._first_takes_request else request_tensors(job)
                                for job in jobs]  # fmt: skip
        p = _Progress(batch, jobs, bases, [[base] for base in bases],
                      [self._pinned_elsewhere(job) for job in jobs], [{} for _ in jobs],
                      Partial(len(jobs)),
                      deadlines=any(job.deadline is not None for job in jobs),
                      device=OnDevice(self._home) if self._home is not None else None)  # fmt: skip
        loop = asyncio.get_running_loop()
        index = 0
        as_jobs: dict[int, list[bool]] | None = None  # a columnar step's rows, to run as jobs
        while index < len(self._steps):
            if as_jobs is not None:
                await self._run_step(p, index, as_jobs)
                index, as_jobs = index + 1, None
            elif self._together[index]:  # with the steps after it, on one thread
                index, as_jobs = await loop.run_in_executor(
                    self._pool, self._run_together, p, index)  # fmt: skip
            else:
                live = self._live(p, index)
                if live is None:
                    break
                if live and self._on_device[index]:
                    await self._device_step(p, index, live)
                elif live:
                    await self._run_step(p, index, live)
                index += 1
        if p.device is not None:
            p.device.to_host(self._answer_reads, p.columns)
        for i, job in enumerate(jobs):
            if p.answers[i] is None:
                # The first model step's stage times; a columnar step's: queued, then run.
                timing = {"queue": micros(batch.formed_at - job.arrived), "preprocess": 0,
                          "d2h": 0, **p.timings[i], "infer": micros(time.monotonic() - started)}
                p.answers[i] = answered(self._plan, self._pipeline, job, bases[i], p.units[i],
                                       p.partial.ran(i), timing, p.partial.of(i))
        service_s = time.monotonic() - started
        done = tuple(a for a in p.answers if a is not None)
        return Completed(batch.seq, done, p.engine_rows, service_s)

    def _live(self, p: _Progress, index: int) -> dict[int, list[bool]] | None:
        """The requests step ``index`` runs for, each with the units it runs on (a
        branch per region runs for some of its regions; the others pass it by);
        None once every request is answered. A request whose share of its
        deadline for the steps up to it is spent is answered first."""
        step = self._steps[index]
        if p.device is not None:  # what it reads on the host (a branch's value too)
            p.device.to_host(self._reads[index], p.columns)
        if step.until is not None:
            past_share(step.name, step.until, p.jobs, p.answers)
        if not any(a is None for a in p.answers):
            return None
        plain = self._plain[index]
        chosen = {i: p.partial.chosen(i, step, p.units[i], self._regional, plain)
                  for i, a in enumerate(p.answers) if a is None}  # fmt: skip
        return {i: keep for i, keep in chosen.items() if keep is not None}

    async def _run_step(self, p: _Progress, index: int, live: dict[int, list[bool]]) -> None:
        """Step ``index`` on the event loop: a model step as a batch of jobs of
        its model's stage, a function on the stage's threads."""
        step = self._steps[index]
        step_started = time.monotonic()
        if isinstance(step, ModelStep):
            p.engine_rows += await self._model_step(step, index, p, live)
        else:
            await self._function_step(step, p, live)
        self._step_seconds[step.name].observe(time.monotonic() - step_started)

    async def _device_step(self, p: _Progress, index: int, live: dict[int, list[bool]]) -> None:
        """A GPU step (``worker.compute.resident``), its outputs left on the
        device; where its rows cannot run there, its inputs to the host and the
        step as ``_run_step`` runs it."""
        step, dev = self._steps[index], p.device
        assert dev is not None
        started = time.monotonic()
        if isinstance(step, FunctionStep):
            done = await on_a_thread(self._pool, step, p.units, live, dev)
        else:
            if p.deadlines and expired(p.jobs, live, p.answers):
                live = {i: keep for i, keep in live.items() if p.answers[i] is None}
            rows = chosen_rows(p.units, live)
            done = not rows or await run_model(step, rows, dev, p.columns)
            p.engine_rows += len(rows) if done else 0
        if done:
            self._step_seconds[step.name].observe(time.monotonic() - started)
            return
        dev.to_host(step.sources.values(), p.columns)
        await self._run_step(p, index, live)

    def _run_together(self, p: _Progress, index: int) -> tuple[int, dict[int, list[bool]] | None]:
        """Steps ``index`` and after, as long as they run together, on this (a
        stage) thread: functions called in turn, model steps run as columns
        (``worker.compute.columns``): one hand-off for them all, where each step
        cost one or more. Returns the next step, and the rows it must run as
        jobs where it is a model step whose columns could not run (None: as it
        comes)."""
        end = index
        while end < len(self._steps) and self._together[end]:
            end += 1
        for k in range(index, end):
            live = self._live(p, k)
            if live is None:
                return len(self._steps), None
            if not live:
                continue
            step = self._steps[k]
            step_started = time.monotonic()
            if isinstance(step, FunctionStep):
                self._call_function(step, p, live)
            else:
                if p.deadlines and expired(p.jobs, live, p.answers):
                    live = {i: keep for i, keep in live.items() if p.answers[i] is None}
                rows = chosen_rows(p.units, live)
                if rows and not run_columns(step, rows, p.columns):
                    return k, live
                p.engine_rows += len(rows)
            self._step_seconds[step.name].observe(time.monotonic() - step_started)
        return end, None

    async def _function_step(
        self, step: FunctionStep, p: _Progress, live: Mapping[int, list[bool]]
    ) -> None:
        """Run a function on each live request's chosen units, on the stage's
        threads: the batch's requests split among them, one hand-off per thread
        (a hand-off per request cost about 70 us each, more than many functions)."""
        loop = asyncio.get_running_loop()
        if step.vectorized:  # the batch's rows at once, on one thread
            await loop.run_in_executor(self._pool, self._call_function, step, p, live)
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

    def _call_function(self, step: FunctionStep, p: _Progress,
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

    def _kept(self, step: FunctionStep, p: _Progress, live: list[int],
              results: list[list[Tensors] | str]) -> None:  # fmt: skip
        """A function step's results for ``live`` requests: their units after it,
        or their answers where it failed them."""
        for i, got in zip(live, results, strict=True):
            if isinstance(got, str):
                p.answers[i] = self._failed(p.jobs[i], i, step, got, p.units[i], p.partial)
            else:
                p.units[i] = got

    async def _model_step(
        self, step: ModelStep, index: int, p: _Progress, live: Mapping[int, list[bool]]
    ) -> int:
        """Run every live request's chosen units through ``step``'s model, as one
        batch of it."""
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

    def described_outputs(self) -> Mapping[str, Described]:
        return self._plan.described

    def forget(self, revoked: set[TopicPartition]) -> None:
        for step in self._steps:
            if isinstance(step, ModelStep):
                step.stage.forget(revoked)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for step in self._steps:
            if isinstance(step, ModelStep):
                step.stage.close()
