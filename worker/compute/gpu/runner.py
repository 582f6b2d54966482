"""The loop side of a run on one slot: the GPU stage's work handed to a stage
thread, then awaited until the slot's stream is idle.

The launcher (``launch``) enqueues on the thread; the watch (``completion``)
knows when the stream is done and what a device failure means. Between them,
this is where a slot is marked busy before the first await (so a cancelled
batch releases it only once its work has finished), where a failure the
thread reports becomes the stage's (``EngineDead`` kills it), and where a
chunk's rows are read back out of pinned memory. Both of the stage's paths run
through here: a batch of requests (``GpuStage.run_rows``) and a pipeline step's
columns (``GpuStage.run_device_columns``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from worker.compute.engines.cuda import translate_gpu_error
from worker.compute.gpu.completion import SlotWatch
from worker.compute.gpu.launch import Chunk, Launcher
from worker.compute.gpu.nvjpeg import NvJpeg
from worker.compute.gpu.slots import DeviceImage, Slot
from worker.flow.errors import EngineDead
from worker.model.rows import Row
from worker.obs.metrics import ModelMetrics


class SlotRunner:
    """Runs a GPU stage's chunks on its slots, on its threads (``pool``)."""

    def __init__(self, pool: ThreadPoolExecutor, launcher: Launcher, watch: SlotWatch,
                 metrics: ModelMetrics, decoder: NvJpeg | None) -> None:  # fmt: skip
        self._pool = pool
        self._launcher = launcher
        self._watch = watch
        self._metrics = metrics
        self._nvjpeg = decoder

    async def run(self, slot: Slot, chunk: Any,
                  enqueue: Callable[[Slot, Any], float] | None = None) -> float:  # fmt: skip
        """``chunk`` enqueued on ``slot``'s stream (on a stage thread) and run to
        the end: returns its host seconds once the stream is idle."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        submission = loop.run_in_executor(self._pool, self._launcher.submit, slot, chunk,
                                          (loop, woken), enqueue)  # fmt: skip
        # Marked busy before the first await: if this task is cancelled now, the
        # slot is released only after the submission and the stream have finished.
        slot.pending = (submission, woken)
        try:
            host_seconds, error = await asyncio.shield(submission)
        except EngineDead as exc:
            raise self._watch.die(exc) from None
        if isinstance(error, EngineDead):
            raise self._watch.die(error)
        await self._watch.wait(slot, woken)
        slot.pending = None
        if error is not None:
            raise error
        return host_seconds

    async def run_chunk(
        self, slot: Slot, chunk: Chunk
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """A chunk of requests run on ``slot``: its outputs copied out of pinned
        memory (the slot may be reused after this) and its phase times."""
        loop = asyncio.get_running_loop()
        host_seconds = await self.run(slot, chunk)
        n = len(chunk.answers)
        try:
            outputs, timing = await loop.run_in_executor(
                self._pool, self._launcher.collect, slot, n, host_seconds
            )
        except Exception as exc:  # boundary: reading events can report a device error
            raise self._watch.die(translate_gpu_error(exc, f"slot {slot.index}: collect")) from exc
        m = self._metrics
        m.batch_size.observe(n)
        m.preprocess_seconds.observe(timing["preprocess"] / 1e6)
        m.engine_seconds.observe(timing["infer"] / 1e6)
        m.d2h_seconds.observe(timing["d2h"] / 1e6)
        return outputs, timing

    async def decode(
        self, slot: Slot, answers: list[Row], on_device: dict[int, DeviceImage], image: str
    ) -> tuple[list[Row], float]:
        """nvJPEG on a stage thread, the slot marked busy meanwhile."""
        assert self._nvjpeg is not None
        decoding = asyncio.get_running_loop().run_in_executor(
            self._pool, self._nvjpeg.decode_answers, slot, answers, on_device, image
        )
        return await self._watch.hold(slot, decoding)
