"""A model's inference stage, built once: its binding (decided and probed once,
whoever runs it: its own stages and each pipeline step), then the CPU stage or,
for a GPU backend, the GPU stage with its slot ring in the process's one share
of the device (``worker.compute.gpu.budget``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

import structlog

from worker.app.loading import LoadedModel
from worker.app.pipelines import answer_outputs
from worker.app.plan import RunPlan
from worker.app.probe import check_declarations
from worker.compute.cpu import CpuStage
from worker.compute.engines import Engine, GpuEngine, is_gpu_backend
from worker.compute.gpu.budget import DeviceShare
from worker.compute.gpu.twin import cupy_for
from worker.compute.stage import Stage
from worker.config import Settings
from worker.config.models import settings_named
from worker.flow.batching import Policy
from worker.flow.messages import Batch, Completed, Job
from worker.flow.offsets import OffsetTracker
from worker.flow.room import Room
from worker.model.inputs import Binding, bind_model
from worker.model.inputs.binding import summary

log = structlog.get_logger(__name__)


async def bound(key: str, s: Settings, plan: RunPlan, engine: Engine | GpuEngine) -> Binding:
    """A model's binding (``key``: where it is configured, which its errors
    name), probed on the CPU path (the GPU stage's engines run per slot, after
    start-up)."""
    with settings_named(key):  # a [models.NAME]'s errors name its keys as written
        binding = bind_model(s.model, engine.info.io, s.limits, s.batching)
        if not is_gpu_backend(s.model.backend):
            await asyncio.to_thread(check_declarations, engine, binding.io, binding.outputs,
                                    s.model.name)  # fmt: skip
    # The outputs its answers carry (model.outputs and postprocessing applied).
    log.info("model_inputs", model=s.model.name, inputs=summary(binding.inputs),
             outputs=list(answer_outputs(binding)))  # fmt: skip
    return binding


class Bindings:
    """Each model's binding, decided (and probed) once however many stages run
    it: its own, and each pipeline's step."""

    def __init__(self, plan: RunPlan) -> None:
        self._plan = plan
        self._bound: dict[str, Binding] = {}

    async def of(self, m: LoadedModel) -> Binding:
        if m.binding is not None:  # bound as it loaded (by demand: it may be closed since)
            return m.binding
        if m.name not in self._bound:
            self._bound[m.name] = await bound(m.key, m.settings, self._plan, m.engine)
        return self._bound[m.name]


async def inference_stage(
    s: Settings,
    plan: RunPlan,
    batches: asyncio.Queue[Batch[Job] | None],
    completed: asyncio.Queue[asyncio.Future[Completed] | None],
    engine: Engine | GpuEngine,
    policy: Policy[Job] | None,
    binding: Binding,
    tracker: OffsetTracker,
    room: Room | None,
    device: GpuShare,
    key: str,
    ring: str,
) -> Stage:
    """The CPU stage, or the GPU stage with its slot ring, as the model's backend
    says. ``policy`` and ``room``: its batcher's (None for a pipeline's step,
    which its pipeline's stage runs); ``key``: where the model is configured (its
    errors name its keys so); ``ring``: what its share of the device is counted
    under (the model's name; a pipeline's step: ``PIPELINE.MODEL``)."""
    b = s.batching
    observe = policy.observe_service_time if policy is not None else None
    if not is_gpu_backend(s.model.backend):
        return CpuStage(
            batches, completed, engine, binding,
            max_batch_size=b.max_batch_size, max_inflight=plan.inflight,
            max_attempts=b.max_attempts, on_service_time=observe,
            owns=lambda job: tracker.owns(job.tp, job.offset, job.epoch), room=room,
        )  # fmt: skip
    from worker.compute.gpu.stage import GpuStage

    def build() -> GpuStage:
        # Allocated once, off the event loop (kernel compilation and engine contexts
        # take a while); measured against the process's share of the device.
        share = device.share(s.model.backend)

        def start() -> GpuStage:
            return GpuStage(
                batches, completed, cast(GpuEngine, engine), binding,
                max_batch_size=b.max_batch_size, num_slots=plan.slots, gpu=s.gpu,
                preferred_batch_sizes=b.preferred_batch_sizes, max_attempts=b.max_attempts,
                on_service_time=observe, room=room, budget=share.slots_for(ring),
                cupy=share.cupy,
            )  # fmt: skip

        with settings_named(key):  # a [models.NAME]'s errors name its keys as written
            return share.measure(ring, start)

    return await asyncio.to_thread(build)


class GpuShare:
    """The process's one share of the GPU (``worker.compute.gpu.budget``), made
    for the first GPU stage and shared by every other: each model's slot ring
    is checked beside the others' and what each takes is measured; capped
    before the first allocates, checked once every stage has started."""

    def __init__(self, s: Settings, plan: RunPlan, models: Sequence[LoadedModel]) -> None:
        self._gpu = s.gpu
        self._fraction = plan.gpu_memory_fraction
        self._torch = any(m.settings.model.backend == "torch" for m in models)
        self._share: DeviceShare | None = None

    def share(self, backend: str) -> DeviceShare:
        if self._share is None:
            self._share = DeviceShare(self._gpu.device, self._fraction, self._torch,
                                      cupy_for(backend))  # fmt: skip
        return self._share

    def check_used(self) -> None:
        if self._share is not None:
            self._share.check_used()

    @property
    def models(self) -> dict[str, int]:
        """What each GPU stage took of the device as it started, by ring (a
        model's own: its name; a pipeline's step: ``PIPELINE.MODEL``)."""
        return dict(self._share.models) if self._share is not None else {}
