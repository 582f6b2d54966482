"""``bench --model``'s options, and the worker settings each model runs with.

The settings are dotted keys (TOML literals) handed to the worker as
``INFER_WORKER_*`` variables, so the benchmark runs exactly the configuration a
user would write, and records it beside the figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np

from worker.bench.openloop import Setting
from worker.config import BatchingConfig, load_settings
from worker.flow.errors import ConfigError, WorkerError
from worker.ops.processes import override_env

MODELS: Final = ("digits", "resnet50", "sentiment")
PAYLOADS: Final = ("jpeg", "png", "raw", "text")
# What each model's requests can carry; the first is the default.
MODEL_PAYLOADS: Final[dict[str, tuple[str, ...]]] = {
    "digits": ("jpeg", "png", "raw"),
    "resnet50": ("jpeg", "png", "raw"),
    "sentiment": ("text",),
}
DEFAULT_RESULTS_DIR: Final = Path("benchmarks") / "results"
IMAGENET_MEAN: Final = (0.485, 0.456, 0.406)
IMAGENET_STD: Final = (0.229, 0.224, 0.225)
# How long the engine alone is timed, seconds (after a warm-up of a few runs).
ENGINE_SECONDS: Final = 2.0


class BenchError(WorkerError):
    code = "bench_failed"


@dataclass
class ModelBenchOptions:
    model: str
    payload: str = "jpeg"
    procs: int = 1
    senders: int | None = None  # processes sending the paced requests; None = one per process
    records: int | None = None  # None: sized by time (worker.bench.backlog)
    partitions: int = 4  # raised to procs when lower: every member gets a partition
    duration: float = 5.0  # seconds of paced arrivals
    rate: float = 0.0  # paced requests/s; 0 = half the worker's drain rate
    results_dir: Path = DEFAULT_RESULTS_DIR
    json_out: str | None = None
    # Worker settings for the run, as dotted keys, over the model's own.
    overrides: dict[str, str] = field(default_factory=dict)
    engines_dir: Path = Path("engines")  # where resnet50's exported program is cached
    engine_seconds: float = ENGINE_SECONDS


def check_options(opts: ModelBenchOptions) -> None:
    """Refuse what cannot run, before anything starts (exit 2)."""
    if opts.model not in MODELS:
        raise ConfigError(f"--model: {opts.model!r} is not one of {', '.join(MODELS)}")
    if opts.payload not in PAYLOADS:
        raise ConfigError(f"--payload: {opts.payload!r} is not one of {', '.join(PAYLOADS)}")
    if opts.payload not in MODEL_PAYLOADS[opts.model]:
        allowed = ", ".join(MODEL_PAYLOADS[opts.model])
        raise ConfigError(f"--payload: {opts.model} takes {allowed}, not {opts.payload}")
    if opts.procs < 1:
        raise ConfigError(f"--procs: must be >= 1, got {opts.procs}")
    if opts.senders is not None and opts.senders < 1:
        raise ConfigError(f"--senders: must be >= 1, got {opts.senders}")
    if opts.records is not None and opts.records < 1:
        raise ConfigError(f"--records: must be >= 1, got {opts.records}")
    if opts.partitions < 1:
        raise ConfigError(f"--partitions: must be >= 1, got {opts.partitions}")
    if not (opts.duration > 0 and np.isfinite(opts.duration)):
        raise ConfigError(f"--duration: must be > 0 seconds, got {opts.duration}")
    if not (opts.rate >= 0 and np.isfinite(opts.rate)):
        raise ConfigError(f"--rate: must be >= 0 requests/s, got {opts.rate}")


def default_payload(model: str) -> str:
    """``--payload`` when not given: jpeg for the image models, text for sentiment."""
    return MODEL_PAYLOADS.get(model, PAYLOADS)[0]


def unit(model: str) -> str:
    """What the rates count: images, or texts for the text model. (The summary's
    keys say ``img_s`` for either, so results files keep one shape.)"""
    return "texts/s" if model == "sentiment" else "img/s"


def model_overrides(model: str) -> dict[str, str]:
    """The worker settings a model runs with, as dotted keys (TOML literals);
    resnet50's ``model.path`` is added once its program is built."""
    if model in ("digits", "sentiment"):
        return {"model.name": model, "model.path": f"builtin:{model}",
                "model.backend": "onnxruntime"}  # fmt: skip
    return {
        "model.name": "resnet50",
        "model.backend": "torch",
        "model.preprocess.size": "[224, 224]",
        "model.preprocess.channels": "3",
        "model.preprocess.mean": _toml_list(IMAGENET_MEAN),
        "model.preprocess.std": _toml_list(IMAGENET_STD),
        # The exported program takes float32 (build-engine exports the module as
        # it is); the engine computes in float16 and casts the preprocessed input
        # on the device, inside the captured graph.
        "model.preprocess.dtype": "float32",
        "model.torch.precision": "float16",
        "model.preprocess.device": "gpu",
        # JPEGs decoded by nvJPEG on the slot's stream (PNG falls back to the host).
        "gpu.decode": "nvjpeg",
    }


def _toml_list(values: Iterable[float]) -> str:
    return "[" + ", ".join(repr(float(v)) for v in values) + "]"


def run_overrides(opts: ModelBenchOptions) -> dict[str, str]:
    """The model's settings, then ``--set``; for resnet50 without a ``model.path``
    of the user's, the exported program for the run's max batch (built once,
    then cached)."""
    overrides = {**model_overrides(opts.model), **opts.overrides}
    if opts.model == "resnet50" and "model.path" not in opts.overrides:
        settings = load_settings(env=override_env(overrides))
        # Lazy: torch is imported only here (ConfigError, exit 2, without it).
        from worker.ops.build_torch import build_torch_program, input_shape_of

        path = build_torch_program(
            "torchvision:resnet50",
            opts.engines_dir,
            max_batch_size=settings.batching.max_batch_size,
            input_shape=input_shape_of(settings.model.preprocess),
        )
        overrides["model.path"] = str(path)
    return overrides


@dataclass
class SweepOptions:
    batch_sizes: list[int] = field(default_factory=lambda: [BatchingConfig().max_batch_size])
    delays: list[float] = field(default_factory=lambda: [0.0, 2.0, 5.0, 10.0])
    rates: list[float] = field(default_factory=lambda: [200.0, 1000.0, 3000.0])
    duration: float = 5.0  # seconds of arrivals per rate
    slo_p99_ms: float = 50.0
    plot: str | None = "sweep.png"
    json_out: str | None = None
    partitions: int = 4
    # Other worker settings for every run, as dotted keys.
    overrides: dict[str, str] = field(default_factory=dict)
    # A pipeline of those settings to sweep instead of [model] (pipelines.NAME.*, given
    # with the overrides): it answers the sweep's requests, end to end.
    pipeline: str | None = None

    def worker_overrides(self, requests_topic: str) -> dict[str, str]:
        """The overrides every worker of the sweep runs with: the pipeline swept,
        if any, answering ``requests_topic``."""
        defined = any(k.startswith(f"pipelines.{self.pipeline}.") for k in self.overrides)
        if self.pipeline is None or not defined:  # undefined: refused by check_options
            return dict(self.overrides)
        return {**self.overrides, f"pipelines.{self.pipeline}.topics": requests_topic}

    def settings(self) -> list[Setting]:
        return [Setting(b, float(d)) for b in self.batch_sizes for d in self.delays]
