"""What the worker runs, decided once at start-up from the settings.

Every mode and every size that depends on another setting is resolved here into
one frozen plan (as vLLM picks its step function once): the stages are handed
the decision, and never test ``is_gpu`` or apply ``x or default`` themselves.
Settings whose default derives only from their own section stay in that
section's check (``worker.config``); what spans sections is resolved here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from worker.compute.engines import is_gpu_backend
from worker.config import Settings
from worker.flow.errors import ConfigError
from worker.kafka.clients import exactly_once
from worker.model.shapes import bucket_sizes


@dataclass(frozen=True)
class RunPlan:
    device: Literal["cpu", "gpu"]
    device_name: str  # "cpu" or "cuda:N", as the build-info metric says
    # "exactly-once": results, DLQ records and offsets in one transaction.
    exactly_once: bool
    # The batch sizes a compiled engine is warmed at (padded up to on a GPU).
    batch_buckets: tuple[int, ...]
    # Batches run at once: CPU threads with their buffers, or GPU slots.
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

    @classmethod
    def of(cls, s: Settings) -> RunPlan:
        b, k = s.batching, s.kafka
        gpu = is_gpu_backend(s.model.backend)
        if gpu and s.model.reload_interval_s > 0:
            raise ConfigError(
                "model.reload_interval_s: swapping a model while serving runs on the CPU "
                "path (backend onnxruntime); the GPU stage compiles and captures its engines "
                "per slot at start"
            )
        request_timeout = k.request_timeout_s
        return cls(
            device="gpu" if gpu else "cpu",
            device_name=f"cuda:{s.gpu.device}" if gpu else "cpu",
            exactly_once=exactly_once(k),
            batch_buckets=bucket_sizes(b.max_batch_size, b.preferred_batch_sizes),
            inflight=(s.gpu.num_slots or b.max_inflight_batches) if gpu
            else b.max_inflight_batches,
            transaction_batches=k.transaction_batches or b.max_inflight_batches,
            max_pending_acks=2 * b.max_inflight_batches,
            crash_guard_window=b.max_batch_size * b.max_inflight_batches + k.max_poll_records,
            request_timeout_s=request_timeout,
            probe_timeout_s=min(2.0, request_timeout),
            revoke_timeout_s=k.session_timeout_ms / 2000.0,
            reloads=s.model.reload_interval_s > 0,
        )  # fmt: skip
