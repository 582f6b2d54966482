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
from dataclasses import dataclass
from typing import Any

import structlog

from worker.app.inference import Bindings, GpuShare, inference_stage
from worker.app.lanes import apart_bound, backpressure, batch_policy
from worker.app.loading import LoadedModel
from worker.app.pipelines import (
    StepModel,
    answer_outputs,
    build_plan,
    declared_inputs,
    declared_io,
    pipeline_info,
)
from worker.app.plan import RunPlan
from worker.app.registry import registered
from worker.compute.ops.device import DeviceOps
from worker.compute.pipeline import PipelineStage
from worker.compute.stage import Stage
from worker.config import PipelineConfig, Settings
from worker.config.model import is_gpu_backend
from worker.config.models import Routing, routing
from worker.flow.batching import MicroBatcher, Policy
from worker.flow.budget import FailureBudget
from worker.flow.drain import Shares
from worker.flow.messages import Batch, Completed, Job
from worker.flow.offsets import OffsetTracker
from worker.flow.room import Room
from worker.flow.streams import Merge
from worker.flow.values import ModelInfo
from worker.kafka.clients import client_kwargs
from worker.kafka.commit import Committer
from worker.kafka.consumer import Consumer
from worker.kafka.crashguard import CrashGuard
from worker.kafka.delivery.at_least_once import AtLeastOnceWriter
from worker.kafka.delivery.exactly_once import ExactlyOnceWriter
from worker.kafka.delivery.writer import ResultWriter, WriterParts
from worker.kafka.guarded import Protection
from worker.kafka.intake import JobFactory
from worker.kafka.lease import GroupLease
from worker.kafka.listener import RevokeHook
from worker.model.inputs import Binding
from worker.model.inputs.binding import fit_limits
from worker.obs.tracing import Tracer

log = structlog.get_logger(__name__)

@dataclass
class Stages:
    """Everything the worker builds, kept together so closing never guesses."""

    consumer: Consumer
    # Each model's and pipeline's own stages, in the routing table's order: its
    # batches never mix with another's.
    models: list[ModelStages]
    writer: ResultWriter
    committer: Committer
    # Which model or pipeline answers each request (the intake's, for the logs too).
    routing: Routing
    # Several models: the task handing all their completed batches to the writer.
    merge: Coroutine[Any, Any, None] | None = None
    # The intake's count of each shared topic's records by model (the lag
    # monitor splits the topic's backlog by it).
    shares: Shares = dataclasses.field(default_factory=Shares)
    # What each GPU stage took of the device as it started, by ring (models loaded
    # by demand on the GPU are counted so: ``worker.app.demand``).
    device_memory: dict[str, int] = dataclasses.field(default_factory=dict)
    # Where the control topic may bring models while serving: what they join.
    grow: Growth | None = None

    def topics_of(self, name: str) -> list[str]:
        """The input topics whose requests naming none ``name`` answers."""
        return next((list(m.topics) for m in self.models if m.name == name), [])


@dataclass
class Growth:
    """What a model the control topic brings while serving is built with and
    joined to (``admit``): the builders, the intake, the writer's models and
    the merge of every model's completed batches."""

    plan: RunPlan
    tracker: OffsetTracker
    bindings: Bindings
    device: GpuShare
    intake: JobFactory
    infos: dict[str, ModelInfo]
    merge: Merge[Completed]


@dataclass
class ModelStages:
    """One model's (or pipeline's) own stages: its jobs queue, batcher and
    inference stage, and the queue of its completed batches."""

    name: str
    jobs: asyncio.Queue[Job | None]
    batcher: MicroBatcher[Job]
    infer: Stage
    completed: asyncio.Queue[asyncio.Future[Completed] | None]
    # Its settings as it runs (a pipeline's: its first model's, named as it) and the
    # input topics it answers requests naming none of.
    settings: Settings
    topics: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Answerer:
    """A model's or pipeline's stages and what its intake checks requests with."""

    stages: ModelStages
    settings: Settings
    binding: Binding


async def build_stages(
    s: Settings,
    plan: RunPlan,
    models: Sequence[LoadedModel],
    tracker: OffsetTracker,
    tracer: Tracer,
    on_revoke: RevokeHook,
    grows: Settings | None = None,
) -> Stages:
    """The stages, wired: one set per model and pipeline the routing table
    answers with (``worker.config.models.routing``), each model's binding
    decided once (exit 2 on a mismatch, before Kafka is contacted) and shared by
    the intake and its inference stage. ``grows``: the configuration, where the
    control topic may bring models while serving (``admit``): its routing table,
    and one model's completed batches merged as several models' are."""
    b = s.batching
    several = len(models) > 1 or s.pipelines
    table = (routing(grows) if grows is not None else routing(s) if several
             else Routing.one(models[0].name))  # fmt: skip
    bindings = Bindings(plan)  # each model bound and probed once, whoever runs it
    device = GpuShare(s, plan, models)
    by_name = {m.name: m for m in models}
    built: list[_Answerer] = []
    for name in table.answerers:
        if name in by_name:
            built.append(await _model_stages(by_name[name], plan, tracker, bindings, device))
        else:
            built.append(await _pipeline_stages(name, s.pipelines[name], plan, by_name,
                                                tracker, bindings, device))  # fmt: skip
    device.check_used()  # every GPU stage started: what they hold, against the share
    for a in built:  # the topics each answers requests naming none of
        a.stages.topics = tuple(t for t in s.kafka.input_topics
                                if table.owner(t) == a.stages.name)  # fmt: skip
    # The registry's result schema: every output any answerer gives (Avro requests).
    outputs = {name: desc for a in built for name, desc in
               (a.stages.infer.described_outputs() or answer_outputs(a.binding)).items()}
    registry = await registered(s, outputs)
    first, *others = built
    shares = Shares()
    intake = JobFactory(
        first.binding.inputs, fit_limits(s.limits, first.binding.inputs),
        b.max_record_age_ms, s.kafka.content_type, first.stages.name, routing=table,
        others={a.stages.name: (a.binding.inputs, fit_limits(s.limits, a.binding.inputs))
                for a in others},
        schemas=registry.schemas if registry is not None else None, shares=shares,
    )  # fmt: skip
    place = {a.stages.name: i for i, a in enumerate(built)}
    pausing, ranks = backpressure(s, [a.settings for a in built],
                                  {t: place[table.owner(t)] for t in s.kafka.input_topics})
    consumer = Consumer(
        s.kafka, intake, {a.stages.name: a.stages.jobs for a in built}, tracker, on_revoke,
        pausing, ranks=ranks,
    )  # fmt: skip
    committer = Committer(
        tracker,
        consumer,
        timeout=plan.request_timeout_s,
        transactional=plan.exactly_once,
        interval=s.kafka.commit_interval_ms / 1000.0,
    )
    consumer.wake_on(committer.progress)
    budget = FailureBudget(s.dlq.max_consecutive, s.dlq.max_ratio, s.dlq.window)
    completed, merge = first.stages.completed, None
    if others or grows is not None:  # each model's batches in its own order, none waiting
        completed = asyncio.Queue(b.max_inflight_batches)
        merge = Merge([a.stages.completed for a in built], completed)
    infos = {a.stages.name: ModelInfo(a.stages.name, a.stages.infer.info.version)
             for a in built}  # fmt: skip
    changelogs = {a.stages.name: a.settings.kafka.state_topic for a in built
                  if a.settings.kafka.state_topic}  # fmt: skip
    parts = WriterParts(completed, s.kafka, infos, tracker, committer, budget, tracer,
                        state_topics=changelogs,
                        registered=registry.results if registry is not None else {})  # fmt: skip
    writer: ResultWriter
    if plan.exactly_once:
        lease = GroupLease(
            lambda: consumer.client, s.kafka.session_timeout_ms, plan.request_timeout_s
        )
        writer = ExactlyOnceWriter(parts, lease, max_batches=plan.transaction_batches)
    else:
        writer = AtLeastOnceWriter(parts, max_pending_acks=plan.max_pending_acks)
    grow = (Growth(plan, tracker, bindings, device, intake, infos, merge)
            if grows is not None and merge is not None else None)  # fmt: skip
    return Stages(consumer, [a.stages for a in built], writer, committer, table,
                  merge.run() if merge is not None else None, shares, device.models,
                  grow)  # fmt: skip


async def admit(stages: Stages, m: LoadedModel, grown: Routing) -> ModelStages:
    """A model the control topic brought, its stages built (bound and probed)
    and joined to the running ones: the routing table ``grown`` to answer with
    it, its requests checked at intake, read from its own topics (a rebalance
    where it has some), its completed batches merged for the writer. Its
    batcher and inference stage are the caller's to run, and its topics the
    caller's to read (``Consumer.subscribe_more``)."""
    g = stages.grow
    assert g is not None, "built with grows="
    a = await _model_stages(m, g.plan, g.tracker, g.bindings, g.device)
    a.stages.topics = m.topics
    # No await from here: a record routed to it finds its queue.
    stages.consumer.admit(m.name, a.stages.jobs)
    if m.topics:
        paused_apart(stages, a.stages, m.topics)
    stages.routing.admit(grown)
    g.intake.admit(m.name, a.binding.inputs, fit_limits(m.settings.limits, a.binding.inputs))
    g.infos[m.name] = ModelInfo(m.name, a.stages.infer.info.version)
    g.merge.add(a.stages.completed)
    stages.models.append(a.stages)
    return a.stages


def paused_apart(stages: Stages, model: ModelStages, topics: Sequence[str],
                 like: str | None = None) -> None:
    """``model``'s new ``topics`` paused on its own counts (its topic ``like``'s
    rank where it has one, else one of its own at the bound a model beside
    others has); the one model served so far, paused on the worker's counts,
    from now on on its own."""
    b, consumer = model.settings.batching, stages.consumer
    consumer.pausing.admit(topics, (apart_bound(b), b.max_inflight_bytes), model.name, like,
                           (stages.models[0].name, consumer.input_topics))  # fmt: skip


async def _model_stages(
    m: LoadedModel, plan: RunPlan, tracker: OffsetTracker, bindings: Bindings, device: GpuShare
) -> _Answerer:
    binding = await bindings.of(m)

    async def stage(
        batches: asyncio.Queue[Batch[Job] | None],
        completed: asyncio.Queue[asyncio.Future[Completed] | None],
        policy: Policy[Job], room: Room,
    ) -> Stage:  # fmt: skip
        return await inference_stage(
            m.settings, plan, batches, completed, m.engine, policy, binding, tracker, room,
            device, m.key, m.name,
        )  # fmt: skip

    return await _answerer(m.settings, binding, plan, stage)


StageBuilder = Callable[
    [asyncio.Queue[Batch[Job] | None], asyncio.Queue[asyncio.Future[Completed] | None],
     Policy[Job], Room],
    Awaitable[Stage],
]  # fmt: skip


async def _answerer(s: Settings, binding: Binding, plan: RunPlan, build: StageBuilder) -> _Answerer:
    """A model's or pipeline's stages: its own jobs queue, batching and threads
    or slots (``build``: its inference stage)."""
    b = s.batching
    jobs: asyncio.Queue[Job | None] = asyncio.Queue(b.queue_capacity)
    batches: asyncio.Queue[Batch[Job] | None] = asyncio.Queue(1)
    completed: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue(
        b.max_inflight_batches
    )
    policy = batch_policy(s)  # one FIFO, or the priority lanes ([[kafka.lanes]])
    # A batch is cut when a thread or slot can start it (worker.flow.room).
    room = Room(plan.inflight_of(s.model.backend))
    infer = await build(batches, completed, policy, room)
    batcher = MicroBatcher(jobs, batches, policy, room=room)
    return _Answerer(ModelStages(s.model.name, jobs, batcher, infer, completed, s), s, binding)


async def _pipeline_stages(
    name: str,
    p: PipelineConfig,
    plan: RunPlan,
    models: Mapping[str, LoadedModel],
    tracker: OffsetTracker,
    bindings: Bindings,
    device: GpuShare,
) -> _Answerer:
    """A pipeline's stages: its intake (its declared tensors' checks, else its
    first model's), its batcher, and a stage that runs each batch through the
    steps, each model step on a stage of its own over the model's engine (the
    CPU or the GPU stage, as the model's backend says: ``worker.compute.pipeline``)."""
    first = models[next(step.model for step in p.steps if step.model)]
    # The settings its intake and batching run with: its first model's, named as
    # the pipeline (results and metrics name it).
    s = dataclasses.replace(first.settings,
                            model=dataclasses.replace(first.settings.model, name=name))  # fmt: skip
    steps: dict[str, StepModel] = {}
    for model in dict.fromkeys(step.model for step in p.steps if step.model):
        m = models[model]
        bound = await bindings.of(m)
        step_stage = await inference_stage(
            m.settings, plan, asyncio.Queue(), asyncio.Queue(), m.engine, None, bound, tracker,
            None, device, m.key, f"{name}.{model}",
        )  # fmt: skip
        steps[model] = StepModel(m.engine.info, bound, step_stage)
    # Its ops on the GPU where it runs a model there (their CuPy kernels), else on the host.
    gpu = [models[m].settings.model.backend for m in steps
           if is_gpu_backend(models[m].settings.model.backend)]  # fmt: skip
    ops = DeviceOps.on(gpu[0], s.gpu.device) if gpu else None
    built = build_plan(name, p, steps, ops)
    binding = steps[first.name].binding
    if p.inputs:  # the request is the pipeline's own: checked against what it declares
        io = declared_io(name, p)
        # (The outputs plan is the first model's, which the pipeline stage never reads:
        # its answer is its outputs = {...}.)
        binding = Binding(declared_inputs(name, p, s.limits, s.batching), binding.outputs, io)
    info = pipeline_info(name, binding.io, p, {m: sm.info for m, sm in steps.items()})

    async def stage(
        batches: asyncio.Queue[Batch[Job] | None],
        completed: asyncio.Queue[asyncio.Future[Completed] | None],
        policy: Policy[Job], room: Room,
    ) -> Stage:  # fmt: skip
        return PipelineStage(batches, completed, info, binding, built,
                             max_inflight=plan.inflight,
                             on_service_time=policy.observe_service_time, room=room)  # fmt: skip

    return await _answerer(s, binding, plan, stage)


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
