"""A pipeline's stage: each batch through the pipeline's steps in turn, one answer
per request (``[pipelines.NAME]``, docs/guides/pipelines.md).

A model step runs the batch's requests as that model's own stage runs a batch
(``CpuStage.run_batch``: rows of one length together, poison isolated by
bisection, deadlines honoured), so the crops of many requests form one batch of
the next model; a function step runs once per request on the stage's threads.
Between steps the tensors stay in memory: a request's tensors so far, by
``STEP.OUTPUT`` and ``request.NAME``, feed the next step's inputs, checked as
the next model checks a request's (``ModelInputs.check``). A request a step
fails is answered ``inference_failed`` naming the step (and the tensor, where
one was not what the step takes); the other requests of the batch go on.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import numpy as np
import structlog

from worker.compute.cpu import CpuStage
from worker.compute.stage import Stage
from worker.compute.triage import ServiceTimeHook, micros
from worker.config.pipelines import REQUEST, Spec
from worker.contract import ErrorInfo, Request, Tensor
from worker.flow.codes import ErrorCode
from worker.flow.errors import ConfigError, RecordError
from worker.flow.messages import Answer, Batch, Completed, Job, StepOutputs, TopicPartition
from worker.flow.room import Room
from worker.model.inputs.binding import Binding
from worker.model.io import EngineInfo
from worker.obs import metrics

log = structlog.get_logger(__name__)

Tensors = dict[str, np.ndarray]  # a request's tensors so far, by "STEP.OUTPUT" / "request.NAME"
Function = Callable[..., object]  # returns a dict of arrays (checked: a user's code)


@dataclass(frozen=True)
class ModelStep:
    name: str
    stage: CpuStage  # the model's own stage for this pipeline (its threads and buffers)
    sources: Mapping[str, str]  # the model's request input -> "STEP.OUTPUT" / "request.NAME"
    # The share of a request's deadline spent once this step may no longer start (the
    # steps' deadline_share summed up to it); None: the request's deadline alone.
    until: float | None = None
    topic: str = ""  # its outputs also written there, per request answered ok


@dataclass(frozen=True)
class FunctionStep:
    name: str
    function: Function
    sources: Mapping[str, str]  # keyword argument -> source
    outputs: Mapping[str, Spec]  # declared: checked against what it returns
    until: float | None = None
    topic: str = ""


Step = ModelStep | FunctionStep


def import_function(path: str, at: str) -> Function:
    """``module:function``, imported (a ConfigError naming ``at`` when it cannot be)."""
    module, _, attr = path.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{at}: {path!r} cannot be imported: {exc}") from exc
    if not callable(found):
        raise ConfigError(f"{at}: {path!r} is not a function")
    return found  # type: ignore[no-any-return]


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
        on_service_time: ServiceTimeHook | None = None,
        room: Room | None = None,
    ) -> None:
        """``info``: the pipeline as results name it; ``binding``: its first
        step's (what a request is checked against at intake); ``outputs``: the
        answer's outputs, each from "STEP.OUTPUT"."""
        super().__init__(
            batches_in, completed_out, info, binding,
            max_attempts=1, on_service_time=on_service_time, room=room,
        )  # fmt: skip
        self._pipeline = info.name
        self._steps = steps
        self._answer = dict(outputs)
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
        tensors: list[Tensors | None] = [None] * len(jobs)  # None: answered already
        answers: list[Answer | None] = [self._pinned_elsewhere(job) for job in jobs]
        timings: list[dict[str, int]] = [{} for _ in jobs]
        engine_rows = 0
        for index, step in enumerate(self._steps):
            if step.until is not None:
                self._past_share(step.name, step.until, jobs, answers)
            live = [i for i, a in enumerate(answers) if a is None]
            if not live:
                break
            step_started = time.monotonic()
            if isinstance(step, ModelStep):
                engine_rows += await self._model_step(
                    step, index, batch, jobs, live, tensors, answers, timings
                )
            else:
                loop = asyncio.get_running_loop()
                for i in live:
                    found = tensors[i]
                    assert found is not None
                    problem = await loop.run_in_executor(self._pool, _call, step, found)
                    if problem is not None:
                        answers[i] = self._failed(jobs[i], step.name, problem)
            self._step_seconds[step.name].observe(time.monotonic() - step_started)
        for i, job in enumerate(jobs):
            if answers[i] is None:
                found = tensors[i]
                assert found is not None
                out = {name: found[source] for name, source in self._answer.items()}
                timing = {**timings[i], "infer": micros(time.monotonic() - started)}
                steps = tuple(self._step_outputs(found))
                answers[i] = Answer(job, out, None, timing, steps=steps)
        service_s = time.monotonic() - started
        done = tuple(a for a in answers if a is not None)
        return Completed(batch.seq, done, engine_rows, service_s)

    async def _model_step(
        self,
        step: ModelStep,
        index: int,
        batch: Batch[Job],
        jobs: list[Job],
        live: list[int],
        tensors: list[Tensors | None],
        answers: list[Answer | None],
        timings: list[dict[str, int]],
    ) -> int:
        """Run the live requests through ``step``'s model, as one batch of it."""
        fed: list[int] = []
        step_jobs: list[Job] = []
        for i in live:
            job = jobs[i]
            if index == 0:  # the request is the first model's, checked at intake
                tensors[i] = {f"{REQUEST}.{k}": v for k, v in job.inputs.items()
                              if isinstance(v, np.ndarray)}  # fmt: skip
                step_job = _unpinned(job)
            else:
                found = tensors[i]
                assert found is not None
                try:
                    step_job = _fed(job, step, found)
                except RecordError as exc:
                    answers[i] = self._failed(job, step.name, str(exc))
                    continue
            fed.append(i)
            step_jobs.append(step_job)
        if not step_jobs:
            return 0
        done = await step.stage.run_batch(Batch(step_jobs, batch.formed_at, batch.reason,
                                                seq=batch.seq))  # fmt: skip
        for i, answer in zip(fed, done.answers, strict=True):
            error = answer.error
            if index == 0 and (answer.job.failure is not None or (
                    error is not None and error.code != ErrorCode.INFERENCE_FAILED)):
                answers[i] = answer  # the request's own fault: answered as the model does
                continue
            if error is not None and error.code == ErrorCode.DEADLINE_EXCEEDED:
                answers[i] = Answer(jobs[i], None, error, answer.timing_us)
                continue
            if error is not None:  # the step failed on it, or it was not what it takes
                answers[i] = self._failed(jobs[i], step.name, error.message)
                continue
            if index == 0:
                timings[i] = dict(answer.timing_us)
            found = tensors[i]
            assert found is not None and answer.outputs is not None
            for name, value in answer.outputs.items():
                found[f"{step.name}.{name}"] = value
        return done.engine_rows

    def _step_outputs(self, found: Tensors) -> list[StepOutputs]:
        """The outputs of the steps that write them to a topic, for one request."""
        out = []
        for step in self._steps:
            if step.topic:
                prefix = f"{step.name}."
                mine = {k.removeprefix(prefix): v for k, v in found.items() if k.startswith(prefix)}
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

    def _pinned_elsewhere(self, job: Job) -> Answer | None:
        """A request pinning a version of the pipeline other than this one is
        answered ``unknown_model`` (its steps' models have versions of their own)."""
        ref = job.request.model if job.request is not None else None
        if ref is None or ref.version is None or ref.version == self.info.version:
            return None
        return Answer(job, None, ErrorInfo(ErrorCode.UNKNOWN_MODEL, (
            f"model.version: {ref.version[:64]!r} is not served; {self._pipeline!r} serves "
            f"version {self.info.version!r}")))  # fmt: skip

    def _failed(self, job: Job, step: str, problem: str) -> Answer:
        self._step_failures[step].inc()
        log.warning("pipeline_step_failed", pipeline=self._pipeline, step=step, error=problem)
        error = ErrorInfo(ErrorCode.INFERENCE_FAILED, f"step {step!r}: {problem}")
        return Answer(job, None, error)

    def forget(self, revoked: set[TopicPartition]) -> None:
        for step in self._steps:
            if isinstance(step, ModelStep):
                step.stage.forget(revoked)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for step in self._steps:
            if isinstance(step, ModelStep):
                step.stage.close()


def _unpinned(job: Job) -> Job:
    """``job`` for a step's model: the version a request pins is the pipeline's."""
    if job.request is None or job.request.model is None:
        return job
    return msgspec.structs.replace(job, request=msgspec.structs.replace(job.request, model=None))


def _fed(job: Job, step: ModelStep, found: Tensors) -> Job:
    """``job`` as the step's model takes it: its inputs from the request's tensors
    so far, checked as that model checks a request."""
    inputs = {name: Tensor.from_numpy(np.ascontiguousarray(found[source]))
              for name, source in step.sources.items()}  # fmt: skip
    request = Request(v=1, id=job.request.id if job.request else "", inputs=inputs)
    checked, lengths = step.stage.binding.inputs.check(request)
    return msgspec.structs.replace(_unpinned(job), inputs=checked, lengths=lengths)


def _call(step: FunctionStep, found: Tensors) -> str | None:
    """Run a function step on one request's tensors, adding its outputs; why it
    failed, if it did (anything it raises, or an output not as declared)."""
    try:
        got = step.function(**{arg: found[source] for arg, source in step.sources.items()})
    except Exception as exc:  # the user's code: any failure is this request's answer
        return f"{type(exc).__name__}: {exc}"
    if not isinstance(got, Mapping):
        return f"returned {type(got).__name__}, not a dict of arrays"
    for name, spec in step.outputs.items():
        value = got.get(name)
        if not isinstance(value, np.ndarray):
            return f"output {name!r}: missing or not a numpy array"
        if value.dtype.name != spec.dtype or value.ndim != len(spec.shape) or any(
            isinstance(d, int) and d != n for d, n in zip(spec.shape, value.shape, strict=True)
        ):
            shape = list(value.shape)
            return (f"output {name!r}: {value.dtype.name} {shape}, declared {spec.dtype} "
                    f"{list(spec.shape)}")  # fmt: skip
        found[f"{step.name}.{name}"] = value
    return None
