"""Helpers for the GPU tests: jobs, batches, driving a stage, and small CuPy engines.

The engines implement ``worker.compute.engines.gpu.GpuEngine`` with raw CuPy kernels, so
the stage is tested on a GPU without torch or TensorRT, and without mocking the
stage itself: a real stream, real kernels, real copies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker.compute.engines.base import EngineSlot
from worker.config import BatchingConfig, GpuConfig, LimitsConfig, ModelConfig
from worker.contract import EncodedImage, Request, sniff_format
from worker.flow.errors import InferenceFailed
from worker.flow.messages import Batch, Completed, Job, TopicPartition
from worker.model.inputs import ModelInputs, bind_model
from worker.model.io import EngineInfo, ModelIO, TensorDesc
from worker.model.shapes import SlotShapes

F32 = np.dtype(np.float32)


def make_jobs(images: Sequence[np.ndarray | bytes], *, deadline: float | None = None) -> list[Job]:
    """One job per image: a uint8 [H, W, C] tensor, or an image file (bytes) as the
    contract carries it (format from its magic bytes)."""
    now = time.monotonic()
    jobs = []
    for i, image in enumerate(images):
        job = Job(
            tp=TopicPartition("gpu-test", 0), offset=i, key=None, arrived=now, deadline=deadline
        )
        if isinstance(image, bytes):
            fmt = sniff_format(image)
            assert fmt is not None, "not an image file"
            job.inputs["image"] = EncodedImage(fmt, image)
        else:
            job.inputs["image"] = image
        jobs.append(job)
    return jobs


def request_jobs(inputs: ModelInputs, requests: Sequence[dict[str, Any]]) -> list[Job]:
    """One job per request's inputs, checked as intake checks them."""
    out = []
    for i, given in enumerate(requests):
        request = Request(v=1, id=str(i), inputs=given)
        values, lengths = inputs.check(request)
        out.append(Job(TopicPartition("gpu-any", 0), i, None, time.monotonic(), None,
                       request=request, inputs=values, lengths=lengths))  # fmt: skip
    return out


def info(
    name: str, inputs: Sequence[TensorDesc], outputs: Sequence[TensorDesc], rows: int
) -> EngineInfo:
    io = ModelIO(tuple(inputs), tuple(outputs))
    return EngineInfo("cupy", name, "0", io, rows)


def host_array(batch: Any) -> np.ndarray:
    """A fake engine's CPU ``run`` takes feeds (the protocol) or the image array."""
    return np.asarray(batch["image"] if isinstance(batch, dict) else batch)


def batches_of(jobs: Sequence[Job], sizes: Sequence[int]) -> list[Batch[Job]]:
    """Cut ``jobs`` into batches of the given sizes, cycling through ``sizes``."""
    out: list[Batch[Job]] = []
    start = 0
    i = 0
    while start < len(jobs):
        size = sizes[i % len(sizes)]
        out.append(
            Batch(items=list(jobs[start : start + size]), formed_at=time.monotonic(),
                  reason="full", seq=len(out) + 1)
        )  # fmt: skip
        start += size
        i += 1
    return out


Source = asyncio.Queue[Batch[Job] | None]
Sink = asyncio.Queue[asyncio.Future[Completed] | None]


def queues() -> tuple[Source, Sink]:
    """The two queues a stage is built with (the pipeline's contract)."""
    return asyncio.Queue(), asyncio.Queue()


async def run_stage(
    stage: Any, source: Source, sink: Sink, batches: Sequence[Batch[Job]]
) -> list[Completed]:
    """Feed ``batches`` and end of stream to a stage (GPU or CPU: same contract),
    collect its futures in dispatch order and await them."""
    for batch in batches:
        source.put_nowait(batch)
    source.put_nowait(None)
    runner = asyncio.create_task(stage.run())
    futures: list[asyncio.Future[Completed]] = []
    while (fut := await sink.get()) is not None:
        futures.append(fut)
    await runner
    return [await asyncio.wait_for(f, 60) for f in futures]


_LINEAR = r"""
extern "C" __global__ void linear(const float* x, const float* w, const float* b, float* y,
                                  int n, int in_f, int out_f) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * out_f) return;
    int r = i / out_f, o = i - (i / out_f) * out_f;
    float acc = b[o];
    for (int k = 0; k < in_f; ++k) acc += x[r * in_f + k] * w[k * out_f + o];
    y[i] = acc;
}
"""


@dataclass
class LinearEngine:
    """logits = flatten(x) @ w + b, one thread per logit, on the slot's stream."""

    w: np.ndarray  # [in_features, classes] float32
    b: np.ndarray  # [classes]
    row_shape: tuple[int, ...]
    max_batch_size: int = 64
    device: int = 0
    min_batch_size: int = 1
    fail_next: Exception | None = None  # raised by the next enqueue
    fail_runs: int = 0  # this many enqueues after fail_next raise InferenceFailed
    enqueued: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        import cupy

        self.inputs = (TensorDesc("image", F32, self.row_shape),)
        self.outputs: tuple[TensorDesc, ...] = (TensorDesc("logits", F32, (self.w.shape[1],)),)
        self.info = info("linear", self.inputs, self.outputs, self.max_batch_size)
        self._w = cupy.asarray(self.w, dtype=cupy.float32)
        self._b = cupy.asarray(self.b, dtype=cupy.float32)
        self._kernel = cupy.RawKernel(_LINEAR, "linear")
        self._kernel.compile()  # now, not inside the first timed batch

    def prepare(self, shapes: SlotShapes) -> None:
        pass

    def create_context(self, slot: EngineSlot) -> None:
        return None

    def enqueue(self, slot: EngineSlot, batch_size: int, lengths: Any) -> dict[str, Any]:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        if self.fail_runs > 0:
            self.fail_runs -= 1
            raise InferenceFailed("engine rejected the batch")
        self.enqueued.append(batch_size)
        out_f = self.w.shape[1]
        total = batch_size * out_f
        args = (
            slot.engine_inputs["image"], self._w, self._b, slot.engine_outputs["logits"],
            np.int32(batch_size), np.int32(self.w.shape[0]), np.int32(out_f),
        )  # fmt: skip
        with slot.stream:
            self._kernel(((total + 127) // 128,), (128,), args)
        return {"logits": (out_f,)}

    def run(self, batch: Any) -> dict[str, np.ndarray]:
        x = host_array(batch)
        x = x.reshape(x.shape[0], -1).astype(np.float32)
        return {"logits": x @ self.w + self.b}

    def close(self) -> None:
        pass


_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns, float* y, int n) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = (float)(i % 7);
}
"""


@dataclass
class SpinContext:
    start: Any  # cupy.cuda.Event, recorded when the spin kernel is enqueued
    end: Any


@dataclass
class SpinEngine:
    """Busy-waits ``seconds`` on the GPU per batch, between two events of its own,
    so tests can see from CUDA timestamps whether two slots ran at once."""

    seconds: float
    classes: int = 10
    row_shape: tuple[int, ...] = (1, 8, 8)
    max_batch_size: int = 8
    device: int = 0
    min_batch_size: int = 1

    def __post_init__(self) -> None:
        import cupy

        self.inputs = (TensorDesc("image", F32, self.row_shape),)
        self.outputs: tuple[TensorDesc, ...] = (TensorDesc("logits", F32, (self.classes,)),)
        self.info = info("spin", self.inputs, self.outputs, self.max_batch_size)
        self._kernel = cupy.RawKernel(_SPIN, "spin")
        self._kernel.compile()  # now, not inside the first timed batch

    def prepare(self, shapes: SlotShapes) -> None:
        pass

    def create_context(self, slot: EngineSlot) -> SpinContext:
        import cupy

        with cupy.cuda.Device(slot.device):
            return SpinContext(cupy.cuda.Event(), cupy.cuda.Event())

    def enqueue(self, slot: EngineSlot, batch_size: int, lengths: Any) -> dict[str, Any]:
        ctx: SpinContext = slot.context
        ns = np.uint64(int(self.seconds * 1e9))
        n = np.int32(batch_size * self.classes)
        ctx.start.record(slot.stream)
        with slot.stream:
            self._kernel((1,), (32,), (ns, slot.engine_outputs["logits"], n))
        ctx.end.record(slot.stream)
        return {"logits": (self.classes,)}

    def run(self, batch: Any) -> dict[str, np.ndarray]:
        raise InferenceFailed("spin engine has no host path")

    def close(self) -> None:
        pass


@dataclass
class IdentityEngine:
    """Outputs its input row ("pixels", flattened, float32): a test reads back exactly
    what preprocessing produced on the device. A device copy on the slot's stream."""

    row_shape: tuple[int, ...]
    max_batch_size: int = 64
    device: int = 0
    min_batch_size: int = 1

    def __post_init__(self) -> None:
        size = int(np.prod(self.row_shape))
        self.inputs = (TensorDesc("image", F32, self.row_shape),)
        self.outputs: tuple[TensorDesc, ...] = (TensorDesc("pixels", F32, (size,)),)
        self.info = info("identity", self.inputs, self.outputs, self.max_batch_size)

    def prepare(self, shapes: SlotShapes) -> None:
        pass

    def create_context(self, slot: EngineSlot) -> None:
        return None

    def enqueue(self, slot: EngineSlot, batch_size: int, lengths: Any) -> dict[str, Any]:
        src = slot.engine_inputs["image"][:batch_size].reshape(batch_size, -1)
        with slot.stream:
            slot.engine_outputs["pixels"][:batch_size] = src
        return {"pixels": self.outputs[0].shape}

    def run(self, batch: Any) -> dict[str, np.ndarray]:
        x = host_array(batch)
        return {"pixels": x.reshape(x.shape[0], -1).astype(np.float32)}

    def close(self) -> None:
        pass


def gpu_stage(
    source: Any,
    sink: Any,
    engine: Any,
    model: ModelConfig,
    max_batch_size: int,
    num_slots: int,
    gpu: GpuConfig | None = None,
    *,
    batching: BatchingConfig | None = None,
    **kwargs: Any,
) -> Any:
    """A GPU stage over ``engine``, bound as the worker binds it (``bind_model``)."""
    from worker.compute.gpu.stage import GpuStage

    binding = bind_model(model, engine.info.io, LimitsConfig(), batching)
    return GpuStage(
        source, sink, engine, binding, max_batch_size=max_batch_size, num_slots=num_slots,
        gpu=gpu or GpuConfig(), **kwargs,
    )  # fmt: skip
