"""The pipeline's stages, built once from the settings, the run plan and the
loaded engine, and linked by bounded queues:

    consumer -> [jobs] -> batcher -> [batches] -> inference stage
        -> [futures, dispatch order] -> writer -> offset tracker -> committer

Each stage gets its input queue and downstream handle in its constructor; end of
stream (``None``) flows down the same queues, so shutdown drains stage by stage.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import cast

import structlog

from worker.app.lanes import backpressure, batch_policy
from worker.app.plan import RunPlan
from worker.app.probe import check_declarations
from worker.compute.cpu import CpuStage
from worker.compute.engines import Engine, GpuEngine
from worker.compute.stage import Stage
from worker.config import Settings
from worker.flow.batching import MicroBatcher, Policy
from worker.flow.budget import FailureBudget
from worker.flow.messages import Batch, Completed, Job
from worker.flow.offsets import OffsetTracker
from worker.flow.room import Room
from worker.flow.values import ModelInfo
from worker.kafka.clients import client_kwargs
from worker.kafka.commit import Committer
from worker.kafka.consumer import Consumer
from worker.kafka.crashguard import CrashGuard
from worker.kafka.delivery.at_least_once import AtLeastOnceWriter
from worker.kafka.delivery.exactly_once import ExactlyOnceWriter
from worker.kafka.delivery.writer import ResultWriter, WriterParts
from worker.kafka.intake import JobFactory
from worker.kafka.lease import GroupLease
from worker.kafka.listener import RevokeHook
from worker.model.inputs import Binding, bind_model
from worker.model.inputs.binding import fit_limits, summary
from worker.obs.tracing import Tracer

log = structlog.get_logger(__name__)


@dataclass
class Stages:
    """Everything the worker builds, kept together so closing never guesses."""

    consumer: Consumer
    batcher: MicroBatcher[Job]
    infer: Stage
    writer: ResultWriter
    committer: Committer


async def build_stages(
    s: Settings,
    plan: RunPlan,
    engine: Engine | GpuEngine,
    tracker: OffsetTracker,
    tracer: Tracer,
    on_revoke: RevokeHook,
) -> Stages:
    """The stages, wired; the binding decided once (exit 2 on a mismatch, before
    Kafka is contacted), shared by the intake and the inference stage."""
    b = s.batching
    binding = bind_model(s.model, engine.info.io, s.limits, b)
    if plan.device == "cpu":  # the GPU stage's engines run per slot, after start-up
        await asyncio.to_thread(check_declarations, engine, binding.io, binding.outputs)
    log.info("model_inputs", inputs=summary(binding.inputs), outputs=list(engine.info.output_names))
    limits = fit_limits(s.limits, binding.inputs)
    jobs: asyncio.Queue[Job | None] = asyncio.Queue(b.queue_capacity)
    batches: asyncio.Queue[Batch[Job] | None] = asyncio.Queue(1)
    completed: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue(
        b.max_inflight_batches
    )
    policy = batch_policy(s)  # one FIFO, or the priority lanes ([[kafka.lanes]])
    # A batch is cut when a thread or slot can start it (worker.flow.room).
    room = Room(plan.inflight)
    consumer = Consumer(
        s.kafka,
        JobFactory(binding.inputs, limits, b.max_record_age_ms, s.kafka.content_type),
        jobs,
        tracker,
        on_revoke,
        backpressure(s),
    )
    committer = Committer(
        tracker,
        consumer,
        timeout=plan.request_timeout_s,
        transactional=plan.exactly_once,
        interval=s.kafka.commit_interval_ms / 1000.0,
    )
    consumer.wake_on(committer.progress)
    infer = await _inference_stage(
        s, plan, batches, completed, engine, policy, binding, tracker, room
    )
    model = ModelInfo(name=engine.info.name, version=engine.info.version)
    budget = FailureBudget(s.dlq.max_consecutive, s.dlq.max_ratio, s.dlq.window)
    parts = WriterParts(completed, s.kafka, model, tracker, committer, budget, tracer)
    writer: ResultWriter
    if plan.exactly_once:
        lease = GroupLease(
            lambda: consumer.client, s.kafka.session_timeout_ms, plan.request_timeout_s
        )
        writer = ExactlyOnceWriter(parts, lease, max_batches=plan.transaction_batches)
    else:
        writer = AtLeastOnceWriter(parts, max_pending_acks=plan.max_pending_acks)
    batcher = MicroBatcher(jobs, batches, policy, room=room)
    return Stages(consumer, batcher, infer, writer, committer)


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
    stages.consumer.protect(
        guard, s.limits.max_crash_attempts, plan.crash_guard_window, stages.committer.settled
    )
    return guard
