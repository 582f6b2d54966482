"""Slots: everything one in-flight batch needs on the GPU, allocated once; and the ring.

A ``Slot`` is one CUDA stream with its timing events, pinned host staging for the
batch's packed image bytes and per-image table (GPU preprocessing), pinned host
twins of the model inputs collated on the host (tensors, texts' tokens, images
preprocessed on the CPU) and of the outputs that come back, device buffers
sized for the largest batch at the longest lengths, and the engine's execution
context for that stream. Slots rotate, so while batch N computes on
one stream, batch N+1 copies in on another and batch N-1 copies out on a third.

A JPEG decoded on the device (``nvjpeg``) is a ``DeviceImage``: it takes its
bytes in the device staging by a device-to-device copy and never touches the
pinned buffer (``pack_batch``).

Nothing here is allocated per batch: every buffer is created when the slot is,
at start-up, and counted in ``Allocations``; the tests assert that count never
moves once the worker is running. Pinned (page-locked) host memory is what makes
the copies asynchronous: a copy from pageable memory is staged synchronously by
the driver and would stall the submitting thread.

``SlotRing`` is pure asyncio bookkeeping with no CUDA in it, so its rotation,
waiting and accounting are unit-tested on CPU with fake slots.
"""

from __future__ import annotations

import asyncio
import importlib
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from worker.flow.errors import EngineDead, WorkerError
from worker.model.io import TensorDesc


@dataclass
class Allocations:
    """Counts buffers allocated for slots (device and pinned host)."""

    count: int = 0
    nbytes: int = 0

    def record(self, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes


S = TypeVar("S")


class SlotRing(Generic[S]):
    """A fixed set of slots handed out in rotation.

    ``acquire`` returns the free slot that has been free the longest (strict
    round-robin while batches finish in order; with out-of-order completion, the
    slot whose stream has been idle longest). When every slot is busy it waits,
    without blocking the loop, and waiters are served first come, first served.
    ``release`` hands the slot straight to the oldest waiter. The ring never grows:
    its slots are all created at start-up.
    """

    def __init__(
        self,
        slots: Sequence[S],
        allocations: Allocations | None = None,
        on_busy: Callable[[int], None] | None = None,
    ) -> None:
        """``on_busy`` is told the number of busy slots whenever it changes (the
        occupancy gauge: all busy with batches waiting means the device binds)."""
        if not slots:
            raise ValueError("a slot ring needs at least one slot")
        self.slots: tuple[S, ...] = tuple(slots)
        self.allocations = allocations if allocations is not None else Allocations()
        self._known = {id(s) for s in self.slots}
        if len(self._known) != len(self.slots):
            raise ValueError("the same slot appears twice")
        self._free: deque[S] = deque(self.slots)
        self._busy: set[int] = set()
        self._waiters: deque[asyncio.Future[S]] = deque()
        self._closed: WorkerError | None = None
        self._on_busy = on_busy
        if on_busy is not None:
            on_busy(0)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def busy(self) -> int:
        return len(self._busy)

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def try_acquire(self) -> S | None:
        if self._closed is not None:
            raise self._closed
        if self._free and not self._waiters:
            slot = self._free.popleft()
            self._busy.add(id(slot))
            if self._on_busy is not None:
                self._on_busy(len(self._busy))
            return slot
        return None

    async def acquire(self) -> S:
        slot = self.try_acquire()
        if slot is not None:
            return slot
        waiter: asyncio.Future[S] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a slot in the same iteration we were cancelled: pass it on.
                self.release(waiter.result())
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self, slot: S) -> None:
        """Return a slot acquired from this ring. Releasing a slot that is not
        this ring's, or is not currently acquired, is a bug and raises."""
        key = id(slot)
        if key not in self._known:
            raise ValueError(f"release of a slot that does not belong to this ring: {slot!r}")
        if key not in self._busy:
            raise ValueError(f"release of a slot that is not acquired: {slot!r}")
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # skip waiters cancelled meanwhile
                waiter.set_result(slot)  # stays busy: ownership moves to the waiter
                return
        self._busy.discard(key)
        self._free.append(slot)
        if self._on_busy is not None:
            self._on_busy(len(self._busy))

    def close(self, reason: WorkerError | None = None) -> None:
        """Fail every waiter and every later acquire with ``reason``."""
        self._closed = reason or EngineDead("slot ring closed")
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(self._closed)


@dataclass(eq=False)
class DeviceImage:
    """A JPEG whose pixels are decoded on the device (``nvjpeg``) instead of being
    staged through pinned memory. Its size comes from the file's frame header, so
    the staging byte budget can count it before anything is decoded; ``pixels``
    is the decoded uint8 ``[channels, height, width]`` torch tensor on the slot's
    device, once decoded."""

    data: bytes  # the file
    height: int
    width: int
    channels: int
    pixels: Any = None

    @property
    def nbytes(self) -> int:
        """Its bytes in the packed staging buffer (uint8 HWC, like a tensor's)."""
        return self.height * self.width * self.channels


StagedImage = np.ndarray | DeviceImage


class Packing(NamedTuple):
    """Where ``pack_batch`` put a chunk's images in the packed staging buffer."""

    host_bytes: int  # packed[:host_bytes]: the host images, for one H2D copy
    total_bytes: int  # the device images follow them, up to here
    on_device: list[tuple[int, DeviceImage]]  # (byte offset, image): device copies


def pack_batch(images: Sequence[StagedImage], packed: np.ndarray, table: np.ndarray) -> Packing:
    """Lay a chunk's images out for kernels/preprocess.cu: uint8 ``[H, W(, C)]`` host
    images are copied back to back into ``packed`` (1-D uint8, pinned), device
    images get the bytes after them (filled later by a device-to-device copy, so
    not one of their pixels passes through the host), and ``table`` (int64
    [>= n, 3]) gets one (byte offset, height, width) row per image, in order.
    One host copy per host image, into memory allocated at start-up."""
    if len(images) > table.shape[0]:
        raise ValueError(f"{len(images)} images exceed the table's {table.shape[0]} rows")
    total = sum(image.nbytes for image in images)
    if total > packed.shape[0]:
        raise ValueError(f"{total} bytes of images exceed the {packed.shape[0]}-byte staging")
    offset = 0
    for i, image in enumerate(images):
        if isinstance(image, DeviceImage):
            continue
        size = image.size
        packed[offset : offset + size] = image.reshape(-1)
        table[i] = (offset, image.shape[0], image.shape[1])
        offset += size
    host_bytes = offset
    on_device: list[tuple[int, DeviceImage]] = []
    for i, image in enumerate(images):
        if isinstance(image, DeviceImage):
            table[i] = (offset, image.height, image.width)
            on_device.append((offset, image))
            offset += image.nbytes
    return Packing(host_bytes, offset, on_device)


def pack_images(images: Sequence[np.ndarray], packed: np.ndarray, table: np.ndarray) -> int:
    """``pack_batch`` for host images only; returns the bytes used."""
    return pack_batch(images, packed, table).host_bytes


# --- CUDA slots ---------------------------------------------------------------------


@dataclass(frozen=True)
class SlotLayout:
    """Every buffer of a slot, fixed at start-up from the engine and the model.

    ``max_batch_size`` rows everywhere, each at its largest row (the longest
    lengths); ``max_input_bytes`` of packed uint8 image staging when an image is
    preprocessed on the GPU (0 otherwise); ``host_inputs`` names the engine
    inputs collated on the host into pinned twins and copied in; ``results`` are
    device outputs of the postprocessing kernels; ``copy_back`` names the engine
    outputs or results that come back to pinned host memory.
    """

    device: int
    max_batch_size: int
    engine_inputs: tuple[TensorDesc, ...]
    engine_outputs: tuple[TensorDesc, ...]
    results: tuple[TensorDesc, ...] = ()
    copy_back: tuple[str, ...] = ()
    max_input_bytes: int = 0
    host_inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        names = [t.name for t in (*self.engine_outputs, *self.results)]
        if len(set(names)) != len(names):
            raise ValueError(f"buffer names collide: {names}")
        missing = set(self.copy_back) - set(names)
        if missing:
            raise ValueError(f"copy_back names unknown buffers: {sorted(missing)}")
        unknown = set(self.host_inputs) - {t.name for t in self.engine_inputs}
        if unknown:
            raise ValueError(f"host_inputs names unknown engine inputs: {sorted(unknown)}")

    def spec(self, name: str) -> TensorDesc:
        for t in (*self.engine_inputs, *self.engine_outputs, *self.results):
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def device_bytes(self) -> int:
        tensors = (*self.engine_inputs, *self.engine_outputs, *self.results)
        rows = sum(t.row_bytes for t in tensors)
        table = 3 * 8 if self.max_input_bytes else 0
        return self.max_batch_size * (rows + table) + self.max_input_bytes

    @property
    def pinned_bytes(self) -> int:
        rows = sum(self.spec(n).row_bytes for n in (*self.copy_back, *self.host_inputs))
        table = 3 * 8 if self.max_input_bytes else 0
        return self.max_batch_size * (rows + table) + self.max_input_bytes


@dataclass
class SlotEvents:
    """Recorded on the slot's stream around each phase; CUDA measures the phases."""

    start: Any
    preprocessed: Any
    inferred: Any
    finished: Any  # after the last copy; the slot is idle once it has completed


@dataclass(eq=False)
class Slot:
    """One stream and its buffers; see the module docstring. Build with ``create``."""

    index: int
    device: int
    layout: SlotLayout
    stream: Any
    events: SlotEvents
    engine_inputs: Mapping[str, Any]
    engine_outputs: Mapping[str, Any]
    results: Mapping[str, Any]
    host_results: Mapping[str, np.ndarray]
    host_inputs: Mapping[str, np.ndarray]  # pinned twins of the host-collated inputs
    host_packed: np.ndarray | None = None  # pinned uint8 [max_input_bytes]
    host_table: np.ndarray | None = None  # pinned int64 [max_batch, 3]
    dev_packed: Any = None
    dev_table: Any = None
    context: Any = None  # the engine's, from GpuEngine.create_context
    # Each engine output's and result's row shape in the run last enqueued (what
    # comes back: an output that follows a padded length has the run's).
    run_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # While work is in flight: (the submission running on a worker thread, the
    # future the stream's completion callback resolves). The buffers must not be
    # reused, nor the slot released, until both are done; None when idle.
    pending: tuple[asyncio.Future[Any], asyncio.Future[None]] | None = None

    def __repr__(self) -> str:
        return f"Slot(index={self.index}, device={self.device})"

    @classmethod
    def create(
        cls, index: int, layout: SlotLayout, allocations: Allocations, cupy: Any = None
    ) -> Slot:
        """``cupy``: the CuPy module (or its CPU twin, ``twin``); default CuPy's."""
        if cupy is None:
            cupy = importlib.import_module("cupy")

        def device(shape: tuple[int, ...], dtype: Any) -> Any:
            # zeros, not empty: rows past a short batch (padding up to an engine's
            # minimum batch) then hold finite values, never NaN garbage.
            arr = cupy.zeros(shape, dtype=dtype)
            allocations.record(int(arr.nbytes))
            return arr

        def pinned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            # CuPy's documented recipe: a NumPy view of page-locked memory from
            # CuPy's pinned pool (the array keeps the allocation alive via .base).
            dt = np.dtype(dtype)
            count = math.prod(shape)
            mem = cupy.cuda.alloc_pinned_memory(max(1, count * dt.itemsize))
            arr = np.frombuffer(mem, dtype=dt, count=count).reshape(shape)
            allocations.record(int(arr.nbytes))
            return arr

        n = layout.max_batch_size
        with cupy.cuda.Device(layout.device):
            # non_blocking: no implicit synchronisation with the legacy default
            # stream, so slots overlap with each other and with other libraries.
            stream = cupy.cuda.Stream(non_blocking=True)
            events = SlotEvents(*(cupy.cuda.Event() for _ in range(4)))

            def buffers(tensors: tuple[TensorDesc, ...]) -> dict[str, Any]:
                return {t.name: device((n, *t.fixed_shape), t.dtype) for t in tensors}

            engine_inputs = buffers(layout.engine_inputs)
            engine_outputs = buffers(layout.engine_outputs)
            results = buffers(layout.results)
            host_results = {}
            for name in layout.copy_back:
                spec = layout.spec(name)
                host_results[name] = pinned((n, *spec.fixed_shape), spec.dtype)
            host_inputs = {}
            for name in layout.host_inputs:
                spec = layout.spec(name)
                host_inputs[name] = pinned((n, *spec.fixed_shape), spec.dtype)
            slot = cls(
                index=index,
                device=layout.device,
                layout=layout,
                stream=stream,
                events=events,
                engine_inputs=engine_inputs,
                engine_outputs=engine_outputs,
                results=results,
                host_results=host_results,
                host_inputs=host_inputs,
            )
            if layout.max_input_bytes:
                slot.host_packed = pinned((layout.max_input_bytes,), np.uint8)
                slot.host_table = pinned((n, 3), np.int64)
                slot.dev_packed = device((layout.max_input_bytes,), np.uint8)
                slot.dev_table = device((n, 3), np.int64)
        return slot

    def device_buffer(self, name: str) -> Any:
        buf = self.engine_outputs.get(name)
        return buf if buf is not None else self.results[name]

    def close(self) -> None:
        """Wait for the stream (shutdown only) and drop every buffer and the context."""
        if self.stream is not None:
            self.stream.synchronize()
        self.context = None
        self.engine_inputs = {}
        self.engine_outputs = {}
        self.results = {}
        self.host_results = {}
        self.host_inputs = {}
        self.host_packed = self.host_table = None
        self.dev_packed = self.dev_table = None
        self.stream = None
