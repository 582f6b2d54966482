"""Every metric is declared once, here; stages import what they update.

Exposed in Prometheus text format on ``metrics.port`` (``/metrics``), which is also
how the demo, the benchmarks and the tests read a worker process's counters.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

RECORDS_CONSUMED = Counter("infer_records_consumed_total", "Records read from input topics")
REQUESTS_REJECTED = Counter(
    "infer_requests_rejected_total", "Records answered without inference", ["code"]
)
RESULTS_PRODUCED = Counter(
    "infer_results_produced_total", "Results acknowledged by the broker", ["status"]
)
DLQ_PRODUCED = Counter("infer_dlq_produced_total", "DLQ records acknowledged by the broker")
BATCHES = Counter("infer_batches_total", "Batches sent to the engine", ["reason"])
BATCH_SIZE = Histogram("infer_batch_size", "Requests per engine batch", buckets=_SIZE_BUCKETS)
INFER_SECONDS = Histogram(
    "infer_engine_seconds", "Engine run time per batch", buckets=_LATENCY_BUCKETS
)
PREPROCESS_SECONDS = Histogram(
    "infer_preprocess_seconds", "Preprocessing time per batch", buckets=_LATENCY_BUCKETS
)
REQUEST_SECONDS = Histogram(
    "infer_request_seconds",
    "Time from a record's arrival in the worker to its result's acknowledgement",
    buckets=_LATENCY_BUCKETS,
)
BATCH_FAILURES = Counter("infer_batch_failures_total", "Batches the engine failed on")
QUEUE_DEPTH = Gauge("infer_queue_depth", "Decoded requests waiting to be batched")
INFLIGHT_BATCHES = Gauge("infer_inflight_batches", "Batches between dispatch and acknowledgement")
COMMITS = Counter("infer_commits_total", "Successful offset commits")
COMMIT_FAILURES = Counter("infer_commit_failures_total", "Offset commits that failed")
READY = Gauge("infer_ready", "1 while the worker is consuming and producing normally")
ASSIGNED_PARTITIONS = Gauge("infer_assigned_partitions", "Input partitions owned by this member")
