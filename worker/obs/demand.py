"""The metrics of memory shared by demand (``repository.on_demand``,
``worker.app.demand``): which models are loaded, their loads and evictions and
what they cost, and the bytes the loaded models hold against the budget. Named
in ``worker.obs.metrics`` too, where the metrics reference reads every metric."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

MODEL_LOADED = Gauge(
    "infer_model_loaded",
    "Per model loaded by demand (repository.on_demand): 1 while loaded, 0 while evicted or "
    "unloaded through the control topic",
    ["model"],
)
MODEL_LOADS = Counter(
    "infer_model_loads_total",
    "Loads of models by demand, by why: demand (a batch of its requests), backlog (its topics' "
    "lag, before its records were read), control (a record of the control topic); failed: a "
    "load by demand that failed (its batch answered inference_failed saying why)",
    ["model", "reason"],
)
MODEL_EVICTIONS = Counter(
    "infer_model_evictions_total",
    "Models unloaded by demand, by why: room (another model needed the memory: the least "
    "recently used without a backlog first), control (a tombstone on the control topic)",
    ["model", "reason"],
)
MODEL_LOAD_SECONDS = Histogram(
    "infer_model_load_seconds",
    "Per load by demand: from the load's start to the model ready to run (its engine built; "
    "the wait for room before it not included)",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
MODELS_MEMORY_USED = Gauge(
    "infer_models_memory_used_bytes",
    "The bytes the loaded models hold together as measured at their loads (never over "
    "limits.max_models_memory_mb where a budget is set)",
)
GPU_MODELS_MEMORY_USED = Gauge(
    "infer_gpu_models_memory_used_bytes",
    "The bytes of the worker's device the loaded GPU models hold together as measured as "
    "their stages started (never over limits.max_gpu_models_memory_mb where a budget is set)",
)


def declare(models: Iterable[str]) -> None:
    """Every served model's eviction and failed-load series at 0 from the start,
    loaded by demand or not: the alerts on them (deploy/prometheus/alerts.yaml)
    then evaluate on every worker, and a rate over them starts from a sample."""
    for model in models:
        MODEL_EVICTIONS.labels(model, "room")
        MODEL_LOADS.labels(model, "failed")
