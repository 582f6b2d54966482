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
once a batch (``worker.compute.steps``); this module decides which step runs
where and for whom, ``worker.compute.step_runner`` runs one as a function call
or as a batch of its model's jobs; a built-in op on the GPU runs a batch
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

from worker.compute.answers import answered
from worker.compute.branches import Partial, plain_step
from worker.compute.columns import chosen_rows, expired, past_share, run_columns
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
from worker.compute.step_runner import Progress, StepRunner
from worker.compute.steps import FunctionStep, ModelStep, PipelinePlan, Tensors, request_tensors
from worker.compute.triage import ServiceTimeHook, micros
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.messages import Answer, Batch, Completed, Job, TopicPartition
from worker.flow.room import Room
from worker.model.inputs.binding import Binding
from worker.model.io import EngineInfo
from worker.obs import metrics


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
        self._runner = StepRunner(info.name, plan.steps, pool=self._pool, threads=max_inflight,
                                  first_takes_request=plan.first_takes_request)  # fmt: skip

    async def dispatch(self, batch: Batch[Job]) -> asyncio.Future[Completed]:
        return asyncio.ensure_future(self.run_batch(batch))

    async def run_batch(self, batch: Batch[Job]) -> Completed:
        started = time.monotonic()
        jobs = list(batch.items)
        # Per request: its own tensors, and its units (itself, or one per region).
        bases: list[Tensors] = [{} if self._first_takes_request else request_tensors(job)
                                for job in jobs]  # fmt: skip
        p = Progress(batch, jobs, bases, [[base] for base in bases],
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

    def _live(self, p: Progress, index: int) -> dict[int, list[bool]] | None:
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

    async def _run_step(self, p: Progress, index: int, live: dict[int, list[bool]]) -> None:
        """Step ``index`` on the event loop: a model step as a batch of jobs of
        its model's stage, a function on the stage's threads."""
        step = self._steps[index]
        step_started = time.monotonic()
        if isinstance(step, ModelStep):
            p.engine_rows += await self._runner.model_step(step, index, p, live)
        else:
            await self._runner.function_step(step, p, live)
        self._step_seconds[step.name].observe(time.monotonic() - step_started)

    async def _device_step(self, p: Progress, index: int, live: dict[int, list[bool]]) -> None:
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

    def _run_together(self, p: Progress, index: int) -> tuple[int, dict[int, list[bool]] | None]:
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
                self._runner.call_function(step, p, live)
            else:
                if p.deadlines and expired(p.jobs, live, p.answers):
                    live = {i: keep for i, keep in live.items() if p.answers[i] is None}
                rows = chosen_rows(p.units, live)
                if rows and not run_columns(step, rows, p.columns):
                    return k, live
                p.engine_rows += len(rows)
            self._step_seconds[step.name].observe(time.monotonic() - step_started)
        return end, None

    def _pinned_elsewhere(self, job: Job) -> Answer | None:
        """A request pinning a version of the pipeline other than this one is
        answered ``unknown_model`` (its steps' models have versions of their own)."""
        ref = job.request.model if job.request is not None else None
        if ref is None or ref.version is None or ref.version == self.info.version:
            return None
        return Answer(job, None, ErrorInfo(ErrorCode.UNKNOWN_MODEL, (
            f"model.version: {ref.version[:64]!r} is not served; {self._pipeline!r} serves "
            f"version {self.info.version!r}")))  # fmt: skip

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
