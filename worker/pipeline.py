"""Worker: builds the stages, links them with bounded queues, owns their tasks.

    KafkaSource -> [jobs] -> MicroBatcher -> [batches] -> InferenceStage
        -> [futures, dispatch order] -> ResultSink -> OffsetTracker -> Committer

Each stage gets its input queue and downstream handle in its constructor; end of
stream (``None``) flows down the same queues, so shutdown drains stage by stage.
A stage task that dies fails the whole worker (it stops fetching, commits only
what was acknowledged and exits non-zero): a dead engine must stop commits,
never hang silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import typing
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka.errors import KafkaError

from . import metrics
from .backpressure import Backpressure
from .batching import Batch, BatchPolicy, MicroBatcher
from .budget import FailureBudget
from .codec import ModelInfo
from .commit import Committer, OffsetTracker, TopicPartition
from .config import Settings
from .consume import Job, JobFactory, KafkaSource
from .engines import Engine, load_engine
from .errors import BrokerUnavailable
from .infer import Completed, InferenceStage
from .produce import ResultSink

if TYPE_CHECKING:
    from .engines.gpu import GpuEngine
    from .gpu_stage import GpuInferenceStage

log = structlog.get_logger(__name__)


class Worker:
    def __init__(self, settings: Settings, engine: Engine | GpuEngine | None = None) -> None:
        self.settings = settings
        self._engine = engine
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: BaseException | None = None
        self._stopped = asyncio.Event()
        self._started = False
        self.tracker = OffsetTracker()

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        if self._engine is None:
            self._engine = await asyncio.to_thread(self._load_engine)
        engine = self._engine
        b = s.batching
        self.jobs: asyncio.Queue[Job | None] = asyncio.Queue(b.queue_capacity)
        batches: asyncio.Queue[Batch[Job] | None] = asyncio.Queue(1)
        completed: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue(
            b.max_inflight_batches
        )
        self.policy: BatchPolicy[Job] = BatchPolicy(
            b.max_batch_size, b.max_queue_delay_ms / 1000.0, b.preferred_batch_sizes
        )
        self.backpressure = Backpressure(b.max_inflight_records, b.max_inflight_bytes)
        self.source = KafkaSource(
            s.kafka,
            JobFactory(s.model, s.limits),
            self.jobs,
            self.tracker,
            self._on_revoke,
            self.backpressure,
        )
        self.committer = Committer(
            self.tracker, self.source, timeout=s.kafka.request_timeout_ms / 1000.0
        )
        self.batcher = MicroBatcher(self.jobs, batches, self.policy)
        self.infer = await self._inference_stage(batches, completed, engine)
        model_info = ModelInfo(name=engine.info.name, version=engine.info.version)
        self.sink = ResultSink(
            completed,
            s.kafka,
            model_info,
            self.tracker,
            self.committer,
            max_pending_acks=2 * b.max_inflight_batches,
            budget=FailureBudget(s.dlq.max_consecutive, s.dlq.max_ratio, s.dlq.window),
        )
        try:
            await self.sink.start()
            await self.source.start()
        except KafkaError as exc:  # translated once, at the boundary
            await self._close()
            raise BrokerUnavailable(
                f"cannot reach Kafka at {s.kafka.bootstrap_servers}: {exc!r}"
            ) from exc
        except BaseException:
            await self._close()
            raise
        self._started = True
        log.info(
            "worker_started",
            engine=engine.info.backend,
            model=engine.info.name,
            version=engine.info.version,
            topics=list(s.kafka.input_topics),
            group=s.kafka.group_id,
        )
        metrics.set_condition("started", True)
        self._spawn(self.source.run(), "consume")
        self._spawn(self.batcher.run(), "batch")
        self._spawn(self.infer.run(), "infer")
        self._spawn(self.sink.run(), "produce")
        self._spawn(self.committer.run(), "commit")
        self._spawn(self._probe_broker(), "probe")

    @property
    def _on_gpu(self) -> bool:
        return self.settings.model.backend in ("tensorrt", "torch")

    def _load_engine(self) -> Engine | GpuEngine:
        s = self.settings
        if not self._on_gpu:
            return load_engine(s.model)
        from .engines.gpu import load_gpu_engine

        return load_gpu_engine(
            s.model,
            device=s.gpu.device,
            max_batch_size=s.batching.max_batch_size,
            cuda_graphs=s.gpu.cuda_graphs,
        )

    async def _inference_stage(
        self,
        batches: asyncio.Queue[Batch[Job] | None],
        completed: asyncio.Queue[asyncio.Future[Completed] | None],
        engine: Engine | GpuEngine,
    ) -> InferenceStage | GpuInferenceStage:
        """The CPU stage, or the GPU stage with its slot ring (allocated here, once,
        off the event loop: kernel compilation and engine contexts take a while)."""
        s, b = self.settings, self.settings.batching
        if not self._on_gpu:
            return InferenceStage(
                batches,
                completed,
                engine,
                s.model,
                b.max_batch_size,
                b.max_inflight_batches,
                self.policy,
                max_attempts=b.max_attempts,
            )
        from .gpu_stage import GpuInferenceStage, GpuOptions, isolate

        g = s.gpu
        options = GpuOptions(
            num_slots=g.num_slots or b.max_inflight_batches,
            max_batch_size=b.max_batch_size,
            max_input_bytes=g.max_input_bytes,
            device=g.device,
            preprocess=s.model.preprocess.device,
            poll_interval_s=g.poll_interval_ms / 1000.0,
            batch_timeout_s=g.batch_timeout_ms / 1000.0,
        )
        stage = await asyncio.to_thread(
            GpuInferenceStage,
            batches,
            completed,
            typing.cast("GpuEngine", engine),
            s.model,
            b.max_batch_size,
            b.max_inflight_batches,
            self.policy,
            options=options,
            on_failure=isolate(b.max_attempts),
        )
        log.info(
            "gpu_stage_ready",
            device=g.device,
            slots=options.num_slots,
            preprocess=options.preprocess,
        )
        return stage

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._on_task_done)
        self._tasks.append(task)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._failure is None:
            self._failure = exc
            log.error("stage_failed", stage=task.get_name(), error=repr(exc))
            metrics.set_condition("started", False)
            self.source.stop_fetching()
            self._stopped.set()
        elif task.get_name() == "produce":
            self._stopped.set()  # the stream drained to its end

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    async def wait(self) -> None:
        """Until a stage fails or the stream has drained after ``stop()`` began."""
        await self._stopped.wait()

    async def stop(self, drain_timeout: float | None = None) -> bool:
        """Stop fetching, drain in-flight work, commit what was acknowledged, leave
        the group. Returns True when everything drained within the deadline."""
        if not self._started:
            await self._close()
            return True
        self._started = False
        timeout = (
            self.settings.shutdown.drain_timeout_ms / 1000.0
            if drain_timeout is None
            else drain_timeout
        )
        metrics.set_condition("started", False)
        self.source.stop_fetching()
        pipeline = [t for t in self._tasks if t.get_name() not in ("commit", "probe")]
        if any(t.get_name() == "produce" and t.done() for t in self._tasks):
            # The produce stage died (failure budget, engine dead, delivery failed):
            # nothing still upstream can be acknowledged, and the stages feeding it
            # block on its full queue, so waiting for them would only delay the exit
            # by the whole drain timeout.
            timeout = 0.0
        started = time.monotonic()
        _, pending = await asyncio.wait(pipeline, timeout=timeout) if pipeline else (set(), set())
        drained = not pending and self._failure is None
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # Only acknowledged offsets are below the watermark, so this final commit
        # is safe even when draining failed or timed out.
        await self.committer.commit_now()
        self.committer.stop()
        for task in self._tasks:
            if task.get_name() == "probe":
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close()
        log.info(
            "worker_stopped",
            drained=drained,
            drain_seconds=round(time.monotonic() - started, 3),
            uncommitted=self.tracker.in_flight(),
        )
        return drained

    async def _close(self) -> None:
        for closer in ("source", "sink"):
            stage = getattr(self, closer, None)
            if stage is not None:
                with contextlib.suppress(Exception):
                    await stage.close()
        infer = getattr(self, "infer", None)
        if infer is not None:
            await asyncio.to_thread(infer.close)
        if self._engine is not None:
            self._engine.close()

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _probe_broker(self, interval: float = 1.0) -> None:
        """Keep the "broker" readiness condition current while running."""
        timeout = min(2.0, self.settings.kafka.request_timeout_ms / 1000.0)
        up = True
        while True:
            ok = await self.source.probe(timeout)
            if ok != up:
                log.warning("broker_reachable" if ok else "broker_unreachable")
                up = ok
            metrics.set_condition("broker", ok)
            await asyncio.sleep(interval)

    # --- rebalance -------------------------------------------------------------------

    async def _on_revoke(self, revoked: set[TopicPartition]) -> None:
        """Let in-flight work of revoked partitions finish (bounded), commit it,
        and forget the partitions so late results are recognised as stale."""
        bound = self.settings.kafka.session_timeout_ms / 2000.0
        deadline = time.monotonic() + bound
        while any(self.tracker.in_flight(tp) for tp in revoked):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._failure is not None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.committer.progress(), remaining)
        await self.committer.commit_now(only=revoked)
        fenced = sum(self.tracker.in_flight(tp) for tp in revoked)
        metrics.REVOKE_FENCED.inc(fenced)
        self.tracker.forget(revoked)
        log.info("partitions_revoked", partitions=len(revoked), fenced=fenced)
