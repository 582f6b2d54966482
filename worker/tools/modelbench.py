"""Moved to the package ``worker.tools.bench`` (split by job); this module keeps
the old import path working for code written against it. New code imports from
the package. Note: patching a name here does not reach the package's users."""

from worker.tools.bench.drain import Sample, WorkerDrain, all_joined, busy_fraction, score_drain
from worker.tools.bench.engine import engine_rate, load_run_engine
from worker.tools.bench.modelbench import run_modelbench
from worker.tools.bench.openloop import STAGES, stage_summary
from worker.tools.bench.options import (
    DEFAULT_RESULTS_DIR,
    MODELS,
    PAYLOADS,
    BenchError,
    ModelBenchOptions,
    check_options,
    model_overrides,
)
from worker.tools.bench.payloads import encode_image, payload_images, photos, request_records
from worker.tools.bench.report import device_slug, results_path, table, write_summary

__all__ = [
    "DEFAULT_RESULTS_DIR",
    "MODELS",
    "PAYLOADS",
    "STAGES",
    "BenchError",
    "ModelBenchOptions",
    "Sample",
    "WorkerDrain",
    "all_joined",
    "busy_fraction",
    "check_options",
    "device_slug",
    "encode_image",
    "engine_rate",
    "load_run_engine",
    "model_overrides",
    "payload_images",
    "photos",
    "request_records",
    "results_path",
    "run_modelbench",
    "score_drain",
    "stage_summary",
    "table",
    "write_summary",
]
