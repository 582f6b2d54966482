"""Worker: the lifecycle of one process's pipeline: load the engine, build the
stages (``stages``) per the run plan decided once (``plan``), run them as
tasks, drain and stop.

A stage task that dies fails the whole worker (it stops fetching, commits only
what was acknowledged and exits non-zero): a dead engine must stop commits,
never hang silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any, cast

import structlog
from aiokafka.errors import KafkaError

from worker import __version__
from worker.app import cards
from worker.app.arrivals import grows
from worker.app.control import Control, controls, converged
from worker.app.demand import Residency
from worker.app.inference import bound
from worker.app.loading import LoadedModel, close_models, load_models
from worker.app.plan import RunPlan
from worker.app.reload import watch_model
from worker.app.stages import ModelStages, Stages, build_stages, crash_guard
from worker.app.states import wire_states
from worker.compute.cpu import CpuStage
from worker.compute.engines import Engine, GpuEngine
from worker.config import Settings
from worker.config.models import as_served
from worker.config.topics import needed_topics
from worker.flow.deadline import Deadline
from worker.flow.errors import BrokerUnavailable
from worker.flow.messages import TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.clients import close_within, group_consumer_kwargs, producer_kwargs
from worker.kafka.crashguard import CrashGuard
from worker.kafka.diagnose import explain, unreachable
from worker.kafka.monitors import report_partitions, watch_broker
from worker.kafka.permissions import check_topics
from worker.kafka.topiccheck import require_needed
from worker.model.inputs import Binding
from worker.obs import metrics, repository, served
from worker.obs.tracing import OtelTracer, Tracer

log = structlog.get_logger(__name__)


class Worker:
    def __init__(self, settings: Settings, engine: Engine | GpuEngine | None = None) -> None:
        """``engine``: the one model's, loaded by the caller (tests, benchmarks)."""
        self._configured = settings  # every model's (the control topic may bring more)
        settings = as_served(settings)  # one model, whichever section: its settings alone
        self.settings = settings
        self.plan = RunPlan.of(settings)
        self._engine = engine
        self._models: list[LoadedModel] = []  # every model, loaded in prepare()
        self.tracker = OffsetTracker()
        self._stages: Stages | None = None
        # The versions the control topic swapped in before the first record (its log line).
        self._serving: dict[str, str] = {}
        # Models loaded by demand or unloaded, and the control topic's side (prepare()).
        self._residency: Residency | None = None
        self._control: Control | None = None
        self._pipeline: list[asyncio.Task[None]] = []  # consume .. produce, in flow order
        self._support: list[asyncio.Task[None]] = []  # commit loop, broker probe
        self._failure: BaseException | None = None
        self._stopped = asyncio.Event()
        self._started = False
        self._guard: CrashGuard | None = None
        # Span ids for answers carrying a trace context; with tracing.enabled, an
        # OpenTelemetry tracer that also exports a span per request (exit 2 here
        # if its SDK is missing, before anything starts).
        self._tracer = (
            OtelTracer(
                settings.tracing.service_name,
                settings.tracing.endpoint,
                settings.tracing.sample_ratio,
            )
            if settings.tracing.enabled
            else Tracer()
        )

    # --- lifecycle -------------------------------------------------------------------

    async def prepare(self) -> Stages:
        """Every check ``run`` makes before Kafka is contacted, and what it builds
        on the way: client arguments, the models loaded, bound and probed, the
        memory budget, the pipelines checked, the stages built. ``infer-worker
        config`` runs it too, so both refuse the same mistakes (exit 2)."""
        if self._stages is not None:
            return self._stages
        s = self.settings
        # Client arguments (pass-through options, the OAuth token provider) are
        # checked before the engine loads or Kafka is contacted: a typo is exit 2.
        group_consumer_kwargs(s.kafka)
        producer_kwargs(s.kafka)
        if s.gpu.decode != "host":
            from worker.compute.gpu import nvjpeg

            nvjpeg.check_available(s.gpu.decode, s.model.preprocess)
        try:
            self._models = await load_models(s, self._engine, self._bind)
            self._engine = None  # closed with the models
            if len(self._models) == 1 and not s.pipelines:  # its batch size, derived
                self.settings = s = self._models[0].settings
                self.plan = RunPlan.of(s)
            else:  # a partition's head window: the largest model's batches
                window = max(RunPlan.of(m.settings).crash_guard_window for m in self._models)
                self.plan = dataclasses.replace(
                    self.plan, crash_guard_window=max(self.plan.crash_guard_window, window)
                )
            grown = self._configured if grows(self._configured) else None
            self._stages = stages = await build_stages(
                s, self.plan, self._models, self.tracker, self._tracer, self._on_revoke, grown
            )
            self._control, self._residency = controls(
                s, self._configured, self._models, stages, self.plan.device_name)  # fmt: skip
        except BaseException:
            await self._close()
            raise
        return self._stages

    async def _bind(self, key: str, s: Settings, engine: Engine | GpuEngine) -> Binding:
        return await bound(key, s, self.plan, engine)  # a model loaded by demand, at start

    async def start(self) -> None:
        stages = await self.prepare()
        s = self.settings
        try:
            await stages.writer.start()
            existing = await stages.writer.existing_topics()
            if s.kafka.security_protocol != "PLAINTEXT":
                # Before the existence check: a topic this principal may not even
                # Describe looks absent, and the missing ACL is the better answer.
                assert stages.writer.producer is not None
                await check_topics(stages.writer.producer.client, s.kafka, needed_topics(s))
            require_needed(s, existing)
            self._guard = crash_guard(s, self.plan, stages, existing)
            await wire_states(s, self.plan, stages, existing, self.tracker)
            # Each model's card and build info first: a version the control topic
            # swaps in publishes its own over them.
            for model in self._models:
                info = model.engine.info
                metrics.BUILD_INFO.labels(version=__version__, model=info.name,
                                          backend=info.backend, device=self.plan.device_name,
                                          model_version=info.version).set(1)  # fmt: skip
            cards.publish(*(model.engine.info for model in self._models))
            control = await self._converge(s, stages)
            await stages.consumer.start()
        except KafkaError as exc:  # translated once, at the boundary
            await self._close()
            # A refused password, certificate or ACL is a configuration error: exit 2.
            problem = await explain(exc, s.kafka)
            if problem is not None:
                raise problem from exc
            raise BrokerUnavailable(unreachable(exc, s.kafka)) from exc
        except BaseException:
            await self._close()
            raise
        self._started = True
        log.info(
            "worker_started",
            group=s.kafka.group_id,
            # Each model and pipeline with the input topics it answers as their owner.
            models={m.name: {"engine": m.engine.info.backend,
                             "version": self._serving.get(m.name, m.engine.info.version),
                             "topics": stages.topics_of(m.name)} for m in self._models},
            **({"pipelines": {name: stages.topics_of(name) for name in s.pipelines}}
               if s.pipelines else {}),
            **({"shared_topics": sorted(stages.routing.shared)} if stages.routing.shared
               else {}),
        )  # fmt: skip
        metrics.set_condition("started", True)
        for m in stages.models:  # a pipeline's card: its request, its outputs
            if (described := m.infer.described_outputs()) is not None:
                cards.publish_pipeline(m.infer.info, described)
        self._pipeline = [self._spawn(stages.consumer.run(), "consume")]
        for m in stages.models:  # each model's batches its own (worker.config.models)
            self._pipeline += self._model_tasks(m, "" if len(stages.models) == 1 else m.name)
        if stages.merge is not None:
            self._pipeline.append(self._spawn(stages.merge, "merge"))
        self._pipeline.append(self._spawn(stages.writer.run(), "produce"))  # last: the end
        if self._control is not None and self._control.arrivals is not None:
            self._control.arrivals.run = self._run_brought
        self._support = [
            *control,
            self._spawn(stages.committer.run(), "commit"),
            self._spawn(watch_broker(stages.consumer, self.plan.probe_timeout_s), "probe"),
            self._spawn(
                report_partitions(
                    stages.consumer,
                    self.tracker.committed,
                    stages.committer.last_commit,
                    stages.routing,
                    stages.shares,
                    s.metrics.lag_interval_ms / 1000.0,
                    observe=self._residency.observe if self._residency is not None else None,
                ),
                "partitions",
            ),
        ]
        stage_of = {m.name: m.infer for m in stages.models}
        for model in self._models:  # CPU models: the plan refuses reloading a GPU model
            if model.settings.model.reload_interval_s > 0 and model.name in stage_of:
                info = model.engine.info
                labels = {"version": __version__, "model": info.name, "backend": info.backend,
                          "device": self.plan.device_name}  # fmt: skip
                stage = cast(CpuStage, stage_of[model.name])
                watch = watch_model(model.settings, stage, info.version, labels)
                self._support.append(self._spawn(watch, f"model-reload-{model.name}"))
        if self.plan.device == "gpu" and self.plan.device_name != "gpu-twin":
            from worker.compute.gpu.monitor import watch_gpu

            self._support.append(self._spawn(watch_gpu(s.gpu.device), "gpu-monitor"))

    async def _converge(self, s: Settings, stages: Stages) -> list[asyncio.Task[None]]:
        """With ``kafka.control_topic``: each repository model at the version the
        topic sets (``worker.app.control``), before the first record is read, and
        the task that follows the topic from then on."""
        control = self._control
        if control is None:
            return []
        task = self._spawn(control.run(), "model-control")
        try:
            await converged(control, task, max(60.0, s.kafka.request_timeout_s))
        except BaseException:
            task.cancel()
            raise
        repository.register(control)  # the OIP repository extension on the metrics port
        self._serving = control.serving()
        return [task]

    def _model_tasks(self, m: ModelStages, name: str) -> list[asyncio.Task[None]]:
        suffix = f"-{name}" if name else ""
        return [self._spawn(m.batcher.run(), f"batch{suffix}"),
                self._spawn(m.infer.run(), f"infer{suffix}")]  # fmt: skip

    def _run_brought(self, m: ModelStages) -> None:
        """A model the control topic brought while serving, run (the writer stays last)."""
        self._pipeline[-1:-1] = self._model_tasks(m, m.name)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)  # the name is for logs only
        task.add_done_callback(self._on_task_done)
        return task

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._failure is None:
            self._failure = exc
            log.error("stage_failed", stage=task.get_name(), error=repr(exc))
            metrics.set_condition("started", False)
            if self._stages is not None:
                self._stages.consumer.stop_fetching()
            self._stopped.set()
        elif self._pipeline and task is self._pipeline[-1]:
            self._stopped.set()  # the writer ended: the stream drained to its end

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    async def wait(self) -> None:
        """Until a stage fails or the stream has drained after ``stop()`` began."""
        await self._stopped.wait()

    def abandon(self) -> None:
        """Give up draining (a second SIGTERM): cancel the pipeline's stages. What
        was not acknowledged stays uncommitted and is redelivered to the group;
        ``stop()`` still commits what was."""
        for task in self._pipeline:
            task.cancel()

    async def stop(self, drain_timeout: float | None = None) -> bool:
        """Stop fetching, drain in-flight work, commit what was acknowledged, leave
        the group. Returns True when everything drained within the deadline."""
        stages = self._stages
        if not self._started or stages is None:
            await self._close()
            return True
        self._started = False
        timeout = (
            self.settings.shutdown.drain_timeout_ms / 1000.0
            if drain_timeout is None
            else drain_timeout
        )
        metrics.set_condition("started", False)
        stages.consumer.stop_fetching()
        if self._pipeline[-1].done():
            # The writer died (failure budget, engine dead, delivery failed):
            # nothing still upstream can be acknowledged, and the stages feeding it
            # block on its full queue, so waiting for them would only delay the exit
            # by the whole drain timeout.
            timeout = 0.0
        # The drain's budget; a step that must still be tried (a commit, closing
        # sockets) gets at least a floor of it, however late.
        deadline = Deadline(timeout)
        _, pending = await asyncio.wait(self._pipeline, timeout=timeout)
        drained = not pending and self._failure is None
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # The commit loop may be waiting on a commit to an unreachable broker (a
        # whole request timeout): cancel it; a commit either landed or did not.
        stages.committer.stop()
        for task in self._support:  # the commit loop, the broker probe, the reporter
            task.cancel()
        await asyncio.gather(*self._pipeline, *self._support, return_exceptions=True)
        if self._residency is not None:
            await self._residency.close(deadline.left(0.5))  # its prefetches
        # Only acknowledged offsets are below the watermark, so this final commit
        # is safe even when draining failed or timed out; bounded by the deadline.
        await stages.committer.commit_now(timeout=deadline.left(0.5))
        if self._guard is not None:
            last = stages.committer.last_offsets
            heads = {tp: last.get(tp) for tp in self._guard.claimed}
            await self._guard.release(heads, timeout=deadline.left(0.5))
        abandoned = 0 if drained else self.tracker.in_flight()
        if abandoned:
            # Read but not acknowledged: uncommitted, so the group reads them again.
            log.warning("records_abandoned", records=abandoned, redelivered_to="the group")
        await self._close(limit=deadline.left(1.0))
        log.info(
            "worker_stopped",
            drained=drained,
            drain_seconds=round(deadline.elapsed(), 3),
            uncommitted=self.tracker.in_flight(),
            abandoned=abandoned,
        )
        return drained

    async def _close(self, limit: float = 30.0) -> None:
        """Close whatever was opened (idempotent; a half-started worker too), each
        client within ``limit`` seconds: with the broker gone, leaving the group
        and flushing the producer can otherwise wait for a request timeout."""
        stages = self._stages
        if stages is not None:
            for name, closer in (
                ("consumer", stages.consumer.close),
                ("producer", stages.writer.close),
            ):
                await close_within(name, closer, limit)
            for m in stages.models:
                await asyncio.to_thread(m.infer.close)
            if stages.merge is not None:
                stages.merge.close()  # never started where start() failed
            self._stages = None
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        models, self._models = self._models, []
        close_models(models)
        self._tracer.close()  # exports the spans still buffered
        served.withdraw_all()
        repository.register(None)

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- rebalance -------------------------------------------------------------------

    async def _on_revoke(self, revoked: set[TopicPartition]) -> None:
        """Settle revoked partitions: bounded wait for their in-flight work, commit."""
        if self._stages is None:
            return
        # One budget for the whole hand-over: settling, commit, and the crash
        # guard's release each spend what the steps before them left.
        budget = Deadline(self.plan.revoke_timeout_s)
        fenced = await self._stages.committer.settle_revoked(
            revoked, budget, lambda: self._failure is not None, fence=self._stages.writer.fence
        )
        # After their in-flight batches settled: the next owner starts their
        # sequences afresh (this version keeps states in memory only).
        for m in self._stages.models:
            m.infer.forget(revoked)
        if self._guard is not None:  # a clean hand-over: not a crash
            committer = self._stages.committer
            heads = {tp: committer.last_offsets.get(tp) for tp in revoked}
            await self._guard.release(heads, timeout=budget.left(floor=0.5))
        log.info("partitions_revoked", partitions=len(revoked), fenced=fenced)

