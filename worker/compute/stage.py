"""What both inference stages are: batches in, one future per batch out, in the
order the batches were dispatched (so the writer produces results in request
order), end of stream passed on; one failure boundary.

The CPU stage (``cpu``) and the GPU stage (``gpu.stage``) differ only in how a
batch is run, which is the one method they implement (``dispatch``). Everything
else about a batch (which requests need the engine, poison isolation, the
service-time feedback to the batch policy) is ``triage``'s, and what a batch is
run against is the ``Binding`` decided once at start-up: a stage cannot be
built without it (no default binding that would differ from the worker's).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager

import numpy as np

from worker.compute.sequences import SequenceStates
from worker.compute.triage import ServiceTimeHook, report_service_time
from worker.contract import ErrorInfo
from worker.flow.errors import InferenceFailed, WorkerError
from worker.flow.messages import Batch, Completed, Job, TopicPartition
from worker.flow.room import Room
from worker.flow.streams import end_of_stream
from worker.model.inputs.binding import Binding
from worker.model.io import EngineInfo
from worker.obs import backlog, metrics

Described = tuple[str, tuple[int | str | None, ...]] | None  # an output's, where declared


Residence = Callable[[], AbstractAsyncContextManager[ErrorInfo | None]]
"""A model loaded and evicted by demand (``worker.app.demand``; the CPU and the
GPU stage alike): entered around each batch, it holds the model loaded until the
batch is answered (loading it first where it was evicted), or yields why it
cannot run now (every request of the batch answered with that error: unloaded,
or its load failed)."""


class Stage(ABC):
    def __init__(
        self,
        batches_in: asyncio.Queue[Batch[Job] | None],
        completed_out: asyncio.Queue[asyncio.Future[Completed] | None],
        info: EngineInfo,
        binding: Binding,
        *,
        max_attempts: int,
        on_service_time: ServiceTimeHook | None,
        room: Room | None = None,
    ) -> None:
        """``room``: the batcher's (``worker.flow.room``), given back as each
        batch is done, so the next batch is cut when it can start."""
        self.info = info  # what the stage serves, as results name it
        self._batches_in = batches_in
        self._room = room
        self._completed_out = completed_out
        self.binding = binding
        self._inputs = binding.inputs
        self._outputs = binding.outputs
        self._max_attempts = max_attempts
        self._report = report_service_time(on_service_time)
        self._metrics = metrics.model_metrics(info.name, info.version)
        # Its answers per busy second, which its backlog drains at (the lag
        # monitor publishes infer_seconds_to_drain from it). A pipeline's step
        # stages never run here (``run_batch``): the pipeline's own stage times it.
        self._busy = backlog.rate_of(info.name)
        # A stateful model's sequence states, where this stage keeps them (the CPU
        # stage; the GPU path refuses [model.state] when it is planned).
        self.sequences: SequenceStates | None = None

    async def run(self) -> None:
        """Dispatch batches in order until end of stream; each batch's future goes
        downstream as soon as it is dispatched (up to the queue's bound)."""
        async with end_of_stream(self._completed_out):
            while (batch := await self._batches_in.get()) is not None:
                self._metrics.batches(batch.reason).inc()
                self._busy.began(time.monotonic())
                fut = await self.dispatch(batch)
                fut.add_done_callback(self._report)
                fut.add_done_callback(self._timed)
                if self._room is not None:
                    fut.add_done_callback(self._room.give_back)
                metrics.INFLIGHT_BATCHES.inc()  # the writer lowers it once produced
                await self._completed_out.put(fut)

    def _timed(self, fut: asyncio.Future[Completed]) -> None:
        """The batch left the model: its answers count towards the busy rate (a
        failed batch's none, its time still does: the backlog waited through it)."""
        done = not fut.cancelled() and fut.exception() is None
        self._busy.ended(time.monotonic(), len(fut.result().answers) if done else 0)

    @abstractmethod
    async def dispatch(self, batch: Batch[Job]) -> asyncio.Future[Completed]:
        """Start running ``batch``; the future completes with its answers."""

    async def run_batch(self, batch: Batch[Job]) -> Completed:
        """``batch`` run to its answers (a pipeline's step runs its model's stage so)."""
        return await (await self.dispatch(batch))

    # Whether a pipeline may run this stage's model on whole-batch arrays
    # (``run_columns``): a step's rows with no job or answer each.
    columnar = False

    def run_columns(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One run of the model over whole-batch arrays (by request input name,
        rows first), on the caller's thread: its outputs, a row a request.
        ``InferenceFailed`` where it fails. Only where ``columnar``."""
        raise NotImplementedError(f"{type(self).__name__} runs batches of jobs only")

    def described_outputs(self) -> Mapping[str, Described] | None:
        """The outputs a card of its own shows (a pipeline's); None: the model
        file's, as its engine declares them."""
        return None

    def forget(self, revoked: set[TopicPartition]) -> None:  # noqa: B027 (optional hook)
        """Drop what the stage keeps for revoked partitions (a stateful model's
        sequence states); nothing for a stateless one."""

    @abstractmethod
    def close(self) -> None:
        """Stop accepting work and free what the stage holds (threads, slots)."""


@contextlib.contextmanager
def internal_errors_fail_the_run() -> Iterator[None]:
    """The stages' failure boundary around host code that runs per batch
    (collation, postprocessing): anything but our own errors (a bug tripped by
    one odd request) becomes ``InferenceFailed``, so it is isolated like an
    engine failure instead of killing the worker, which would then crash-loop
    on the same record."""
    try:
        yield
    except WorkerError:
        raise
    except Exception as exc:
        raise InferenceFailed(f"internal error: {exc!r}") from exc
