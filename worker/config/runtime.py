"""The sections that provision and bound the running worker: ``[batching]``,
``[gpu]``, ``[limits]``, ``[dlq]``, ``[shutdown]``, ``[metrics]``, ``[logging]``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from worker.config.checks import check, derive

# ``batching.max_batch_size`` when it is left to derive and nothing else decides
# it: the GPU path, a model whose rows have free dimensions, tools.
DEFAULT_BATCH_SIZE = 64


@dataclass(frozen=True)
class BatchingConfig:
    # 0 = derived: 64, except that the CPU path derives it again from the model
    # once loaded (``worker.app.plan.batch_rows``: up to 256 rows for models
    # whose rows are small, where a batch's fixed cost outweighs its rows').
    max_batch_size: int = 0
    # Measured from the oldest request in the forming batch.
    max_queue_delay_ms: float = 5.0
    # Sizes the engine is tuned for; a batch of one of these is sent without waiting.
    # Empty (Triton's default): batches flush when full, on the delay or a deadline.
    preferred_batch_sizes: tuple[int, ...] = ()
    # Batches run at once: CPU threads each with its own buffers (GPU: slots, unless
    # gpu.num_slots is set).
    max_inflight_batches: int = 4
    # Decoded requests waiting for a batch; consumption blocks beyond this.
    # 0 = max(2048, 2 * max_batch_size).
    queue_capacity: int = 0
    # Backpressure: partitions are paused while this many records (or bytes) are
    # read but not yet answered, and resumed at half of it.
    # 0 = max(1024, 2 * max_batch_size * max_inflight_batches); with several models (or a
    # pipeline) in the worker, each model's max_batch_size, at least 256.
    max_inflight_records: int = 0
    # Backpressure in bytes: fetching pauses while this many request bytes are read but not
    # answered.
    max_inflight_bytes: int = 268435456
    # A failing batch is split in halves until the failing request is alone; a lone
    # failing request is run this many times before it is answered inference_failed.
    max_attempts: int = 2
    # > 0: a record whose Kafka timestamp is older than this when its batch is
    # dispatched is answered deadline_exceeded without engine time (stale backlogs
    # after an outage). With a request's deadline_ms, the earlier rule wins.
    max_record_age_ms: int = 0
    # Rows of a batch share an engine run only where their free dimensions are
    # equal, except on dimensions padding cannot change (texts, whose attention
    # mask is fed; tensors marked pad = true). There, rows whose lengths fall in
    # one bucket share a run, padded to its longest row, which bounds the padding
    # (under 2x with power-of-two buckets) without reordering results;
    # split_by_length = false pads the whole batch as one. Buckets: ascending
    # upper bounds; () = powers of two. On a GPU they are also the lengths
    # compiled and captured at start-up, for every free dimension.
    split_by_length: bool = True
    # The length buckets of split_by_length (ascending upper bounds; () = powers of two).
    length_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # The settings left to derive (0 given), so ``sized`` can derive them again.
        derived = {
            name for name in ("max_batch_size", "queue_capacity", "max_inflight_records")
            if getattr(self, name) == 0
        }  # fmt: skip
        object.__setattr__(self, "_derived", frozenset(derived))
        if self.max_batch_size == 0:
            derive(self, "max_batch_size", max((DEFAULT_BATCH_SIZE, *self.preferred_batch_sizes)))
        check(self.max_batch_size >= 1, "batching.max_batch_size", "must be >= 1 (0: derived)")
        check(
            all(b >= 1 for b in self.length_buckets)
            and list(self.length_buckets) == sorted(set(self.length_buckets)),
            "batching.length_buckets",
            "must be ascending lengths >= 1 without repeats",
        )
        check(self.max_record_age_ms >= 0, "batching.max_record_age_ms", "must be >= 0 (0: off)")
        check(
            math.isfinite(self.max_queue_delay_ms) and self.max_queue_delay_ms >= 0,
            "batching.max_queue_delay_ms",
            "must be a finite number >= 0",
        )
        for size in self.preferred_batch_sizes:
            check(
                1 <= size <= self.max_batch_size,
                "batching.preferred_batch_sizes",
                f"{size} is outside 1..max_batch_size ({self.max_batch_size})",
            )
        check(self.max_inflight_batches >= 1, "batching.max_inflight_batches", "must be >= 1")
        # Defaults that depend on another setting are derived from it, so that no
        # default can conflict with a valid value of that setting.
        if self.queue_capacity == 0:
            derive(self, "queue_capacity", max(2048, 2 * self.max_batch_size))
        if self.max_inflight_records == 0:
            per_flight = 2 * self.max_batch_size * self.max_inflight_batches
            derive(self, "max_inflight_records", max(1024, per_flight))
        check(self.queue_capacity >= 1, "batching.queue_capacity", "must be >= 1 (0: derived)")
        check(
            self.max_inflight_records >= 1,
            "batching.max_inflight_records",
            "must be >= 1 (0: derived)",
        )
        check(self.max_inflight_bytes > 0, "batching.max_inflight_bytes", "must be > 0")
        check(self.max_attempts >= 1, "batching.max_attempts", "must be >= 1")

    @property
    def inflight_derived(self) -> bool:
        """Whether ``max_inflight_records`` was left to derive (0, the default)."""
        return "max_inflight_records" in self._derived  # type: ignore[attr-defined]

    @property
    def batch_size_derived(self) -> bool:
        """Whether ``max_batch_size`` was left to derive (0, the default)."""
        return "max_batch_size" in self._derived  # type: ignore[attr-defined]

    def sized(self, rows: int) -> BatchingConfig:
        """These settings with ``max_batch_size`` = ``rows``, derived at start-up,
        if it was left to derive (else unchanged); the defaults derived from it
        (``queue_capacity``, ``max_inflight_records``) follow it."""
        if not self.batch_size_derived:
            return self
        derived = self._derived  # type: ignore[attr-defined]
        return dataclasses.replace(
            self,
            # never below a size asked for
            max_batch_size=max((rows, *self.preferred_batch_sizes)),
            queue_capacity=0 if "queue_capacity" in derived else self.queue_capacity,
            max_inflight_records=(
                0 if "max_inflight_records" in derived else self.max_inflight_records
            ),
        )


@dataclass(frozen=True)
class GpuConfig:
    """Provisioning of the GPU stage (backends ``tensorrt`` and ``torch``)."""

    # The CUDA device of the GPU path (its index as CUDA numbers devices).
    device: int = 0
    # Batches in flight on the device (one CUDA stream + buffers each);
    # 0 = batching.max_inflight_batches. TensorRT plans need one profile per slot.
    num_slots: int = 0
    # Packed uint8 image bytes one slot stages for GPU preprocessing.
    max_input_bytes: int = 32 * 1024 * 1024
    # TensorRT: a CUDA graph per slot for full batches (docs/guides/gpu.md)
    cuda_graphs: bool = False
    # Where encoded JPEGs are decoded: "host" (Pillow on the stage's threads) or
    # "nvjpeg" (torchvision's batched nvJPEG on the slot's stream, straight into
    # device memory; PNG, WebP and JPEGs nvJPEG refuses are decoded on the host).
    decode: Literal["host", "nvjpeg"] = "host"
    poll_interval_ms: float = 50.0  # safety net behind the completion callback
    batch_timeout_ms: int = 60000  # a batch still running after this: device hung
    # The share of the device's memory this process may hold (torch's and CuPy's
    # allocators are capped at it; its slot ring and its warm-up are checked
    # against it at start-up); 0 = the whole device for one process, an equal
    # share for each of run --procs N's members (worker.compute.gpu.budget).
    memory_fraction: float = 0.0

    def __post_init__(self) -> None:
        check(self.device >= 0, "gpu.device", "must be >= 0")
        check(0.0 <= self.memory_fraction <= 1.0, "gpu.memory_fraction", "must be in [0, 1]")
        check(self.num_slots >= 0, "gpu.num_slots", "must be >= 0")
        check(self.max_input_bytes > 0, "gpu.max_input_bytes", "must be > 0")
        check(self.poll_interval_ms > 0, "gpu.poll_interval_ms", "must be > 0")
        check(self.batch_timeout_ms > 0, "gpu.batch_timeout_ms", "must be > 0")


@dataclass(frozen=True)
class LimitsConfig:
    # The largest input record read; a larger one goes to the DLQ as too_large, unread.
    max_record_bytes: int = 8 * 1024 * 1024
    # The largest tensor or image file in a request; larger is answered too_large.
    max_tensor_bytes: int = 4 * 1024 * 1024
    # The most pixels an image may have (checked from its header before decoding); more is
    # answered too_large.
    max_image_pixels: int = 4096 * 4096
    # UTF-8 bytes of one text input. msgpack's string limit is raised to it, so a
    # longer string anywhere in a record makes the record undecodable (DLQ).
    max_text_bytes: int = 4096
    # Crashes of whole processes with the same record at the head of a partition
    # before that record is quarantined to the DLQ (crash_loop); 0 disables.
    # Needs kafka.crash_guard_topic to exist.
    max_crash_attempts: int = 3
    # The most memory the worker's models may hold together, in MiB: each model is
    # measured as it loads (the process's resident memory before and after), and a
    # configuration over the budget stops start-up naming each model's size; with
    # repository.on_demand, the repository's models share what the others leave, loaded and
    # evicted by demand. 0: no budget.
    max_models_memory_mb: int = 0
    # repository.on_demand: the most GPU memory, in MiB, the worker's GPU models hold together
    # on its device (engines and slot rings, measured as each stage starts); the repository's
    # GPU models share what the others leave, loaded and evicted by demand. 0: no budget.
    max_gpu_models_memory_mb: int = 0

    def __post_init__(self) -> None:
        check(self.max_crash_attempts >= 0, "limits.max_crash_attempts", "must be >= 0")
        check(self.max_models_memory_mb >= 0, "limits.max_models_memory_mb", "must be >= 0")
        check(self.max_gpu_models_memory_mb >= 0, "limits.max_gpu_models_memory_mb",
              "must be >= 0")  # fmt: skip
        check(self.max_record_bytes > 0, "limits.max_record_bytes", "must be > 0")
        check(self.max_tensor_bytes > 0, "limits.max_tensor_bytes", "must be > 0")
        check(self.max_image_pixels > 0, "limits.max_image_pixels", "must be > 0")
        check(self.max_text_bytes > 0, "limits.max_text_bytes", "must be > 0")


@dataclass(frozen=True)
class DlqConfig:
    """A budget on records that fail (DLQ records and ``inference_failed`` results):
    past it the worker halts with an error instead of draining a whole topic into
    the DLQ because of something systematic (a wrong serializer upstream, a
    broken model)."""

    max_consecutive: int = 1000  # 0 disables
    max_ratio: float = 0.5  # failures / records over the last ``window`` records
    # The records max_ratio is taken over.
    window: int = 2000

    def __post_init__(self) -> None:
        check(self.max_consecutive >= 0, "dlq.max_consecutive", "must be >= 0")
        check(0.0 < self.max_ratio <= 1.0, "dlq.max_ratio", "must be in (0, 1]")
        check(self.window >= 1, "dlq.window", "must be >= 1")


@dataclass(frozen=True)
class ShutdownConfig:
    # SIGTERM: stop fetching, drain, commit and leave within this budget.
    drain_timeout_ms: int = 30000

    def __post_init__(self) -> None:
        check(self.drain_timeout_ms >= 0, "shutdown.drain_timeout_ms", "must be >= 0")


@dataclass(frozen=True)
class MetricsConfig:
    port: int = 9108  # 0 disables the HTTP endpoint
    # The address /metrics and the health endpoints listen on.
    host: str = "0.0.0.0"
    # /livez fails once the event loop has not ticked for this long.
    liveness_timeout_ms: int = 10000
    # How often the partitions' lag and each model's backlog and seconds to drain
    # are refreshed (each model's service rate is averaged over these windows).
    lag_interval_ms: int = 5000

    def __post_init__(self) -> None:
        check(0 <= self.port <= 65535, "metrics.port", "must be 0..65535")
        check(self.liveness_timeout_ms > 0, "metrics.liveness_timeout_ms", "must be > 0")
        check(self.lag_interval_ms >= 100, "metrics.lag_interval_ms", "must be >= 100")


@dataclass(frozen=True)
class LoggingConfig:
    # Log lines as JSON (one object a line) or for a console; auto = console in a terminal,
    # JSON otherwise.
    format: Literal["auto", "json", "console"] = "auto"
    # The least severe level logged (libraries at warning and above whatever this says).
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True)
class TracingConfig:
    """W3C trace context is always carried from a request to its answer; with
    ``enabled`` the worker also emits one span per request (OpenTelemetry SDK,
    the ``tracing`` extra) over OTLP/HTTP."""

    # One span per request, exported over OTLP/HTTP (the tracing extra).
    enabled: bool = False
    # OTLP/HTTP traces endpoint, e.g. "http://collector:4318/v1/traces"; "" = the
    # SDK's (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else localhost:4318).
    endpoint: str = ""
    # The spans' service.name.
    service_name: str = "infer-worker"
    # Share of traces recorded: a request whose traceparent says sampled (or not)
    # is recorded (or not) as its caller decided; a request without one starts a
    # trace recorded with this probability. Unrecorded spans cost almost nothing.
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        check(bool(self.service_name), "tracing.service_name", "must not be empty")
        check(0.0 <= self.sample_ratio <= 1.0, "tracing.sample_ratio", "must be in [0, 1]")
