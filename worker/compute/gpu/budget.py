"""This process's share of a GPU's memory, when several serve one device.

``run --procs N`` on one GPU (issue 55: one interpreter cannot feed it) starts N
processes, each with its engine, its compile and graph pools, and its slot ring.
Without a cap the first to warm up takes what the others need, and the last one
fails in the middle of its warm-up with an allocator error that names nothing.
So each process gets a share (``gpu.memory_fraction``; ``run --procs N`` gives
each of its members 1/N unless one is set), and:

- ``cap``: torch's caching allocator (``torch.cuda.set_per_process_memory_fraction``)
  and CuPy's default pool (``MemoryPool.set_limit(fraction=...)``) are held to
  it before the engine loads, so one process can never take a neighbour's share;
- ``check_slots``: before any slot is allocated, the ring's device buffers must
  fit the share with room left for the engine, or start-up stops (exit 2)
  naming the settings that size them;
- ``check_used``: after the warm-up, what the process holds (torch's reserved
  memory and CuPy's pool) is compared with the share and logged; over it, exit 2.

Not counted: each process's CUDA context (a few hundred MiB, outside both
allocators), and TensorRT's own allocations outside torch and CuPy. Written to
the documented APIs of torch and CuPy; not run on a GPU here (no device was lent
when this was written): the arithmetic is unit-tested on the CPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import structlog

from worker.flow.errors import ConfigError
from worker.obs import metrics

log = structlog.get_logger(__name__)

MIB = 2**20
# The least the slot ring must leave of a share for the engine: its weights,
# activations and (torch) compile and graph pools. A ResNet-50 at batch 64 in
# fp16 held about 2 GiB here on an H100 (DESIGN.md's measurements).
ENGINE_RESERVE = 0.5

Started = TypeVar("Started")


class SlotBudget(Protocol):
    """What a GPU stage checks its slot ring with before allocating it."""

    def check_slots(self, slot_bytes: int, slots: int) -> None: ...


@runtime_checkable
class MeasuredBudget(SlotBudget, Protocol):
    """A budget that also says what the process's allocators hold now (the
    share's ``used``), which a GPU stage's ``load`` measures itself with."""

    def used(self) -> int: ...


@dataclass(frozen=True)
class MemoryBudget:
    """``fraction`` of device ``device``, which has ``total_bytes``."""

    device: int
    total_bytes: int
    fraction: float

    @property
    def bytes(self) -> int:
        return int(self.total_bytes * self.fraction)

    def describe(self) -> str:
        return (f"gpu.memory_fraction {self.fraction:.3g} of cuda:{self.device} "
                f"({_mib(self.bytes)} of {_mib(self.total_bytes)})")  # fmt: skip

    def check_slots(
        self, slot_bytes: int, slots: int, others: Mapping[str, int] | None = None
    ) -> None:
        """The rings' device buffers leave at least ``ENGINE_RESERVE`` of the share:
        this ring's and ``others``, the rings of the models started before it
        (model -> bytes)."""
        beside = dict(others or {})
        ring = slot_bytes * slots
        if ring + sum(beside.values()) <= self.bytes * (1 - ENGINE_RESERVE):
            return
        also = (
            f", beside {', '.join(f'{m} {_mib(b)}' for m, b in beside.items())} for the "
            "slot rings of the models started before it"
            if beside
            else ""
        )
        raise ConfigError(
            f"{self.describe()}: the slot ring alone needs {_mib(ring)} ({slots} slots x "
            f"{_mib(slot_bytes)}: every input, output and staging buffer at "
            f"batching.max_batch_size rows){also}, more than half the share, which the "
            "engines need too; lower gpu.num_slots, batching.max_batch_size or "
            "gpu.max_input_bytes, or start fewer processes (--procs) on this device"
        )

    def check_used(self, used_bytes: int, models: Mapping[str, int] | None = None) -> None:
        """After the warm-up: what the process holds, against its share (``models``:
        what each model took as it started, named when over)."""
        log.info("gpu_memory", device=self.device, used_mib=round(used_bytes / MIB, 1),
                 budget_mib=round(self.bytes / MIB, 1), fraction=self.fraction)  # fmt: skip
        if used_bytes > self.bytes:
            each = (
                f" ({', '.join(f'{m} {_mib(b)}' for m, b in models.items())})"
                if models and len(models) > 1
                else ""
            )
            raise ConfigError(
                f"{self.describe()}: after its warm-up this process holds "
                f"{_mib(used_bytes)}{each}; lower gpu.num_slots or batching.max_batch_size, "
                "or start fewer processes on this device"
            )


def resolve_fraction(setting: float, members: int) -> float:
    """``gpu.memory_fraction`` decided: the setting, else an equal share of the
    device among the ``members`` processes ``run`` starts on it (1: the whole)."""
    if setting > 0:
        return setting
    return 1.0 / max(1, members)


def cap(cupy: Any, torch: Any | None, budget: MemoryBudget) -> None:
    """Hold both allocators to the share, before anything is allocated. ``torch``
    is None where the engine is not torch's (TensorRT over CuPy buffers)."""
    cupy.get_default_memory_pool().set_limit(fraction=budget.fraction)
    if torch is not None:
        torch.cuda.set_per_process_memory_fraction(budget.fraction, budget.device)


def used_bytes(cupy: Any, torch: Any | None, device: int) -> int:
    """What this process's allocators hold on ``device`` (reserved, not just in use:
    a cached block is not free for a neighbour)."""
    held = int(cupy.get_default_memory_pool().total_bytes())
    if torch is not None:
        held += int(torch.cuda.memory_reserved(device))
    return held


class DeviceShare:
    """This process's allocators on one device, capped at its share from the start
    (construct it before the engine loads: off the event loop, CUDA initialises),
    and what each GPU model takes of it: its slot ring, checked with the rings
    of the models before it (``slots_for``), and all it allocated as its stage
    started (``measure``), checked together after the last (``check_used``).
    ``cupy``: CuPy (the default) or its CPU twin."""

    def __init__(self, device: int, fraction: float, torch_engine: bool, cupy: Any = None) -> None:
        if cupy is None:
            from worker.compute.engines.cuda import import_cupy

            cupy = import_cupy()
        self.cupy = cupy
        self._torch = importlib.import_module("torch") if torch_engine else None
        with self.cupy.cuda.Device(device):
            _free, total = self.cupy.cuda.runtime.memGetInfo()
        self.budget = MemoryBudget(device, int(total), fraction)
        self.rings: dict[str, int] = {}  # model -> its slot ring's device bytes
        self.models: dict[str, int] = {}  # model -> what it took as its stage started
        cap(self.cupy, self._torch, self.budget)
        log.info("gpu_memory_share", device=device, fraction=fraction,
                 budget_mib=round(self.budget.bytes / MIB, 1))  # fmt: skip

    def slots_for(self, model: str) -> ModelSlots:
        """What ``model``'s stage checks its ring with (``GpuStage``'s ``budget``)."""
        return ModelSlots(self, model)

    def measure(self, model: str, start: Callable[[], Started]) -> Started:
        """``start()`` (a model's stage, built), and what the process's allocators
        held more after it than before: that model's memory, logged and published."""
        before = self.used()
        started = start()
        took = max(0, self.used() - before)
        self.models[model] = took
        metrics.GPU_MODEL_MEMORY.labels(model).set(took)
        log.info("gpu_model_memory", model=model, mib=round(took / MIB, 1),
                 ring_mib=round(self.rings.get(model, 0) / MIB, 1))  # fmt: skip
        return started

    def used(self) -> int:
        return used_bytes(self.cupy, self._torch, self.budget.device)

    def check_used(self) -> None:
        self.budget.check_used(self.used(), self.models)


@dataclass(frozen=True)
class ModelSlots:
    """One model's view of the share: its ring is checked beside the others'."""

    share: DeviceShare
    model: str

    def check_slots(self, slot_bytes: int, slots: int) -> None:
        others = {m: b for m, b in self.share.rings.items() if m != self.model}
        self.share.budget.check_slots(slot_bytes, slots, others)
        self.share.rings[self.model] = slot_bytes * slots

    def used(self) -> int:
        return self.share.used()


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB"
