"""Every metric is declared once, here; stages import what they update.

Exposed in Prometheus text format on ``metrics.port`` (``/metrics``, served by
``worker.obs.http``), which is also
how the demo, the benchmarks and the tests read a worker process's counters. The
same port answers, for Kubernetes probes and load balancers:

* ``/livez`` (alias ``/healthz``): 200 while the event loop ticks; 503 once it
  has not for ``metrics.liveness_timeout_ms`` (a stuck loop is not alive,
  however well the HTTP thread still answers);
* ``/readyz`` (alias ``/ready``): 200 while the worker consumes and delivers
  normally, 503 while it starts, drains, cannot reach the broker or deliver.
  A member that joined the group but was given no partition (more members than
  partitions) is ready: it is a standby, and takes partitions on the next
  rebalance.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client import (
    Counter,
    Gauge,
    Histogram,
)

# The autoscaling signals (worker.obs.backlog), and readiness and liveness
# (worker.obs.health): named here too, where the stages and the metrics
# reference (docs/hooks/reference.py) read them.
from worker.obs.backlog import BACKLOG_RECORDS, SECONDS_TO_DRAIN
from worker.obs.demand import (
    GPU_MODELS_MEMORY_USED,
    MODEL_EVICTIONS,
    MODEL_LOAD_SECONDS,
    MODEL_LOADED,
    MODEL_LOADS,
    MODELS_MEMORY_USED,
)
from worker.obs.health import (
    READY,
    conditions,
    is_ready,
    loop_stale,
    loop_ticked,
    set_condition,
    set_liveness_timeout,
)

# Named here, defined there (the rest of the module's names are its own).
__all__ = [
    "BACKLOG_RECORDS", "GPU_MODELS_MEMORY_USED", "MODELS_MEMORY_USED", "MODEL_EVICTIONS",
    "MODEL_LOADED", "MODEL_LOADS",
    "MODEL_LOAD_SECONDS", "READY", "SECONDS_TO_DRAIN", "conditions", "is_ready", "loop_stale",
    "loop_ticked", "set_condition", "set_liveness_timeout",
]  # fmt: skip

# From 100 us: a GPU batch computes in a millisecond or two and must not land in
# the first bucket.
_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# The served model's name and version, on every inference metric (as Triton labels
# them), so a fleet serving several models or a canary version splits cleanly.
_MODEL = ("model", "version")

RECORDS_CONSUMED = Counter("infer_records_consumed_total", "Records read from input topics")
REQUESTS_REJECTED = Counter(
    "infer_requests_rejected_total", "Records answered without inference", ["code"]
)
IMAGES_DECODED = Counter(
    "infer_images_decoded_total",
    "Encoded images (JPEG/PNG/WebP) by decoder (host: Pillow on the stage's threads; "
    "nvjpeg: on the GPU) and outcome (ok; refused: nvJPEG passed it to the host "
    "decoder; invalid: answered invalid_request)",
    ["decoder", "outcome"],
)
EXPIRED = Counter(
    "infer_expired_total",
    "Requests answered deadline_exceeded before inference, by the rule that expired them "
    "(deadline_ms, max_record_age, step_share: a pipeline step's deadline_share)",
    ["rule"],
)
RESULTS_PRODUCED = Counter(
    "infer_results_produced_total", "Results acknowledged by the broker", [*_MODEL, "status"]
)
DLQ_PRODUCED = Counter("infer_dlq_produced_total", "DLQ records acknowledged by the broker")
BATCHES = Counter("infer_batches_total", "Batches sent to the engine", [*_MODEL, "reason"])
BUILD_INFO = Gauge(
    "infer_build_info",
    "Always 1; the labels say what runs (join other series on it for model and version)",
    ["version", "model", "model_version", "backend", "device"],
)
PIPELINE_STEP_SECONDS = Histogram(
    "infer_pipeline_step_seconds",
    "Per batch: the time a pipeline's step took ([pipelines.NAME])",
    ["pipeline", "step"],
    buckets=_LATENCY_BUCKETS,
)
PIPELINE_STEP_FAILURES = Counter(
    "infer_pipeline_step_failures_total",
    "Requests a pipeline's step failed (answered inference_failed naming it)",
    ["pipeline", "step"],
)
MODEL_MEMORY = Gauge(
    "infer_model_memory_bytes",
    "Resident memory each model added as it loaded (limits.max_models_memory_mb)",
    _MODEL,
)
QUEUE_SECONDS = Histogram(
    "infer_queue_seconds",
    "Per request: from its arrival in the worker to its batch being formed",
    _MODEL,
    buckets=_LATENCY_BUCKETS,
)
RECORD_AGE_SECONDS = Histogram(
    "infer_record_age_seconds",
    "Per request: from the Kafka record's timestamp to its result's acknowledgement "
    "(latency including lag and the producer's clock)",
    buckets=_LATENCY_BUCKETS,
)
D2H_SECONDS = Histogram(
    "infer_d2h_seconds",
    "GPU: device-to-host copy time per batch",
    _MODEL,
    buckets=_LATENCY_BUCKETS,
)
CRASH_LOOPS = Counter(
    "infer_crash_loop_quarantined_total",
    "Records sent to the DLQ unrun after whole processes died with them at the head",
)
REBALANCES = Counter(
    "infer_rebalances_total",
    "Group rebalance callbacks this member received, by kind (assigned, revoked)",
    ["kind"],
)
PARTITION_LAG = Gauge(
    "infer_partition_lag_records",
    "Per owned input partition: the broker's high watermark minus the committed offset",
    ["topic", "partition"],
)
PARTITION_COMMIT_AGE = Gauge(
    "infer_partition_last_commit_age_seconds",
    "Per owned input partition: seconds since this member last committed it",
    ["topic", "partition"],
)
BATCH_SIZE = Histogram(
    "infer_batch_size", "Requests per engine batch", _MODEL, buckets=_SIZE_BUCKETS
)
INFER_SECONDS = Histogram(
    "infer_engine_seconds",
    "Engine run time per batch (the compute; GPU: kernel to D2H on the stream)",
    _MODEL,
    buckets=_LATENCY_BUCKETS,
)
PREPROCESS_SECONDS = Histogram(
    "infer_preprocess_seconds", "Preprocessing time per batch", _MODEL, buckets=_LATENCY_BUCKETS
)
REQUEST_SECONDS = Histogram(
    "infer_request_seconds",
    "Time from a record's arrival in the worker to its result's acknowledgement, per lane "
    "(without lanes, the one lane named after the first input topic)",
    [*_MODEL, "lane"],
    buckets=_LATENCY_BUCKETS,
)
BATCH_FAILURES = Counter("infer_batch_failures_total", "Batches the engine failed on", _MODEL)
QUEUE_DEPTH = Gauge("infer_queue_depth", "Decoded requests waiting to be batched")
INFLIGHT_BATCHES = Gauge("infer_inflight_batches", "Batches between dispatch and acknowledgement")
LIVE_SEQUENCES = Gauge(
    "infer_live_sequences", "Sequences whose state a stateful model keeps", ["model"]
)
MODEL_SWAPS = Counter(
    "infer_model_swaps_total", "New model versions swapped in, or refused", ["outcome"]
)
STATE_RECORDS = Counter("infer_state_records_total", "States written to the state changelog")
STATE_PENDING = Gauge(
    "infer_state_changelog_pending",
    "Answered requests whose state the changelog has not acknowledged yet (its lag)",
)
STATE_RESTORES = Counter("infer_state_restores_total", "Partitions whose states were restored")
STATE_RESTORE_SECONDS = Histogram(
    "infer_state_restore_seconds", "Time to restore one assignment's states from the changelog"
)
RESTORED_SEQUENCES = Counter("infer_restored_sequences_total", "Sequences restored")
COMMITS = Counter("infer_commits_total", "Successful offset commits")
COMMIT_FAILURES = Counter("infer_commit_failures_total", "Offset commits that failed")
ASSIGNED_PARTITIONS = Gauge("infer_assigned_partitions", "Input partitions owned by this member")
# Priority lanes ([[kafka.lanes]]; without lanes, one lane named after the first
# input topic): rows, queue time, pauses and rejections per lane.
LANE_ROWS = Counter("infer_lane_rows_total", "Requests dispatched in batches, per lane", ["lane"])
LANE_QUEUE_SECONDS = Histogram(
    "infer_lane_queue_seconds", "Per request: arrival to batch, per lane", ["lane"],
    buckets=_LATENCY_BUCKETS,
)  # fmt: skip
EVENT_LOOP_LAG_SECONDS = Histogram(
    "infer_event_loop_lag_seconds",
    "How late the event loop ran a timer due every 0.1 s: how long the longest "
    "step in its way held the loop (every Kafka hop of a request waits behind it)",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0),
)  # fmt: skip
LANE_PAUSED = Gauge("infer_lane_paused", "1 while backpressure pauses the lane", ["lane"])
URGENT_FETCH_PARTITIONS = Gauge(
    "infer_lane_urgent_fetch_partitions",
    "Partitions of the most urgent lane read on a connection of their own (with lanes)",
)
LANE_REJECTED = Counter(
    "infer_lane_rejected_total", "Answered without inference, per lane", ["lane", "code"]
)
PAUSES = Counter("infer_partition_pauses_total", "Times fetching was paused by backpressure")
RESUMES = Counter("infer_partition_resumes_total", "Times fetching was resumed")
INFLIGHT_RECORDS = Gauge("infer_inflight_records", "Records read but not yet answered")
INFLIGHT_BYTES = Gauge("infer_inflight_bytes", "Bytes of records read but not yet answered")
FETCH_ERRORS = Counter("infer_fetch_errors_total", "Failed fetches from the input topics")
LISTENER_ERRORS = Counter("infer_rebalance_listener_errors_total", "Errors in rebalance callbacks")
REVOKE_FENCED = Counter(
    "infer_revoke_fenced_total", "In-flight records whose results were dropped on revoke"
)
DELIVERY_RETRIES = Counter(
    "infer_delivery_retries_total", "Result/DLQ records re-sent after a failed delivery"
)
TRANSACTIONS = Counter(
    "infer_transactions_total",
    "Exactly-once: transactions of results, DLQ records and offsets, by outcome "
    "(committed; aborted: their records are sent again, or left to a partition's new owner)",
    ["outcome"],
)
PADDED_ELEMENTS = Counter(
    "infer_padded_elements_total",
    "Elements of inputs with free dimensions (text, sequences) sent to the engine, by "
    "whether they carry data or padding: padding / data is the padding's compute cost",
    [*_MODEL, "kind"],
)
ISOLATION_RUNS = Counter(
    "infer_isolation_runs_total",
    "Engine re-runs of split batches to isolate a poison request",
    _MODEL,
)
PARTITION_RESETS = Counter(
    "infer_partition_resets_total",
    "Partitions whose offsets moved backwards because the broker's log ends below what "
    "was read (the broker lost its log): answered again in a new epoch",
)
REDELIVERIES_DROPPED = Counter(
    "infer_redeliveries_dropped_total",
    "Records delivered again after this member had read them in the same assignment "
    "(the broker still holds them): dropped, never answered twice",
)

GPU_SLOTS = Gauge("infer_gpu_slots", "GPU: slots (streams with preallocated buffers)", _MODEL)
GPU_SLOTS_BUSY = Gauge(
    "infer_gpu_slots_busy",
    "GPU: slots holding a batch now (all busy and batches waiting: the device is the limit)",
    _MODEL,
)
GPU_MODEL_MEMORY = Gauge(
    "infer_gpu_model_memory_bytes",
    "GPU memory a model took as its stage started (engine and slot ring: the process's "
    "allocators before and after; gpu.memory_fraction bounds the sum)",
    ["model"],
)
# Device-wide GPU gauges carry the device's uuid: several processes on one device
# each publish them, and max by (uuid) takes one series per device (monitor.py).
_DEVICE = ["device", "uuid"]
GPU_MEMORY_USED = Gauge(
    "infer_gpu_memory_used_bytes",
    "GPU memory in use on the worker's device, all processes (NVML; max by uuid)",
    _DEVICE,
)
GPU_MEMORY_TOTAL = Gauge(
    "infer_gpu_memory_total_bytes", "GPU memory of the worker's device (NVML)", _DEVICE
)
GPU_PROCESS_MEMORY = Gauge(
    "infer_gpu_process_memory_bytes",
    "GPU memory this process holds on the device (NVML; sums across processes)",
    _DEVICE,
)
GPU_UTILIZATION = Gauge(
    "infer_gpu_utilization_ratio",
    "GPU: fraction of the last sample period a kernel ran on the device (NVML, 0..1; max by uuid)",
    _DEVICE,
)


class ModelMetrics:
    """The inference metrics of the one model a process serves, bound to its
    ``model`` and ``version`` labels once (at stage construction) so the hot
    path does no label lookups."""

    def __init__(self, model: str, version: str) -> None:
        self._labels = (model, version)
        self.queue_seconds = QUEUE_SECONDS.labels(model, version)
        self.preprocess_seconds = PREPROCESS_SECONDS.labels(model, version)
        self.engine_seconds = INFER_SECONDS.labels(model, version)
        self.d2h_seconds = D2H_SECONDS.labels(model, version)
        self._requests: dict[str, Histogram] = {}
        self.batch_size = BATCH_SIZE.labels(model, version)
        self.batch_failures = BATCH_FAILURES.labels(model, version)
        self.isolation_runs = ISOLATION_RUNS.labels(model, version)
        self.gpu_slots = GPU_SLOTS.labels(model, version)
        self.gpu_slots_busy = GPU_SLOTS_BUSY.labels(model, version)
        self.data_elements = PADDED_ELEMENTS.labels(model, version, "data")
        self.padding_elements = PADDED_ELEMENTS.labels(model, version, "padding")
        self._batches: dict[str, Counter] = {}
        self._results: dict[str, Counter] = {}

    @property
    def model(self) -> str:
        return self._labels[0]

    @property
    def version(self) -> str:
        return self._labels[1]

    def remove(self) -> None:
        """Drop this version's series from the exposition (``model_metrics``)."""
        plain = (QUEUE_SECONDS, PREPROCESS_SECONDS, INFER_SECONDS, D2H_SECONDS,
                 BATCH_SIZE, BATCH_FAILURES, ISOLATION_RUNS, GPU_SLOTS, GPU_SLOTS_BUSY)  # fmt: skip
        for metric in plain:
            metric.remove(*self._labels)
        for lane in self._requests:
            REQUEST_SECONDS.remove(*self._labels, lane)
        for kind in ("data", "padding"):
            PADDED_ELEMENTS.remove(*self._labels, kind)
        for reason in self._batches:
            BATCHES.remove(*self._labels, reason)
        for status in self._results:
            RESULTS_PRODUCED.remove(*self._labels, status)

    def request_seconds(self, lane: str) -> Histogram:
        """Arrival to acknowledgement of the requests of ``lane`` (its label)."""
        if (found := self._requests.get(lane)) is None:
            found = self._requests[lane] = REQUEST_SECONDS.labels(*self._labels, lane)
        return found

    def batches(self, reason: str) -> Counter:
        if (found := self._batches.get(reason)) is None:
            found = self._batches[reason] = BATCHES.labels(*self._labels, reason)
        return found

    def results(self, status: str) -> Counter:
        if (found := self._results.get(status)) is None:
            found = self._results[status] = RESULTS_PRODUCED.labels(*self._labels, status)
        return found


# Per model name, the metrics of the versions it was served at, oldest first.
_SERVED: dict[str, list[ModelMetrics]] = {}


def model_metrics(model: str, version: str) -> ModelMetrics:
    """The inference metrics of ``model`` at ``version``: every stage asks here,
    so a swapped-in version's latencies are its own (``model_version`` on every
    series, the articles' "p99 by model version"). Bounded: the serving version
    and the one before it (whose last batches finish after a swap) are kept;
    an older version's series leave the exposition."""
    served = _SERVED.setdefault(model, [])
    for found in served:
        if found.version == version:
            return found
    served.append(ModelMetrics(model, version))
    while len(served) > 2:
        served.pop(0).remove()
    return served[-1]


def observe_all(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(a)`` for every amount, per batch: one bisect per
    amount and one locked increment per bucket touched, where ``observe`` scans
    the buckets in Python and locks twice per amount (three histograms per
    record were about 5% of the event loop, issue 36). It reaches into the
    histogram's buckets (prometheus_client 0.20-0.26 keep them so); a unit test
    holds its exposition equal to ``observe``'s for the same amounts."""
    if not amounts:
        return
    bounds = histogram._upper_bounds
    counts: dict[int, int] = {}
    for amount in amounts:
        i = bisect_left(bounds, amount)  # the first bound >= amount: observe's bucket
        counts[i] = counts.get(i, 0) + 1
    histogram._sum.inc(sum(amounts))
    for i, n in counts.items():
        histogram._buckets[i].inc(n)
