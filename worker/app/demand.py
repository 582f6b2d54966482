"""Memory shared by demand (``repository.on_demand``, issue 68): the repository's
models loaded while they are needed and evicted when another needs the memory,
within ``limits.max_models_memory_mb`` (the host's, measured as each loads) and,
for GPU models, ``limits.max_gpu_models_memory_mb`` (the device's, measured as
each stage starts; every GPU stage starts at start-up and those over the budget
are evicted before Kafka is contacted: ``Residency.settle``). The two budgets
are apart: a model is evicted only to make room in its own.

Every model of the repository was loaded once at start-up, one at a time (bound,
probed and measured: ``worker.app.loading``), and kept while the budget held it;
those that did not fit were closed again. Each keeps its stages either way, so
its requests are read, checked at intake and batched as any model's. A batch of a
model that is not loaded waits in its stage (``CpuStage.residence``) while the
model loads, then runs; its requests' deadlines are judged after the load, so a
request that waited past its deadline is answered ``deadline_exceeded`` as any
other. Its partitions keep being read until its queue fills, then backpressure
pauses them; nothing is committed before it is answered.

Room is made by eviction: the least recently used loaded model that has no
backlog and no batch running, else (every idle model has a backlog) the least
recently used idle one; never a pinned model (``repository.pinned``), never a
model with a batch running (the load waits for one to finish instead). The lag
monitor tells the residency each model's backlog at every poll
(``metrics.lag_interval_ms``): a model not loaded whose topics have a backlog is
loaded then, before its requests reach a batch (prefetch).

The accounting is by measurement: a model counts the most resident memory any of
its loads added (a reload into memory the allocator kept can measure less than
the model holds), its first load at start-up budgeted at its file's size before
it is measured. Room is made before a load for what the model counted so far;
where the load measures more, the others make room after it, so the memory held
goes over the budget by that difference only while it loads: between loads
the loaded models never hold more than the budget as counted so
(``infer_models_memory_used_bytes``, each ``model_loaded`` log line). Should a model's measured
size grow past what the budget can give it beside the pinned and configured
models, it is loaded anyway and the log says so (``model_over_budget``), rather
than its requests waiting for ever.

The control topic (``worker.app.control``) unloads a model with a tombstone: its
requests are then answered ``unknown_model`` saying so (none waits, none is
lost), and a record naming a version loads it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import structlog

from worker.app.loading import LoadedModel, engine_loader
from worker.app.memory import MIB, measured, resident_bytes
from worker.app.residents import LoadFailed, Pool, Resident, Resides, file_stamp, weights
from worker.compute.stage import Stage
from worker.config import Settings
from worker.config.checks import check
from worker.config.model import is_gpu_backend
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.obs import metrics

log = structlog.get_logger(__name__)

def _release(gate: asyncio.Future[None]) -> None:
    if not gate.done():
        gate.set_result(None)


@dataclass(eq=False)
class Residency:
    """The models loaded by demand, and the budgets they share beside those
    loaded for good: the host's and the device's."""

    host: Pool
    residents: list[Resident]  # and the models the control topic brought since (arrive)
    gpu: Pool = field(default_factory=lambda: Pool(0, 0, "gpu"))
    _models: dict[str, Resident] = field(init=False)
    _lock: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    _freed: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _prefetches: dict[str, asyncio.Task[None]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._models = {r.name: r for r in self.residents}
        for r in self.residents:
            r.stage.residence = functools.partial(self.held, r.name)
        self._publish()

    def used(self, device: bool = False) -> int:
        """The bytes the loaded models hold of the host's memory (or the
        device's), as counted (the module's docstring)."""
        pool = self.gpu if device else self.host
        return pool.fixed + sum(r.size for r in self._models.values()
                                if r.loaded and r.device == device)  # fmt: skip

    def settle(self) -> None:
        """At start-up, once every stage started: the GPU models loaded by demand
        evicted down to the device's budget, oldest first (never a pinned one);
        exit 2 where one could never fit beside the GPU models loaded for good and
        the pinned ones."""
        gpu = [r for r in self.residents if r.device]
        if not self.gpu.budget or not gpu:
            return
        kept = self.gpu.fixed + sum(r.size for r in gpu if r.pinned)
        for r in gpu:
            check(r.pinned or kept + r.size <= self.gpu.budget, "limits.max_gpu_models_memory_mb",
                  f"{r.name!r} takes {r.size / MIB:.0f} MiB of the device, which does not fit "
                  f"the budget of {self.gpu.budget / MIB:.0f} MiB beside the GPU models loaded "
                  f"for good and the pinned ones' {kept / MIB:.0f} MiB")  # fmt: skip
        check(kept <= self.gpu.budget, "limits.max_gpu_models_memory_mb", f"the GPU models "
              f"loaded for good and the pinned ones take {kept / MIB:.0f} MiB, over the budget "
              f"of {self.gpu.budget / MIB:.0f} MiB")  # fmt: skip
        for r in gpu:
            if self.used(True) <= self.gpu.budget:
                break
            if not r.pinned:
                self._evict(r, "room")  # at start-up, once every stage started

    def get(self, name: str) -> Resident | None:
        return self._models.get(name)

    @contextlib.asynccontextmanager
    async def held(self, name: str) -> AsyncIterator[ErrorInfo | None]:
        """Around one batch of ``name``: the model loaded (loading it first) and
        kept until the batch is answered; yields why it cannot run, or None: it
        is unloaded (``unknown_model``), or its load failed (``inference_failed``
        naming why: the file gone or broken since start-up; the next batch tries
        again, and the worker goes on serving the other models)."""
        r = self._models[name]
        # Batches enter in the order they were dispatched (each waits for the one
        # before it to be let in): a later batch finding its model loaded must
        # not run before an earlier one still waiting for the load, or a
        # partition's later offsets would be answered by a version (or an
        # unload) its earlier ones then are not.
        before, mine = r.gate, asyncio.get_running_loop().create_future()
        r.gate = mine
        try:
            if before is not None:
                await asyncio.shield(before)
            failed = await self._let_in(r)
        finally:
            if before is not None and not before.done():  # cancelled while it waited:
                before.add_done_callback(lambda _: _release(mine))  # the next after it still
            else:
                _release(mine)
        try:
            yield failed or (ErrorInfo(ErrorCode.UNKNOWN_MODEL, r.refused) if r.refused else None)
        finally:
            r.in_use -= 1
            r.last_used = time.monotonic()
            self._freed.set()  # a load waiting for room looks again

    async def _let_in(self, r: Resident) -> ErrorInfo | None:
        """``r`` loaded for one batch (loading it first) and counted in use; the
        error to answer the batch with where its load failed."""
        failed: ErrorInfo | None = None
        if not r.settled():  # (a load leaves it loaded, or unloaded meanwhile)
            try:
                await self._load(r, "demand")
            except LoadFailed as exc:
                failed = ErrorInfo(ErrorCode.INFERENCE_FAILED,
                                   f"model {r.name!r} could not be loaded: {exc}")  # fmt: skip
        # No await between the load's end and this count: nothing evicts it between.
        r.in_use += 1
        return failed

    def observe(self, backlogs: Mapping[str, int]) -> None:
        """The lag monitor's poll: each model's backlog; a model not loaded with
        one is loaded now (prefetch), before its requests reach a batch."""
        for r in self._models.values():
            r.backlog = backlogs.get(r.name, 0)
            if r.backlog > 0 and not r.settled() and r.name not in self._prefetches:
                task = asyncio.create_task(self._load(r, "backlog"), name=f"prefetch-{r.name}")
                self._prefetches[r.name] = task
                task.add_done_callback(functools.partial(self._prefetched, r.name))

    def _prefetched(self, name: str, task: asyncio.Task[None]) -> None:
        del self._prefetches[name]
        if not task.cancelled() and (exc := task.exception()) is not None:
            # Its next batch loads it again and fails where it fails (named there).
            log.error("model_prefetch_failed", task=task.get_name(), error=repr(exc))

    async def _load(self, r: Resident, reason: str) -> None:
        """``r`` loaded (room made first), unless loaded or refused meanwhile;
        ``LoadFailed`` where it does not load (nothing evicted for a load that
        failed lately with the same file)."""
        async with self._lock:
            if r.settled():
                return
            if (why := r.failing()) is not None:
                raise LoadFailed(why)
            await self._make_room(r, r.size)
            if r.settled():  # a tombstone came while it waited for room
                return
            started = time.monotonic()
            try:
                size = await self._engine_in(r)
            except Exception as exc:  # the load's, whatever the runtime raises
                r.failed = (file_stamp(r.settings), time.monotonic(), str(exc))
                log.error("model_load_failed", model=r.name, reason=reason, error=repr(exc))
                metrics.MODEL_LOADS.labels(r.name, "failed").inc()
                raise LoadFailed(str(exc)) from exc
            r.failed = None
            seconds = time.monotonic() - started
            r.size = max(r.size, size)
            # Measured over its estimate: the others make room after it (the
            # memory held went over the budget by the difference while it loaded).
            await self._make_room(r, 0)
            self._loaded(r, reason, seconds)

    async def _engine_in(self, r: Resident) -> int:
        """``r``'s serving version's engine loaded into its stage; the bytes it
        holds (a GPU model: what its stage took of the device and its weights)."""
        load = engine_loader(r.settings)
        if r.device:  # its stage measures what it takes of the device
            engine = await asyncio.to_thread(load)
            return await asyncio.to_thread(r.stage.load, engine) + weights(r.settings)
        engine, size = await measured(load)
        r.stage.load(engine)
        return size

    def _loaded(self, r: Resident, reason: str, seconds: float) -> None:
        r.loads += 1
        r.last_used = time.monotonic()
        metrics.MODEL_LOADS.labels(r.name, reason).inc()
        metrics.MODEL_LOAD_SECONDS.labels(r.name).observe(seconds)
        metrics.MODEL_MEMORY.labels(model=r.name, version=r.stage.info.version).set(r.size)
        log.info("model_loaded", model=r.name, reason=reason, seconds=round(seconds, 3),
                 size_mib=round(r.size / MIB, 1), memory="gpu" if r.device else "host",
                 used_mib=round(self.used(r.device) / MIB, 1))  # fmt: skip
        self._publish()

    async def _make_room(self, r: Resident | None, need: int) -> None:
        """Evict until ``need`` more bytes fit the budget (the lock held): the
        module's docstring says whom, and when it waits. ``r``: the model the
        room is for (None: one the control topic brings, on the host)."""
        device = r is not None and r.device
        budget = (self.gpu if device else self.host).budget
        while budget and self.used(device) + need > budget:
            victim = self._victim(r, device)
            if victim is not None:
                self._evict(victim, "room")
                continue
            busy = [m for m in self._models.values() if m is not r and m.loaded
                    and not m.pinned and m.device == device]  # fmt: skip
            if not busy:  # nothing left to evict: grown past what the budget gives it
                log.warning("model_over_budget", model=r.name if r else None,
                            size_mib=round(need / MIB, 1),
                            used_mib=round(self.used(device) / MIB, 1),
                            budget_mib=round(budget / MIB, 1))  # fmt: skip
                return
            self._freed.clear()
            await self._freed.wait()  # a batch ended: look again

    def _victim(self, r: Resident | None, device: bool) -> Resident | None:
        idle = [m for m in self._models.values() if m is not r and m.loaded and not m.pinned
                and m.in_use == 0 and m.device == device]  # fmt: skip
        return min(idle, key=lambda m: (m.backlog > 0, m.last_used), default=None)

    def _evict(self, r: Resident, reason: str) -> None:
        r.stage.evict()
        metrics.MODEL_EVICTIONS.labels(r.name, reason).inc()
        log.info("model_evicted", model=r.name, reason=reason, backlog=r.backlog,
                 size_mib=round(r.size / MIB, 1), memory="gpu" if r.device else "host",
                 used_mib=round(self.used(r.device) / MIB, 1))  # fmt: skip
        self._publish()

    # --- the control topic's changes (worker.app.control) -------------------------

    async def unload(self, name: str, why: str) -> None:
        """``name`` not served (a tombstone): its next batches answered ``why``,
        its running ones finished, then its memory freed."""
        r = self._models[name]
        r.refused = why
        async with self._lock:
            while r.in_use:
                self._freed.clear()
                await self._freed.wait()
            if r.loaded:
                self._evict(r, "control")

    async def served(self, name: str) -> None:
        """``name`` served again (a record naming its serving version), loaded now."""
        r = self._models[name]
        r.refused = None
        await self._load(r, "control")

    async def swapping(self, name: str, swap: Callable[[], Awaitable[str | None]],
                       settings: Settings) -> str | None:  # fmt: skip
        """``swap()`` (the version of ``settings`` loaded beside the serving one,
        checked and swapped in: ``worker.app.reload.swap``; why not, or None)
        with room made for it first (the more of the serving version's size and
        the new file's). Swapped in, it counts at what the swap added to the
        memory held (the new version loaded, the old one freed) over what the
        old one counted, at least its file's size."""
        r = self._models[name]
        hint = weights(settings)
        async with self._lock:
            await self._make_room(r, max(r.size, hint))
            was = r.loaded
            before = resident_bytes()
            problem = await swap()
            after = resident_bytes()
            if problem is None:
                grown = after - before if before is not None and after is not None else 0
                r.size = max(hint, (r.size if was else 0) + grown)
                await self._make_room(r, 0)  # over its estimate: the others after it
                if r.loaded and not was:
                    self._loaded(r, "control", 0.0)
                self._publish()
            return problem

    async def arrive(
        self, hint: int, load: Callable[[], Awaitable[tuple[Resident, float]]]
    ) -> Resident:
        """A model the control topic brings (``worker.app.arrivals``): room made
        for ``hint`` bytes (its file) in the host's budget, then ``load()`` (its
        engine loaded and measured, bound, its stages built: the resident and
        the seconds its load took), from then on a resident as any, room made
        after it where it measured more. Its engine is closed here at shutdown."""
        async with self._lock:
            await self._make_room(None, hint)
            r, seconds = await load()
            self.residents.append(r)
            self._models[r.name] = r
            r.stage.residence = functools.partial(self.held, r.name)
            await self._make_room(r, 0)
            self._loaded(r, "control", seconds)
            return r

    async def close(self, timeout: float = 30.0) -> None:
        """At shutdown, every batch answered: the prefetches under way finished
        (a load runs on a thread, which cancelling would not stop: the stages
        must not close under it), then the engines loaded here closed (those
        loaded at start-up are their loader's: ``worker.app.loading``)."""
        if self._prefetches:
            await asyncio.wait(list(self._prefetches.values()), timeout=timeout)
        for task in list(self._prefetches.values()):
            task.cancel()
        async with self._lock:
            for r in self.residents:
                if r.loads and r.loaded:
                    r.stage.evict()

    def _publish(self) -> None:
        for r in self._models.values():
            metrics.MODEL_LOADED.labels(r.name).set(1 if r.loaded else 0)
        metrics.MODELS_MEMORY_USED.set(self.used())
        metrics.GPU_MODELS_MEMORY_USED.set(self.used(True))


def residency(
    s: Settings,
    models: Sequence[LoadedModel],
    stages: Mapping[str, Stage],
    controlled: Collection[str] = (),
    device_memory: Mapping[str, int] | None = None,
    grows: bool = False,
) -> Residency | None:
    """The residency of the models loaded by demand and of those the control
    topic may unload (``controlled``: without ``repository.on_demand`` these are
    never evicted for room, the budget having been checked at start-up), or None.
    ``device_memory``: what each GPU stage took of the device as it started.
    ``grows``: the control topic may bring models (a residency, even empty)."""
    device_memory = device_memory or {}
    chosen = [m for m in models if m.on_demand or m.name in controlled]
    if not chosen and not grows:
        return None
    demand, limits = s.repository.on_demand, s.limits
    # A GPU model's host memory (its runtime, its weights' host copy) stays: counted
    # as loaded for good; its device memory is what it is loaded and evicted for.
    on_host = {m.name for m in chosen if not is_gpu_backend(m.settings.model.backend)}
    host = Pool(limits.max_models_memory_mb * MIB if demand else 0,
                sum(m.size for m in models if m.name not in on_host))  # fmt: skip
    gpu = Pool(limits.max_gpu_models_memory_mb * MIB if demand else 0,
               sum(size for ring, size in device_memory.items() if ring not in
                   {m.name for m in chosen}), "gpu")  # fmt: skip
    residents = []
    for m in chosen:
        device = m.name not in on_host
        residents.append(Resident(
            m.name, cast(Resides, stages[m.name]), m.settings,
            device_memory.get(m.name, 0) + weights(m.settings) if device else m.size,
            device=device, pinned=m.name in s.repository.pinned,
        ))  # fmt: skip
    return Residency(host, residents, gpu)
