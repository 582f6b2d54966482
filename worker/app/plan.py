"""What the worker runs, decided once at start-up from the settings.

Every mode and every size that depends on another setting is resolved here into
one frozen plan (as vLLM picks its step function once): the stages are handed
the decision, and never test ``is_gpu`` or apply ``x or default`` themselves.
Settings whose default derives only from their own section stay in that
section's check (``worker.config``); what spans sections is resolved here.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Final, Literal

from worker.compute.engines import is_gpu_backend
from worker.compute.gpu.budget import resolve_fraction
from worker.config import Settings
from worker.config.models import served
from worker.flow.errors import ConfigError, WorkerError
from worker.kafka.clients import exactly_once
from worker.model.io import EngineInfo
from worker.model.shapes import bucket_sizes

# A batch's model input the CPU path fills up to when it derives the batch size,
# and the rows it stays within. Each batch costs about 1.7 ms of the worker's CPU
# however few rows it holds (a thread hand-off, a produce request and its acks,
# a commit); where rows are small that dominates (the bundled digits model,
# 256 B a row: 256-row batches drain at 1.41x the rate of 64-row ones,
# BENCHMARKS "A batch's size from its rows"). Large rows gain nothing from more
# of them per batch and pay in memory and in the time a batch holds the engine.
BATCH_INPUT_BYTES: Final = 64 * 1024
BATCH_ROWS: Final = (64, 256)


@dataclass(frozen=True)
class RunPlan:
    device: Literal["cpu", "gpu"]
    device_name: str  # "cpu", "cuda:N" or "gpu-twin", as the build-info metric says
    # "exactly-once": results, DLQ records and offsets in one transaction.
    exactly_once: bool
    # The batch sizes a compiled engine is warmed at (padded up to on a GPU).
    batch_buckets: tuple[int, ...]
    # Batches a CPU model runs at once (threads with their buffers).
    inflight: int
    # Exactly-once: completed batches one transaction carries at most.
    transaction_batches: int
    # At-least-once: batches whose acks the writer awaits at once.
    max_pending_acks: int
    # Records read but not settled a crash may leave unanswered: the crash guard's
    # window over a partition's head.
    crash_guard_window: int
    request_timeout_s: float
    # A Kafka probe's timeout: short, so not-ready shows within seconds.
    probe_timeout_s: float
    # How long a revoked partition's in-flight work may take to settle.
    revoke_timeout_s: float
    # Whether the model file is watched and swapped while serving (the CPU stage
    # only: refused on the GPU path above).
    reloads: bool = False
    # GPU: the share of the device's memory this process holds (budget.py); 0 on the CPU.
    gpu_memory_fraction: float = 0.0
    # Batches a GPU model runs at once: its slots (gpu.num_slots, else as the CPU's).
    slots: int = 0

    def inflight_of(self, backend: str) -> int:
        """Batches a model of ``backend`` runs at once: its slots on the GPU stage,
        its threads on the CPU stage."""
        return self.slots if is_gpu_backend(backend) else self.inflight

    @classmethod
    def of(cls, s: Settings) -> RunPlan:
        b, k = s.batching, s.kafka
        # The models served (one: its own settings, whatever section configured it;
        # several: each on the CPU or GPU stage as its backend says).
        models = served(s)
        gpu = [m.config.backend for m in models if is_gpu_backend(m.config.backend)]
        for m in models:
            if is_gpu_backend(m.config.backend) and m.config.reload_interval_s > 0:
                raise ConfigError(
                    f"{m.key}.reload_interval_s: swapping a model while serving runs on the "
                    "CPU path (backend onnxruntime); the GPU stage compiles and captures its "
                    "engines per slot at start"
                )
        reloads = any(m.config.reload_interval_s > 0 for m in models)
        twin = bool(gpu) and all(backend == "gpu-twin" for backend in gpu)
        request_timeout = k.request_timeout_s
        return cls(
            device="gpu" if gpu else "cpu",
            device_name="gpu-twin" if twin else f"cuda:{s.gpu.device}" if gpu else "cpu",
            exactly_once=exactly_once(k),
            batch_buckets=bucket_sizes(b.max_batch_size, b.preferred_batch_sizes),
            inflight=b.max_inflight_batches,
            slots=s.gpu.num_slots or b.max_inflight_batches,
            transaction_batches=k.transaction_batches or b.max_inflight_batches,
            max_pending_acks=2 * b.max_inflight_batches,
            crash_guard_window=b.max_batch_size * b.max_inflight_batches + k.max_poll_records,
            request_timeout_s=request_timeout,
            probe_timeout_s=min(2.0, request_timeout),
            revoke_timeout_s=k.session_timeout_ms / 2000.0,
            reloads=reloads,
            gpu_memory_fraction=resolve_fraction(s.gpu.memory_fraction, 1) if gpu else 0.0,
        )  # fmt: skip


def batch_rows(info: EngineInfo) -> int | None:
    """The CPU path's batch size for a model when ``batching.max_batch_size`` is
    left to derive: as many rows as fit ``BATCH_INPUT_BYTES`` of input, within
    ``BATCH_ROWS``. None (keep the default) when a row's size is not known
    before requests come (a free dimension: text, sequences) or the model file
    fixes its batch size."""
    inputs = [d for d in info.io.inputs if d.batched]
    fixed_batch = info.max_batch_size is not None or info.io.batch is not None
    if fixed_batch or not inputs or not all(d.fixed for d in inputs):
        return None
    row_bytes = sum(
        math.prod(d for d in desc.shape if isinstance(d, int)) * desc.dtype.itemsize
        for desc in inputs
    )
    low, high = BATCH_ROWS
    return max(low, min(high, BATCH_INPUT_BYTES // max(1, row_bytes)))


def derives_batch_size(s: Settings) -> bool:
    """Whether the batch size is derived from the loaded model: the CPU path,
    ``batching.max_batch_size`` left to derive, and no priority lanes. Not with
    lanes: a running batch is not preempted, so an urgent request waits for the
    bulk batch on the engine, and 256-row ones took the urgent lane's p99 inside
    the worker from 86-111 to 166-176 ms for 1.09x the bulk rate (BENCHMARKS "A
    batch's size from its rows")."""
    cpu = not is_gpu_backend(s.model.backend)
    return cpu and s.batching.batch_size_derived and not s.kafka.lanes


def sized_for(s: Settings, info: EngineInfo) -> Settings:
    """``s`` with the batch size derived from the loaded model where it is
    (``derives_batch_size``); else ``s`` as it is."""
    rows = batch_rows(info)
    if rows is None or not derives_batch_size(s):
        return s
    return dataclasses.replace(s, batching=s.batching.sized(rows))


def as_run(s: Settings) -> Settings:
    """``s`` as a worker would run it, for the tools that show or time what the
    worker does (``infer-worker config``, ``bench --model``): where the batch
    size is derived from the model (``derives_batch_size``), the model is loaded
    here to derive it the same way; a model that will not load leaves the
    default and says so on stderr (the worker itself would refuse to start)."""
    from worker.compute.engines import load_engine

    if not derives_batch_size(s):
        return s
    try:
        engine = load_engine(s.model)
    except WorkerError as exc:
        print(f"batching.max_batch_size: derived from the model at start-up, which did not "
              f"load here ({exc}); shown as the default", file=sys.stderr)  # fmt: skip
        return s
    try:
        return sized_for(s, engine.info)
    finally:
        engine.close()
