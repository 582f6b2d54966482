"""What a GPU stage holds on the device for one engine, built and freed as a whole.

The stage (``stage``) decides once, as it is constructed, what does not depend
on the engine object (``RingPlan``: the binding, the settings, the image the
kernels preprocess, the threads, nvJPEG, the share of the device). Everything
else is built from one engine by ``build``: the shapes the slots run
(``engine.prepare``), the postprocessing plan, the launcher and the columns, the
slot ring with each slot's buffers and the engine's context for its stream, the
kernels warmed, the completion watch. The constructor builds it, and so does
``GpuStage.load`` after an eviction (``GpuStage.evict``, models loaded by
demand), so a reloaded stage runs exactly as the one first started.

The share of the device (``budget``): each build checks its ring before
allocating it (``SlotBudget.check_slots``). An engine loaded again from the
same file under the same settings lays its slots out as before (the layout is a
function of the binding, the settings and the engine's tensors), so the ring it
builds is the size of the one it replaces and fits where that fitted; the
share's record for the model is rewritten with the same figure. A file changed
on disk since start-up is checked afresh, beside the other models' rings.

Freeing (``DeviceResources.close``): every slot's stream drained, then each
slot's buffers (device and pinned) and engine context dropped, nvJPEG's views of
the slots released, and on an eviction the engine closed, all with the device
quiet (``quiet``: the process's freeing gate, ``freeing``), since a context or
an engine may ``cudaFree`` while other stages serve; ``engine.prepare`` runs so
too (TensorRT drops the context it sized the outputs on). Creating the slots'
contexts (allocating, warming, capturing) does not shut the others out: it can
take seconds. The slot buffers go back to CuPy's pool (its ``used_bytes``
drops; its cached blocks, which ``budget.used_bytes`` counts as held, are what
the next load reuses), torch's graph pools to torch's caching allocator,
TensorRT's contexts and engine to the device: on a GPU, that a reload measures
what the first start did is therefore not to be expected. On the CPU twin the
pool's bytes drop as the arrays go, which the tests measure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from worker.compute.engines.base import GpuEngine
from worker.compute.engines.cuda import translate_gpu_error
from worker.compute.gpu.budget import SlotBudget
from worker.compute.gpu.columns import Columns, columnar_on_device
from worker.compute.gpu.completion import SlotWatch
from worker.compute.gpu.freeing import GATE
from worker.compute.gpu.launch import Launcher
from worker.compute.gpu.nvjpeg import NvJpeg
from worker.compute.gpu.plan import postprocess_plan, slot_shapes
from worker.compute.gpu.runner import SlotRunner
from worker.compute.gpu.slots import Allocations, Slot, SlotLayout, SlotRing
from worker.config import GpuConfig
from worker.flow.errors import EngineDead, InferenceFailed, WorkerError
from worker.model.inputs import Binding
from worker.model.inputs.base import BoundInput
from worker.model.inputs.image import BoundImage
from worker.obs.metrics import ModelMetrics

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RingPlan:
    """What a GPU stage decided at construction, the same for every build."""

    binding: Binding
    gpu: GpuConfig
    num_slots: int
    max_batch_size: int  # as configured; each engine caps it at its own maximum
    preferred: tuple[int, ...]  # the batch buckets, as configured
    image: BoundImage | None  # the image input the kernels preprocess
    host: tuple[BoundInput, ...]  # the inputs collated on the host
    cupy: Any  # CuPy or its CPU twin
    nvjpeg: NvJpeg | None  # the stage's decoder (it lives as long as the stage)
    pool: ThreadPoolExecutor  # the stage's threads
    metrics: ModelMetrics
    budget: SlotBudget | None


@dataclass(eq=False)
class DeviceResources:
    """One engine's slots and everything that runs them (the module's docstring)."""

    engine: GpuEngine
    max_rows: int  # the most rows one run takes
    buckets: dict[str, tuple[int, ...]]  # the length buckets, by padded dimension
    forms: tuple[str, ...]  # the outputs postprocessed on the device
    launcher: Launcher
    columns: Columns
    device_columnar: bool
    layout: SlotLayout
    allocations: Allocations
    ring: SlotRing[Slot]
    watch: SlotWatch
    runner: SlotRunner

    def close(self, plan: RingPlan, reason: WorkerError, *, engine: bool) -> None:
        """Fail whatever waits for a slot (with the dead device's error, else
        ``reason``), drain the slots' streams and free them; ``engine``: close
        the engine too (an eviction; at shutdown the engine is its loader's).
        On a dead device nothing is synchronised (it would hang or fail): the
        buffers go with the last references."""
        self.ring.close(self.watch.dead or reason)
        if self.watch.dead is not None:
            if plan.nvjpeg is not None:
                plan.nvjpeg.close()
            return
        with quiet(plan):
            for slot in self.ring.slots:
                slot.close()
            if plan.nvjpeg is not None:
                plan.nvjpeg.close()  # its torch views keep the slots' staging alive
            if engine:
                self.engine.close()


@contextlib.contextmanager
def quiet(plan: RingPlan) -> Iterator[None]:
    """The device drained with no submission under way or starting, on the
    stage's device: where memory may be freed (``freeing``). Blocks its caller
    until every stream of the process is idle (milliseconds: what is in flight)."""
    cupy = plan.cupy
    with GATE.freeing(), cupy.cuda.Device(plan.gpu.device):
        # Drain every stream first, with the GIL released (CuPy's
        # deviceSynchronize is nogil), so each pending completion callback
        # (which takes the GIL) has run. Freeing engine context memory then
        # (cudaFree synchronises the device) holds the GIL: a callback still
        # queued on a stream would wait for the GIL for ever, and so would we.
        cupy.cuda.runtime.deviceSynchronize()
        yield


def build(plan: RingPlan, engine: GpuEngine) -> DeviceResources:
    """Everything the stage runs ``engine`` with, allocated now (start-up or a
    load, never the hot path; kernel compilation, engine contexts and CUDA
    graphs take a while: call it off the event loop). Half-built, it frees
    what it allocated before raising."""
    inputs, outputs, gpu, image = plan.binding.inputs, plan.binding.outputs, plan.gpu, plan.image
    # A batch larger than the engine takes runs in chunks of its maximum (a
    # model of fixed batch: chunks of exactly that, padded up by the buckets).
    max_rows = min(plan.max_batch_size, engine.max_batch_size)
    preferred = tuple(p for p in plan.preferred if p <= max_rows)
    shapes = slot_shapes(inputs, max_rows, preferred, inputs.length_buckets,
                         engine.min_batch_size)  # fmt: skip
    with quiet(plan):  # TensorRT sizes the outputs on a context it then drops
        engine.prepare(shapes)
    post = postprocess_plan(engine, outputs)
    cupy = plan.cupy
    launcher = Launcher(cupy, engine, inputs, image, plan.host, post, plan.nvjpeg)
    columns = Columns(cupy, engine, inputs, image, post, outputs, launcher)
    layout = SlotLayout(
        device=gpu.device,
        max_batch_size=shapes.batches[-1],
        engine_inputs=engine.inputs,
        engine_outputs=engine.outputs,
        results=post.result_specs,
        copy_back=post.copy_back,
        max_input_bytes=gpu.max_input_bytes if image is not None else 0,
        host_inputs=tuple(f.name for k in (*plan.host, *inputs.constants) for f in k.feeds),
    )
    if plan.budget is not None:
        plan.budget.check_slots(layout.device_bytes, plan.num_slots)
    allocations = Allocations()
    slots = _make_slots(plan, engine, launcher, layout, allocations)
    metrics = plan.metrics
    metrics.gpu_slots.set(plan.num_slots)
    ring: SlotRing[Slot] = SlotRing(slots, allocations, metrics.gpu_slots_busy.set)
    watch = SlotWatch(cupy, ring, gpu.poll_interval_ms / 1000.0, gpu.batch_timeout_ms / 1000.0)
    runner = SlotRunner(plan.pool, launcher, watch, metrics, plan.nvjpeg)
    res = DeviceResources(
        engine, max_rows, dict(shapes.lengths), post.forms, launcher, columns,
        columnar_on_device(inputs, outputs, post, image), layout, allocations, ring, watch,
        runner,
    )  # fmt: skip
    log.info(
        "gpu_stage_ready", device=gpu.device, slots=plan.num_slots, rows=layout.max_batch_size,
        device_mib=round(layout.device_bytes * plan.num_slots / 2**20, 1),
        pinned_mib=round(layout.pinned_bytes * plan.num_slots / 2**20, 1),
        inputs={k.name: k.kind for k in inputs.kinds},
        device_image=image.name if image is not None else None, shapes=len(shapes.combos()),
        decode=gpu.decode, postprocess="host" if post.host_postprocess else "gpu",
        device_columns=res.device_columnar,
    )  # fmt: skip
    return res


def _make_slots(
    plan: RingPlan,
    engine: GpuEngine,
    launcher: Launcher,
    layout: SlotLayout,
    allocations: Allocations,
) -> list[Slot]:
    cupy = plan.cupy
    slots: list[Slot] = []
    try:
        for index in range(plan.num_slots):
            slot = Slot.create(index, layout, allocations, cupy)
            slots.append(slot)
            slot.context = engine.create_context(slot)
            if plan.nvjpeg is not None:
                plan.nvjpeg.attach(slot)
        launcher.warm_kernels(plan.gpu.device)
        # Start-up only: the buffers were zero-filled on the legacy default
        # stream, which the slots' non-blocking streams do not wait for.
        with cupy.cuda.Device(plan.gpu.device):
            cupy.cuda.runtime.deviceSynchronize()
    except BaseException:
        # Half-started: free what was created (streams, buffers, contexts); on a
        # device that failed, what cannot drain goes with the last references.
        with contextlib.suppress(Exception), quiet(plan):
            for slot in slots:
                with contextlib.suppress(Exception):
                    slot.close()
            if plan.nvjpeg is not None:
                plan.nvjpeg.close()
        raise
    return slots


class DeviceState:
    """A GPU stage's hold on the device: the resources it runs on, or none
    (evicted by demand); and the device's death, which outlives an eviction
    (a dead device is never loaded on again). Replaced as a whole: a batch
    runs on the ``DeviceResources`` it was given, which only ``evict`` (no
    batch running) takes away."""

    def __init__(self, plan: RingPlan, engine: GpuEngine, name: str,
                 used: Callable[[], int]) -> None:  # fmt: skip
        """Builds the resources for ``engine`` now (the stage's construction)."""
        self._plan = plan
        self._name = name
        self._used = used
        self._dead: EngineDead | None = None
        self.resources: DeviceResources | None = build(plan, engine)

    def serving(self) -> DeviceResources:
        """What a batch runs on; raises the dead device's error, or (a bug: the
        residence loads the model before a batch runs) that it is evicted."""
        res = self.resources
        if res is None:
            raise self._dead or InferenceFailed(f"{self._name}: run while evicted")
        if res.watch.dead is not None:
            raise res.watch.dead
        return res

    def evict(self) -> None:
        """``GpuStage.evict``."""
        res, self.resources = self.resources, None
        if res is None:
            return
        self._dead = res.watch.dead
        self._plan.metrics.gpu_slots.set(0)
        try:
            res.close(self._plan, EngineDead(f"{self._name}: evicted"), engine=True)
        except Exception as exc:  # boundary: CuPy / engine library errors
            error = translate_gpu_error(exc, f"{self._name}: evict")
            self._dead = error if isinstance(error, EngineDead) else EngineDead(str(error))
            raise self._dead from exc
        log.info("gpu_stage_evicted", model=self._name, device=self._plan.gpu.device)

    def load(self, engine: GpuEngine) -> int:
        """``GpuStage.load``."""
        if self.resources is not None:
            raise RuntimeError(f"{self._name}: load while loaded")
        try:
            if self._dead is not None:
                raise self._dead
            before = self._used()
            self.resources = build(self._plan, engine)
        except BaseException:
            with contextlib.suppress(Exception):
                engine.close()
            raise
        took = max(0, self._used() - before)
        log.info("gpu_stage_loaded", model=self._name, mib=round(took / 2**20, 1))
        return took

    def close(self, pool: ThreadPoolExecutor) -> None:
        """Shutdown: fail whatever waits for a slot, let the stage's threads finish
        (``pool``), free the slots; the engine stays its loader's to close. The
        resources stay in place, so a later batch fails as the closed ring says."""
        res = self.resources
        reason = self._dead or EngineDead("GPU stage closed")
        if res is not None:
            res.ring.close(res.watch.dead or reason)
        pool.shutdown(wait=True, cancel_futures=True)
        if res is not None:
            res.close(self._plan, reason, engine=False)
        if self._plan.nvjpeg is not None:
            self._plan.nvjpeg.close()
