"""The pipeline's stages, built once from the settings, the run plan and the
loaded engine, and linked by bounded queues:

    consumer -> [jobs] -> batcher -> [batches] -> inference stage
        -> [futures, dispatch order] -> writer -> offset tracker -> committer

Each stage gets its input queue and downstream handle in its constructor; end of
stream (``None``) flows down the same queues, so shutdown drains stage by stage.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import structlog

from worker.app.lanes import backpressure, batch_policy
from worker.app.pipelines import StepModel, build_steps, pipeline_info
from worker.app.plan import RunPlan
from worker.app.probe import check_declarations
from worker.compute.cpu import CpuStage
from worker.compute.engines import Engine, GpuEngine
from worker.compute.pipeline import PipelineStage
from worker.compute.stage import Stage
from worker.config import PipelineConfig, Settings
from worker.config.models import settings_named
from worker.flow.batching import MicroBatcher, Policy
from worker.flow.budget import FailureBudget
from worker.flow.messages import Batch, Completed, Job
from worker.flow.offsets import OffsetTracker
from worker.flow.room import Room
from worker.flow.streams import merge_done
from worker.flow.values import ModelInfo
from worker.kafka.clients import client_kwargs
from worker.kafka.commit import Committer
from worker.kafka.consumer import Consumer
from worker.kafka.crashguard import CrashGuard
from worker.kafka.delivery.at_least_once import AtLeastOnceWriter
from worker.kafka.delivery.exactly_once import ExactlyOnceWriter
from worker.kafka.delivery.writer import ResultWriter, WriterParts
from worker.kafka.guarded import Protection
from worker.kafka.intake import JobFactory, Route
from worker.kafka.lease import GroupLease
from worker.kafka.listener import RevokeHook
from worker.model.inputs import Binding, bind_model
from worker.model.inputs.binding import fit_limits, summary
from worker.obs.tracing import Tracer

log = structlog.get_logger(__name__)

StageBuilder = Callable[
    [asyncio.Queue[Batch[Job] | None], asyncio.Queue[asyncio.Future[Completed] | None],
     Policy[Job], Binding, Room],
    Awaitable[Stage],
]  # fmt: skip


@dataclass
class Stages:
    """Everything the worker builds, kept together so closing never guesses."""

    consumer: Consumer
    batcher: MicroBatcher[Job]
    infer: Stage
    writer: ResultWriter
    committer: Committer
    # The worker's other models ([models.NAME]), each with a batcher and a stage of
    # its own, and the task that hands all their completed batches to the writer.
    others: list[ModelStages] = field(default_factory=list)
    merge: Coroutine[Any, Any, None] | None = None


@dataclass
class ModelStages:
    """One more model's own stages: its batches never mix with another model's."""

    name: str
    engine: Engine | GpuEngine
    batcher: MicroBatcher[Job]
    infer: Stage
    completed: asyncio.Queue[asyncio.Future[Completed] | None]


@dataclass(frozen=True)
class OtherModel:
    """A model of the worker besides [model]: the settings it runs with (as if alone),
    its loaded engine and the input topics it answers."""

    settings: Settings
    engine: Engine
    topics: tuple[str, ...]


async def build_stages(
    s: Settings,
    plan: RunPlan,
    engine: Engine | GpuEngine,
    tracker: OffsetTracker,
    tracer: Tracer,
    on_revoke: RevokeHook,
    others: Sequence[OtherModel] = (),
) -> Stages:
    """The stages, wired; each model's binding decided once (exit 2 on a mismatch,
    before Kafka is contacted), shared by its intake and its inference stage."""
    b = s.batching
    main, main_route = await _model_stages("model", s, plan, engine, tracker, 0)
    more: list[tuple[ModelStages, Route, tuple[str, ...]]] = []
    for rank, m in enumerate(others, 1):
        if not m.topics:  # run only by a pipeline (its own stage there)
            continue
        key = f"models.{m.settings.model.name}"
        built = await _model_stages(key, m.settings, plan, m.engine, tracker, rank)
        more.append((*built, m.topics))
    alone = dataclasses.replace(s, models={}, pipelines={})  # [model] as if served alone
    models = {s.model.name: (alone, engine), **{o.settings.model.name: (o.settings, o.engine)
                                                for o in others}}  # fmt: skip
    flows = [pipeline_settings(name, p, models) for name, p in s.pipelines.items()]
    for rank, (name, p) in enumerate(s.pipelines.items(), len(others) + 1):
        built = await _pipeline_stages(name, p, plan, models, tracker, rank)
        more.append((*built, p.topics))
    if more:
        names = [main.name, *(m.name for (m, _, _) in more)]
        # A request on [model]'s topics may name any model; on another's, only that one.
        main_route.make_job.route(names, {m.name: r.make_job for (m, r, _) in more})
        for _, route, _ in more:
            route.make_job.route(names)
    consumer = Consumer(
        s.kafka,
        main_route.make_job,
        main_route.jobs,
        tracker,
        on_revoke,
        backpressure(s, [*(m.settings for m in others), *flows]),
        routes={t: route for (_, route, topics) in more for t in topics},
    )
    committer = Committer(
        tracker,
        consumer,
        timeout=plan.request_timeout_s,
        transactional=plan.exactly_once,
        interval=s.kafka.commit_interval_ms / 1000.0,
    )
    consumer.wake_on(committer.progress)
    model = ModelInfo(name=engine.info.name, version=engine.info.version)
    budget = FailureBudget(s.dlq.max_consecutive, s.dlq.max_ratio, s.dlq.window)
    completed, merge = main.completed, None
    if more:  # each model's completed batches in its own order, none waiting on another's
        sources = [completed, *(m.completed for (m, _, _) in more)]
        completed = asyncio.Queue(b.max_inflight_batches)
        merge = merge_done(sources, completed)
    routed = {m.name: ModelInfo(m.name, m.infer.info.version) for (m, _, _) in more}
    parts = WriterParts(completed, s.kafka, model, tracker, committer, budget, tracer, routed)
    writer: ResultWriter
    if plan.exactly_once:
        lease = GroupLease(
            lambda: consumer.client, s.kafka.session_timeout_ms, plan.request_timeout_s
        )
        writer = ExactlyOnceWriter(parts, lease, max_batches=plan.transaction_batches)
    else:
        writer = AtLeastOnceWriter(parts, max_pending_acks=plan.max_pending_acks)
    return Stages(
        consumer, main.batcher, main.infer, writer, committer, [m for (m, _, _) in more], merge
    )


async def _bound(s: Settings, plan: RunPlan, engine: Engine | GpuEngine) -> Binding:
    """The model's binding, probed on the CPU path (the GPU stage's engines run
    per slot, after start-up)."""
    binding = bind_model(s.model, engine.info.io, s.limits, s.batching)
    if plan.device == "cpu":
        await asyncio.to_thread(check_declarations, engine, binding.io, binding.outputs)
    log.info("model_inputs", model=s.model.name, inputs=summary(binding.inputs),
             outputs=list(engine.info.output_names))  # fmt: skip
    return binding


def _intake(s: Settings, binding: Binding) -> JobFactory:
    limits = fit_limits(s.limits, binding.inputs)
    return JobFactory(
        binding.inputs, limits, s.batching.max_record_age_ms, s.kafka.content_type, s.model.name
    )


async def _model_stages(
    key: str,
    s: Settings,
    plan: RunPlan,
    engine: Engine | GpuEngine,
    tracker: OffsetTracker,
    rank: int,
    build: StageBuilder | None = None,
) -> tuple[ModelStages, Route]:
    """One model's stages (``key``: where it is configured; ``rank``: its place
    in the backpressure): its own jobs queue, batching and threads or slots, fed
    by its topics' route; ``build``: its stage, where it is not the model's own
    (a pipeline's)."""
    b = s.batching
    with settings_named(key):  # a [models.NAME]'s errors name its keys as written
        binding = await _bound(s, plan, engine)
    jobs: asyncio.Queue[Job | None] = asyncio.Queue(b.queue_capacity)
    batches: asyncio.Queue[Batch[Job] | None] = asyncio.Queue(1)
    completed: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue(
        b.max_inflight_batches
    )
    policy = batch_policy(s)  # one FIFO, or the priority lanes ([[kafka.lanes]])
    # A batch is cut when a thread or slot can start it (worker.flow.room).
    room = Room(plan.inflight)
    if build is None:
        infer = await _inference_stage(
            s, plan, batches, completed, engine, policy, binding, tracker, room
        )
    else:
        infer = await build(batches, completed, policy, binding, room)
    batcher = MicroBatcher(jobs, batches, policy, room=room)
    stages = ModelStages(s.model.name, engine, batcher, infer, completed)
    return stages, Route(_intake(s, binding), jobs, rank)


def pipeline_settings(
    name: str, p: PipelineConfig, models: Mapping[str, tuple[Settings, Engine | GpuEngine]]
) -> Settings:
    """The settings a pipeline's intake and batching run with: its first model's,
    named as the pipeline (results and metrics name it)."""
    first = models[p.steps[0].model][0]
    return dataclasses.replace(first, model=dataclasses.replace(first.model, name=name))


async def _pipeline_stages(
    name: str,
    p: PipelineConfig,
    plan: RunPlan,
    models: Mapping[str, tuple[Settings, Engine | GpuEngine]],
    tracker: OffsetTracker,
    rank: int,
) -> tuple[ModelStages, Route]:
    """A pipeline's stages: its intake (the first model's checks), its batcher, and
    a stage that runs each batch through the steps, each model step on a stage of
    its own over the model's engine (``worker.compute.pipeline``)."""
    s = pipeline_settings(name, p, models)
    first = models[p.steps[0].model]
    steps: dict[str, StepModel] = {}
    for model in {step.model for step in p.steps if step.model}:
        ms, engine = models[model]
        key = "model" if model == next(iter(models)) else f"models.{model}"  # [model] first
        with settings_named(key):
            bound = await _bound(ms, plan, engine)
        step_stage = CpuStage(
            asyncio.Queue(), asyncio.Queue(), engine, bound,
            max_batch_size=ms.batching.max_batch_size, max_inflight=plan.inflight,
            max_attempts=ms.batching.max_attempts,
            owns=lambda job: tracker.owns(job.tp, job.offset, job.epoch),
        )  # fmt: skip
        steps[model] = StepModel(engine.info, bound, step_stage)
    built = build_steps(name, p, steps)
    info = pipeline_info(name, first[1].info, p, {m: sm.info for m, sm in steps.items()})

    async def stage(
        batches: asyncio.Queue[Batch[Job] | None],
        completed: asyncio.Queue[asyncio.Future[Completed] | None],
        policy: Policy[Job], binding: Binding, room: Room,
    ) -> Stage:  # fmt: skip
        return PipelineStage(batches, completed, info, binding, built.steps, p.outputs,
                             max_inflight=plan.inflight, regional=built.regional,
                             described=built.outputs,
                             on_service_time=policy.observe_service_time, room=room)  # fmt: skip

    return await _model_stages(f"pipelines.{name}", s, plan, first[1], tracker, rank, stage)


async def _inference_stage(
    s: Settings,
    plan: RunPlan,
    batches: asyncio.Queue[Batch[Job] | None],
    completed: asyncio.Queue[asyncio.Future[Completed] | None],
    engine: Engine | GpuEngine,
    policy: Policy[Job],
    binding: Binding,
    tracker: OffsetTracker,
    room: Room,
) -> Stage:
    """The CPU stage, or the GPU stage with its slot ring (allocated once, off the
    event loop: kernel compilation and engine contexts take a while)."""
    b = s.batching
    if plan.device == "cpu":
        return CpuStage(
            batches, completed, engine, binding,
            max_batch_size=b.max_batch_size, max_inflight=plan.inflight,
            max_attempts=b.max_attempts, on_service_time=policy.observe_service_time,
            owns=lambda job: tracker.owns(job.tp, job.offset, job.epoch), room=room,
        )  # fmt: skip
    from worker.compute.gpu.budget import DeviceShare
    from worker.compute.gpu.stage import GpuStage

    def build() -> GpuStage:
        # The process's share of the device's memory, capped before the slots and
        # the warm-up allocate, and checked after them (run --procs N on one GPU).
        share = DeviceShare(s.gpu.device, plan.gpu_memory_fraction, s.model.backend == "torch")
        stage = GpuStage(
            batches, completed, cast(GpuEngine, engine), binding,
            max_batch_size=b.max_batch_size, num_slots=plan.inflight, gpu=s.gpu,
            preferred_batch_sizes=b.preferred_batch_sizes, max_attempts=b.max_attempts,
            on_service_time=policy.observe_service_time, room=room, budget=share.budget,
        )  # fmt: skip
        try:
            share.check_used()
        except BaseException:
            stage.close()
            raise
        return stage

    return await asyncio.to_thread(build)


def crash_guard(
    s: Settings, plan: RunPlan, stages: Stages, existing: set[str]
) -> CrashGuard | None:
    """Crash-loop protection when configured and its topic exists; never for a
    shadow (``kafka.shadow``), whose marks would share the production group's
    topic and whose quarantined records would go to a DLQ it does not write."""
    if s.limits.max_crash_attempts == 0:
        return None
    if s.kafka.shadow:
        log.info(
            "crash_loop_protection_off",
            reason="kafka.shadow: a shadow writes and reads no crash-guard marks",
        )
        return None
    if s.kafka.crash_guard_topic not in existing:
        log.warning(
            "crash_loop_protection_off",
            reason=f"topic {s.kafka.crash_guard_topic} does not exist",
            fix="create it (compacted, 1 partition), or set limits.max_crash_attempts = 0",
        )
        return None
    guard = CrashGuard(
        client_kwargs(s.kafka), s.kafka.crash_guard_topic, s.kafka.group_id, stages.writer
    )
    stages.consumer.protection = Protection(  # set before the consumer starts
        guard, s.limits.max_crash_attempts, plan.crash_guard_window, stages.committer.settled
    )
    return guard
