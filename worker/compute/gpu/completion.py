"""Knowing when a slot's work is done, and what a device failure means.

Completion: a host function enqueued after a chunk's last copy
(``Stream.launch_host_func``) hands the loop a wake-up with
``call_soon_threadsafe`` the moment the stream reaches it (``launch``). Polling
the event instead would add up to a millisecond per batch (asyncio's selector
cannot sleep less than that) or burn a core spinning. CUDA does not call it
after a context error, so a slow poll of the event's status
(``cudaEventQuery``, every ``gpu.poll_interval_ms``) runs behind it as a safety
net: it turns a sticky device error into ``EngineDead``, and a hung device into
``EngineDead`` after ``gpu.batch_timeout_ms``, rather than a stage that waits
for ever. Once dead, the ring is closed: every waiting and later batch fails.

A slot is released to the ring only once its stream is idle: a batch cancelled
while its work was in flight keeps the slot until that work has finished.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import structlog

from worker.compute.engines.cuda import event_completed, translate_gpu_error
from worker.compute.gpu.slots import Slot, SlotRing
from worker.flow.deadline import Deadline
from worker.flow.errors import EngineDead, WorkerError

Done = TypeVar("Done")

log = structlog.get_logger(__name__)


class SlotWatch:
    """Completion and failure of the slots of one GPU stage."""

    def __init__(
        self, cupy: Any, ring: SlotRing[Slot], poll_interval_s: float, batch_timeout_s: float
    ) -> None:
        self._cupy = cupy
        self._ring = ring
        self._poll_interval_s = poll_interval_s
        self._batch_timeout_s = batch_timeout_s
        self.dead: EngineDead | None = None
        self._background: set[asyncio.Task[None]] = set()

    def batch_done(self, slot: Slot, task: asyncio.Future[Any] | None = None) -> None:
        """Release the slot once its stream is idle. A batch cancelled while its
        work was in flight keeps the slot until that work has finished."""
        if self.dead is not None:
            return  # the device is gone: the slot is never reused
        if slot.pending is None:
            self._ring.release(slot)
            return
        bg = asyncio.get_running_loop().create_task(self._release_when_idle(slot))
        self._background.add(bg)
        bg.add_done_callback(self._background.discard)

    async def _release_when_idle(self, slot: Slot) -> None:
        assert slot.pending is not None
        submission, woken = slot.pending
        await asyncio.wait((submission,))
        if submission.cancelled() or submission.exception() is not None:
            return  # the submission itself failed: the device is dead
        try:
            await self.wait(slot, woken)
        except WorkerError as exc:
            log.error("slot_lost", slot=slot.index, error=str(exc))
            return
        slot.pending = None
        self._ring.release(slot)

    async def wait(self, slot: Slot, woken: asyncio.Future[None]) -> None:
        """Until the slot's ``finished`` event has completed, without blocking the
        loop: normally the completion callback resolves ``woken``; the event is
        queried every poll interval in case it never does (see module doc)."""
        budget = Deadline(self._batch_timeout_s)
        while not woken.done():
            await asyncio.wait((woken,), timeout=self._poll_interval_s)
            if woken.done():
                break
            try:
                # On the slot's device: this (loop) thread's current device may be
                # another one, or have no context yet.
                with self._cupy.cuda.Device(slot.device):
                    completed = event_completed(self._cupy, slot.events.finished)
                if completed:
                    break  # finished; the callback is merely late
            except WorkerError as exc:
                raise self.die(exc) from None
            except Exception as exc:  # boundary: CuPy raises CUDARuntimeError
                raise self.die(translate_gpu_error(exc, f"slot {slot.index}")) from exc
            if budget.expired:
                raise self.die(
                    EngineDead(
                        f"slot {slot.index}: batch still running after {self._batch_timeout_s}s"
                    )
                )

    async def hold(self, slot: Slot, work: asyncio.Future[Done]) -> Done:
        """``work`` on a stage thread that leaves nothing queued on ``slot``'s
        stream (an nvJPEG decode): the slot is marked busy until it returns (a
        cancelled batch releases it only once it has); an ``EngineDead`` kills
        the stage."""
        idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        idle.set_result(None)  # nothing queued on the slot's stream to wait for
        slot.pending = (work, idle)
        try:
            result = await asyncio.shield(work)
        except EngineDead as exc:
            slot.pending = None
            raise self.die(exc) from None
        except BaseException:
            if work.done():
                slot.pending = None
            raise
        slot.pending = None
        return result

    def die(self, error: WorkerError) -> WorkerError:
        """Record a dead device (the first ``EngineDead``) and close the ring;
        returns ``error`` for the caller to raise."""
        if isinstance(error, EngineDead) and self.dead is None:
            self.dead = error
            log.error("gpu_engine_dead", error=str(error))
            self._ring.close(error)
        return error
