"""``infer-worker bench --model NAME --payload jpeg|png|raw``: one model, measured end to end.

One run, on the embedded broker and one machine, measures the same records four
ways, so the ratios between the figures mean something:

1. **engine alone** (``engine_img_s``): the worker's own engine, loaded with the
   run's settings exactly as a worker loads it, on its largest batch. A CPU
   engine runs a preprocessed batch (``Engine.run``); a GPU engine gets one slot
   as the GPU stage builds it and is timed enqueueing the largest batch again
   and again on the slot's stream, with one synchronisation at the end.
2. **ingest ceiling** (``ingest_ceiling_rec_s``): a bare aiokafka consumer that
   msgpack-decodes the backlog and discards it (``worker.tools.drain``).
3. **worker drain** (``worker_img_s``): ``infer-worker run --procs N`` in a fresh
   group drains the same backlog; every request must be answered ``ok``. The
   rate counts the results that arrived after its clock started. With one
   process the clock runs from the first result to the last; with several,
   from the moment every member holds its partitions (a member that finishes
   starting first drains alone until the others join, and rebalances pause
   them all), so the figure is what N members sustain together. The mean batch
   comes from the members' Prometheus metrics over the same span, the GPU busy
   fraction from NVML's utilisation sampled during it (null without NVML or
   for a CPU model).
4. **paced** (``paced``): the same workers, sent open-loop Poisson arrivals at
   half the drain rate (or ``--rate``) for ``--duration`` seconds, through the
   sweep's open-loop sender: end-to-end p50/p95/p99, and each stage's p50 and
   p99 from the results' ``timing_us``.

Models: ``digits`` is the bundled CPU model (what CI runs), its payload the
bundled held-out digits at 8x8, 16x16 and 24x24. ``resnet50`` is torchvision's
ResNet-50 with random weights, exported once to a cached ``.pt2`` under
``engines/`` (``build-engine --backend torch``) and run by the torch engine in
float16 with GPU preprocessing; its payload is scikit-image's bundled photos at
256x256. Payloads: ``jpeg`` (quality 90) and ``png`` files sent as they are,
``raw`` as uint8 HWC tensors.

The summary goes to ``<results-dir>/<date>-<device>-<payload>.json`` (never
overwriting: a second run that day gets ``-2``, and so on) and as a table to
stdout.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, cast

import numpy as np

from worker import __version__
from worker.config import Settings, load_settings
from worker.contract import EncodedImage, Request, Tensor, encode_request
from worker.engines import Engine, GpuEngine, is_gpu_backend, load_engine
from worker.engines.buckets import bucket_sizes
from worker.errors import ConfigError, WorkerError
from worker.tools.broker import EmbeddedBroker, create_topics
from worker.tools.children import children_die_with_this_process
from worker.tools.demo import labelled_samples, override_env
from worker.tools.drain import arrivals_after, drain_ceiling
from worker.tools.processes import (
    WorkerProcess,
    mean_batch_size,
    scrape,
    spawn_worker,
    summed,
)
from worker.tools.sweep import SweepPoint, send_open_loop
from worker.tools.topics import Collected, Collector, produce_all

MODELS: Final = ("digits", "resnet50")
PAYLOADS: Final = ("jpeg", "png", "raw")
STAGES: Final = ("queue", "preprocess", "infer", "d2h", "total")
DEFAULT_RECORDS: Final = {"digits": 5000, "resnet50": 20000}
DEFAULT_RESULTS_DIR: Final = Path("benchmarks") / "results"

# scikit-image's bundled colour photographs (no download), sent at 256x256.
PHOTOS: Final = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "ihc")
PHOTO_SIZE: Final = 256
JPEG_QUALITY: Final = 90
IMAGENET_MEAN: Final = (0.485, 0.456, 0.406)
IMAGENET_STD: Final = (0.229, 0.224, 0.225)

# How long the engine is timed: this many seconds or runs, whichever comes first
# (after a warm-up of a few runs).
ENGINE_SECONDS: Final = 2.0
ENGINE_MAX_RUNS: Final = 1000
ENGINE_WARM_RUNS: Final = 3
# How often member metrics and NVML are sampled during the drain, seconds.
SAMPLE_INTERVAL: Final = 0.1


class BenchError(WorkerError):
    code = "bench_failed"


@dataclass
class ModelBenchOptions:
    model: str
    payload: str = "jpeg"
    procs: int = 1
    records: int | None = None  # None: DEFAULT_RECORDS[model]
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
    if opts.model not in MODELS:
        raise ConfigError(f"--model: {opts.model!r} is not one of {', '.join(MODELS)}")
    if opts.payload not in PAYLOADS:
        raise ConfigError(f"--payload: {opts.payload!r} is not one of {', '.join(PAYLOADS)}")
    if opts.procs < 1:
        raise ConfigError(f"--procs: must be >= 1, got {opts.procs}")
    if opts.records is not None and opts.records < 1:
        raise ConfigError(f"--records: must be >= 1, got {opts.records}")
    if opts.partitions < 1:
        raise ConfigError(f"--partitions: must be >= 1, got {opts.partitions}")
    if not (opts.duration > 0 and np.isfinite(opts.duration)):
        raise ConfigError(f"--duration: must be > 0 seconds, got {opts.duration}")
    if not (opts.rate >= 0 and np.isfinite(opts.rate)):
        raise ConfigError(f"--rate: must be >= 0 requests/s, got {opts.rate}")


# --- models and payloads -------------------------------------------------------------


def model_overrides(model: str) -> dict[str, str]:
    """The worker settings a model runs with, as dotted keys (TOML literals);
    resnet50's ``model.path`` is added once its program is built."""
    if model == "digits":
        return {"model.name": "digits", "model.path": "builtin:digits",
                "model.backend": "onnxruntime"}  # fmt: skip
    return {
        "model.name": "resnet50",
        "model.backend": "torch",
        "model.preprocess.size": "[224, 224]",
        "model.preprocess.channels": "3",
        "model.preprocess.mean": _toml_list(IMAGENET_MEAN),
        "model.preprocess.std": _toml_list(IMAGENET_STD),
        "model.preprocess.dtype": "float16",
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
        from worker.tools.build_torch import build_torch_program, input_shape_of

        path = build_torch_program(
            "torchvision:resnet50",
            opts.engines_dir,
            max_batch_size=settings.batching.max_batch_size,
            input_shape=input_shape_of(settings.model.preprocess),
        )
        overrides["model.path"] = str(path)
    return overrides


def photos(size: int = PHOTO_SIZE) -> list[np.ndarray]:
    """scikit-image's bundled photographs as uint8 [size, size, 3]."""
    try:
        import skimage.data
    except ImportError as exc:
        raise ConfigError(
            "--model resnet50 sends scikit-image's bundled photographs and needs "
            "scikit-image: pip install scikit-image (or this checkout's bench extra: "
            "pip install -e '.[bench]')"
        ) from exc
    from PIL import Image

    loaders = {"ihc": "immunohistochemistry"}
    out = []
    for name in PHOTOS:
        pixels = getattr(skimage.data, loaders.get(name, name))()
        image = Image.fromarray(np.ascontiguousarray(pixels[..., :3])).convert("RGB")
        resized = image.resize((size, size), Image.Resampling.BILINEAR)
        out.append(np.asarray(resized, dtype=np.uint8))
    return out


def payload_images(model: str) -> list[np.ndarray]:
    """The pixels a model's requests carry, uint8 HWC."""
    if model == "digits":
        return [s.image for s in labelled_samples(3)]  # 8x8, 16x16 and 24x24
    return photos()


def encode_image(pixels: np.ndarray, payload: str) -> Tensor | EncodedImage:
    """One request's ``inputs.image``: the tensor, or the image as a file."""
    if payload == "raw":
        return Tensor.from_numpy(pixels)
    from PIL import Image

    grey = pixels.ndim == 3 and pixels.shape[2] == 1
    image = Image.fromarray(pixels[:, :, 0] if grey else pixels)
    buf = io.BytesIO()
    if payload == "jpeg":
        image.save(buf, format="JPEG", quality=JPEG_QUALITY)
        return EncodedImage("jpeg", buf.getvalue())
    image.save(buf, format="PNG")
    return EncodedImage("png", buf.getvalue())


def request_records(
    inputs: Sequence[Tensor | EncodedImage], tag: str, n: int
) -> list[tuple[bytes | None, bytes]]:
    """``n`` request records cycling through ``inputs``; id and key ``TAG-i``."""
    out: list[tuple[bytes | None, bytes]] = []
    for i in range(n):
        rid = f"{tag}-{i}"
        request = Request(v=1, id=rid, inputs={"image": inputs[i % len(inputs)]})
        out.append((rid.encode(), encode_request(request)))
    return out


# --- the engine alone ------------------------------------------------------------------


def load_run_engine(settings: Settings) -> Engine | GpuEngine:
    """The engine as the worker loads it (``worker.pipeline.worker``)."""
    s = settings
    return load_engine(
        s.model,
        device=s.gpu.device,
        max_batch_size=s.batching.max_batch_size,
        cuda_graphs=s.gpu.cuda_graphs,
        buckets=bucket_sizes(s.batching.max_batch_size, s.batching.preferred_batch_sizes),
    )


def timed(
    step: Callable[[], object],
    finish: Callable[[], object],
    seconds: float,
    max_runs: int = ENGINE_MAX_RUNS,
) -> float:
    """Seconds per ``step``: run it until ``seconds`` have passed or it ran
    ``max_runs`` times, then ``finish`` (waiting for work ``step`` only
    enqueued) inside the timed span."""
    runs = 0
    start = time.perf_counter()
    while True:
        step()
        runs += 1
        if runs >= max_runs or time.perf_counter() - start >= seconds:
            break
    finish()
    return (time.perf_counter() - start) / runs


def engine_rate(settings: Settings, images: Sequence[np.ndarray], seconds: float) -> float:
    """Images/s of the run's engine alone at ``batching.max_batch_size``."""
    engine = load_run_engine(settings)
    try:
        if is_gpu_backend(settings.model.backend):
            per_batch = gpu_batch_seconds(cast(GpuEngine, engine), settings, seconds)
        else:
            per_batch = cpu_batch_seconds(engine, settings, images, seconds)
    finally:
        engine.close()
    return settings.batching.max_batch_size / per_batch


def cpu_batch_seconds(
    engine: Engine, settings: Settings, images: Sequence[np.ndarray], seconds: float
) -> float:
    from worker.inference.preprocess import preprocess

    n = settings.batching.max_batch_size
    batch = preprocess([images[i % len(images)] for i in range(n)], settings.model.preprocess)
    feeds = {engine.info.io.inputs[0].name: batch}
    for _ in range(ENGINE_WARM_RUNS):
        engine.run(feeds)
    return timed(lambda: engine.run(feeds), lambda: None, seconds)


def gpu_batch_seconds(engine: GpuEngine, settings: Settings, seconds: float) -> float:
    """One slot made as the GPU stage makes it (``worker.inference.gpu.stage``:
    the layout, the buffers, the engine's context, which warms and captures
    every bucket); then the largest batch enqueued on the slot's stream over and
    over, synchronised once at the end. The input holds random normal values,
    not zeros: matrix units can run faster on zeros (13% for a bf16 product on an
    H200 of this workplace) and would flatter the engine."""
    import cupy

    from worker.engines.base import SlotShapes
    from worker.inference.gpu.slots import Allocations, Slot, SlotLayout

    device = settings.gpu.device
    n = settings.batching.max_batch_size
    b = settings.batching
    engine.prepare(SlotShapes(bucket_sizes(max(n, engine.min_batch_size), b.preferred_batch_sizes)))
    layout = SlotLayout(
        device=device,
        max_batch_size=max(n, engine.min_batch_size),
        engine_inputs=engine.inputs,
        engine_outputs=engine.outputs,
    )
    slot = Slot.create(0, layout, Allocations())
    try:
        with cupy.cuda.Device(device):
            slot.context = engine.create_context(slot)
            # The buffers were zero-filled on the legacy default stream (see the stage).
            cupy.cuda.runtime.deviceSynchronize()
            for x in slot.engine_inputs.values():
                x[...] = cupy.random.default_rng(0).standard_normal(x.shape).astype(x.dtype)
            cupy.cuda.runtime.deviceSynchronize()
            for _ in range(ENGINE_WARM_RUNS):
                engine.enqueue(slot, n, {})
            slot.stream.synchronize()
            return timed(lambda: engine.enqueue(slot, n, {}), slot.stream.synchronize, seconds)
    finally:
        slot.close()


# --- naming --------------------------------------------------------------------------

_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}


def device_slug(gpu_name: str) -> str:
    """A GPU's marketing name as a short file-name part: 'NVIDIA H100 80GB HBM3'
    -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA GeForce RTX 4090' ->
    'rtx4090'."""
    words = [w for w in re.split(r"[\s\-_]+", gpu_name.lower()) if w]
    words = [w for w in words if w not in _VENDOR_WORDS]
    if not words:
        return "gpu"
    slug = words[0]
    if slug.isalpha() and len(words) > 1:  # "rtx 4090", "rtx a6000"
        slug += words[1]
    return re.sub(r"[^a-z0-9]", "", slug) or "gpu"


def cpu_device() -> str:
    return f"cpu{os.cpu_count() or 1}"


def run_device(settings: Settings) -> str:
    """What the model runs on: the GPU's slug for a GPU backend, else cpu<cores>."""
    if not is_gpu_backend(settings.model.backend):
        return cpu_device()
    try:
        from worker.tools.build_engine import gpu_name

        return device_slug(gpu_name(settings.gpu.device))
    except Exception:  # boundary: no CuPy or no device; the engine run says why
        return "gpu"


def results_path(
    results_dir: Path, day: dt.date, device: str, payload: str, procs: int = 1
) -> Path:
    """``<dir>/<date>-<device>-<payload>.json`` (``-procsN`` added for N > 1
    processes), or ``...-2.json`` (and so on) when that exists: a rerun never
    overwrites a recorded result."""
    stem = f"{day.isoformat()}-{device}-{payload}" + (f"-procs{procs}" if procs > 1 else "")
    path = results_dir / f"{stem}.json"
    n = 2
    while path.exists():
        path = results_dir / f"{stem}-{n}.json"
        n += 1
    return path


# --- summaries (pure) ----------------------------------------------------------------


def percentiles_ms(values_us: Sequence[float], qs: Sequence[float]) -> list[float]:
    if not values_us:
        return [0.0 for _ in qs]
    return [round(float(v) / 1000.0, 3) for v in np.percentile(np.asarray(values_us), qs)]


def stage_summary(timings: Iterable[Mapping[str, int]]) -> dict[str, dict[str, float]]:
    """p50 and p99 of each stage of ``timing_us``, in ms: the contract's stages
    first, then any other the results carried (missing where no result had it)."""
    by_stage: dict[str, list[float]] = {}
    for timing in timings:
        for stage, us in timing.items():
            by_stage.setdefault(stage, []).append(float(us))
    order = [s for s in STAGES if s in by_stage] + sorted(set(by_stage) - set(STAGES))
    out = {}
    for stage in order:
        p50, p99 = percentiles_ms(by_stage[stage], [50, 99])
        out[stage] = {"p50_ms": p50, "p99_ms": p99}
    return out


def all_joined(assigned: Sequence[int], partitions: int) -> bool:
    """Every member holds partitions (as many as can: with more members than
    partitions, some hold none) and together they hold them all once."""
    holding = sum(1 for a in assigned if a > 0)
    return sum(assigned) == partitions and holding == min(len(assigned), partitions)


@dataclass(frozen=True)
class Sample:
    """The group and the GPU at one moment of the drain."""

    at: float  # monotonic
    assigned: tuple[int, ...]  # partitions per member (0 where unreachable)
    batch_sum: float  # infer_batch_size_sum over the members
    batch_count: float
    gpu_busy: float | None  # NVML utilisation, 0..1; None without NVML


def joined_at(samples: Sequence[Sample], partitions: int) -> Sample | None:
    """The first sample at which the whole group held its partitions."""
    return next((s for s in samples if all_joined(s.assigned, partitions)), None)


def busy_fraction(samples: Iterable[Sample], start: float, end: float) -> float | None:
    """Mean NVML utilisation of the samples taken in [start, end]; None if none."""
    values = [s.gpu_busy for s in samples if start <= s.at <= end and s.gpu_busy is not None]
    return round(float(np.mean(values)), 4) if values else None


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


# --- the group during the drain --------------------------------------------------------


class GroupMonitor:
    """Samples every member's metrics (and NVML, when given) while a drain runs.

    ``run --procs N``'s members serve metrics on consecutive ports; a member not
    up yet counts as holding no partitions."""

    def __init__(self, worker: WorkerProcess, procs: int, nvml: Any = None) -> None:
        self.worker, self.procs, self.nvml = worker, procs, nvml
        self.samples: list[Sample] = []

    def sample(self) -> Sample:
        assigned, batch_sum, batch_count = [], 0.0, 0.0
        for i in range(self.procs):
            try:
                m = scrape(self.worker.metrics_port + i, timeout=1.0)
            except OSError:
                assigned.append(0)
                continue
            assigned.append(int(m.get("infer_assigned_partitions", 0)))
            batch_sum += m.get("infer_batch_size_sum", 0.0)
            batch_count += m.get("infer_batch_size_count", 0.0)
        busy = None
        if self.nvml is not None:
            try:
                busy = self.nvml.sample().utilization_ratio
            except self.nvml.error:
                self.nvml = None  # stop asking; the fraction uses what was sampled
        return Sample(time.monotonic(), tuple(assigned), batch_sum, batch_count, busy)

    async def run(self) -> None:
        while True:
            self.samples.append(await asyncio.to_thread(self.sample))
            await asyncio.sleep(SAMPLE_INTERVAL)


def open_nvml(settings: Settings) -> tuple[Any, str | None]:
    """An NVML handle on the run's GPU, or None and the reason."""
    if not is_gpu_backend(settings.model.backend):
        return None, "the model runs on the CPU"
    from worker.inference.gpu.monitor import NvmlDevice, NvmlUnavailable, cuda_pci_bus_id

    device = settings.gpu.device
    try:
        return NvmlDevice(device, cuda_pci_bus_id(device)), None
    except NvmlUnavailable as exc:
        return None, str(exc)


# --- the run ---------------------------------------------------------------------------


class _Answers:
    """``Collector.collect``'s stop condition for the drain: every request key
    answered on the results topic, a DLQ record, or the worker gone."""

    def __init__(self, topics: Mapping[str, str], keys: set[bytes], worker: WorkerProcess):
        self.topics, self.keys, self.worker = topics, keys, worker
        self.answered: set[bytes | None] = set()
        self._seen = 0

    def __call__(self, collector: Collector) -> bool:
        results = collector.records[self.topics["results"]]
        self.answered.update(r.record_key for r in results[self._seen :])
        self._seen = len(results)
        return (
            self.keys <= self.answered
            or collector.count(self.topics["dlq"]) > 0
            or self.worker.proc.poll() is not None
        )


@dataclass
class WorkerDrain:
    rate: float  # results/s over the span (see the module docstring)
    first_to_last_rate: float
    seconds: float
    mean_batch: float
    gpu_busy: float | None
    join_seconds: float  # first result -> the whole group holding its partitions


def score_drain(
    results: Sequence[Collected], samples: Sequence[Sample], procs: int, partitions: int,
    final: Sample,
) -> WorkerDrain:  # fmt: skip
    """The drain's figures from its results and the samples taken during it
    (``final``: the members' metrics once it was over)."""
    times = sorted(r.received_at for r in results)
    first, last = times[0], times[-1]
    whole = arrivals_after(times, first) / (last - first) if last > first else 0.0
    if procs == 1:
        start, base = first, None
    else:
        joined = joined_at(samples, partitions)
        if joined is None or joined.at >= last:
            raise BenchError(
                f"the backlog was drained before all {procs} processes held their "
                f"partitions; send more records (--records)"
            )
        start, base = max(first, joined.at), joined
    counted = arrivals_after(times, start)
    seconds = last - start
    batches = final.batch_count - (base.batch_count if base else 0.0)
    rows = final.batch_sum - (base.batch_sum if base else 0.0)
    return WorkerDrain(
        rate=counted / seconds if seconds > 0 else 0.0,
        first_to_last_rate=whole,
        seconds=seconds,
        mean_batch=rows / batches if batches > 0 else 0.0,
        gpu_busy=busy_fraction(samples, start, last),
        join_seconds=max(0.0, start - first),
    )


async def _drain_worker(
    opts: ModelBenchOptions,
    topics: dict[str, str],
    worker: WorkerProcess,
    collector: Collector,
    keys: set[bytes],
    nvml: Any,
) -> WorkerDrain:
    monitor = GroupMonitor(worker, opts.procs, nvml)
    sampling = asyncio.create_task(monitor.run())
    answers = _Answers(topics, keys, worker)
    try:
        # Start-up (engine warm-up, compilation) is part of the wait, not the rate.
        await collector.collect(answers, 900.0 + len(keys) / 100)
    finally:
        sampling.cancel()
    if not keys <= answers.answered:
        raise BenchError(
            f"the worker answered {len(keys & answers.answered)} of {len(keys)} requests "
            f"(DLQ: {collector.count(topics['dlq'])}); its log:\n{worker.log_tail()}"
        )
    results = collector.records[topics["results"]]
    bad = [r for r in results if r.result().status != "ok"]
    if bad:
        error = bad[0].result().error
        raise BenchError(f"{len(bad)} results were errors, e.g. {error}")
    final = await asyncio.to_thread(monitor.sample)
    return score_drain(results, monitor.samples, opts.procs, opts.partitions, final)


async def _paced(
    broker: EmbeddedBroker,
    opts: ModelBenchOptions,
    settings: Settings,
    topics: dict[str, str],
    worker: WorkerProcess,
    collector: Collector,
    inputs: Sequence[Tensor | EncodedImage],
    rate: float,
) -> dict[str, Any]:
    n = max(1, round(rate * opts.duration))
    records = request_records(inputs, "paced", n)
    before = summed(await asyncio.to_thread(worker.member_metrics, opts.procs))
    b = settings.batching
    point = SweepPoint(b.max_batch_size, b.max_queue_delay_ms, rate, n)
    answers = await send_open_loop(
        broker.bootstrap, collector, topics, records, point,
        prefix=b"paced-", partitions=opts.partitions,
    )  # fmt: skip
    after = summed(await asyncio.to_thread(worker.member_metrics, opts.procs))
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    decoded = [r.result() for r in answers]
    return {
        "rate": round(rate, 1),
        "offered": round(point.offered, 1),
        "sent": point.sent,
        "answered": point.answered,
        "errors": point.errors,
        "throughput": round(point.throughput, 1),
        "sustained": point.sustained,
        "p50_ms": round(point.p50_ms, 3),
        "p95_ms": round(point.p95_ms, 3),
        "p99_ms": round(point.p99_ms, 3),
        "max_ms": round(point.max_ms, 3),
        "mean_batch": round(mean_batch_size(delta), 2),
        "stages": stage_summary(r.timing_us for r in decoded if r.status == "ok"),
    }


def _settings_record(settings: Settings, overrides: Mapping[str, str]) -> dict[str, Any]:
    s = settings
    return {
        "overrides": dict(overrides),
        "model": {"name": s.model.name, "path": s.model.path, "backend": s.model.backend,
                  "preprocess": asdict(s.model.preprocess), "torch": asdict(s.model.torch)},
        "batching": asdict(s.batching),
        "gpu": asdict(s.gpu) if is_gpu_backend(s.model.backend) else None,
    }  # fmt: skip


def command_line(opts: ModelBenchOptions, records: int) -> str:
    """The command that reruns this benchmark, every value spelled out."""
    argv = [
        "infer-worker", "bench", "--model", opts.model, "--payload", opts.payload,
        "--procs", str(opts.procs), "--records", str(records),
        "--partitions", str(opts.partitions), "--duration", f"{opts.duration:g}",
    ]  # fmt: skip
    if opts.rate:
        argv += ["--rate", f"{opts.rate:g}"]
    for key, value in opts.overrides.items():
        argv += ["--set", f"{key}={value}"]
    return shlex.join(argv)


async def _bench(opts: ModelBenchOptions) -> dict[str, Any]:
    check_options(opts)
    opts.partitions = max(opts.partitions, opts.procs)
    n = opts.records or DEFAULT_RECORDS[opts.model]
    started = time.monotonic()
    images = payload_images(opts.model)  # before building: a missing library exits 2 early
    overrides = run_overrides(opts)
    settings = load_settings(env=override_env(overrides))
    device = run_device(settings)
    inputs = [encode_image(img, opts.payload) for img in images]
    backlog = request_records(inputs, "drain", n)
    record_bytes = float(np.mean([len(v) for _, v in backlog]))
    print(
        f"infer-worker bench --model {opts.model} --payload {opts.payload}: {device}, "
        f"{settings.model.backend} engine, {opts.procs} process(es), {opts.partitions} "
        f"partitions, {n} records of {record_bytes:,.0f} bytes on average, embedded broker",
        flush=True,
    )
    _note(f"engine alone at batch {settings.batching.max_batch_size} ...")
    engine_img_s = await asyncio.to_thread(engine_rate, settings, images, opts.engine_seconds)
    _note(f"engine alone: {engine_img_s:,.0f} img/s")
    nvml, nvml_reason = open_nvml(settings)
    try:
        with EmbeddedBroker() as broker:
            ceiling, drain, paced, exit_code = await _on_broker(
                broker, opts, settings, overrides, inputs, backlog, nvml
            )
    finally:
        if nvml is not None:
            nvml.close()
    return {
        "date": dt.date.today().isoformat(),
        "device": device,
        "model": opts.model,
        "payload": opts.payload,
        "procs": opts.procs,
        "partitions": opts.partitions,
        "records": n,
        "record_bytes_mean": round(record_bytes, 1),
        "engine_batch": settings.batching.max_batch_size,
        "engine_img_s": round(engine_img_s, 1),
        "ingest_ceiling_rec_s": round(ceiling, 1),
        "worker_img_s": round(drain.rate, 1),
        "worker_first_to_last_img_s": round(drain.first_to_last_rate, 1),
        "worker_join_s": round(drain.join_seconds, 3),
        "worker_to_ceiling": ratio(drain.rate, ceiling),
        "worker_to_engine": ratio(drain.rate, engine_img_s),
        "mean_batch": round(drain.mean_batch, 2),
        "gpu_busy": drain.gpu_busy,
        "gpu_busy_note": nvml_reason,
        "paced": paced,
        "worker_exit": exit_code,
        "command": command_line(opts, n),
        "settings": _settings_record(settings, overrides),
        "versions": {"worker": __version__, "python": platform.python_version(),
                     **_library_versions(settings)},
        "wall_seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip


async def _on_broker(
    broker: EmbeddedBroker,
    opts: ModelBenchOptions,
    settings: Settings,
    overrides: Mapping[str, str],
    inputs: Sequence[Tensor | EncodedImage],
    backlog: Sequence[tuple[bytes | None, bytes]],
    nvml: Any,
) -> tuple[float, WorkerDrain, dict[str, Any], int]:
    topics = {kind: f"bench.{kind}" for kind in ("requests", "results", "dlq")}
    parts = opts.partitions
    await create_topics(
        broker.bootstrap,
        {topics["requests"]: parts, topics["results"]: parts, topics["dlq"]: 1},
    )
    # The whole backlog is in the topic before anything reads it: producing while
    # the worker drains would time the producer, slower than any consumer here.
    await produce_all(
        broker.bootstrap, topics["requests"], backlog, partition_of=lambda i: i % parts
    )
    ceiling = await drain_ceiling(broker.bootstrap, topics["requests"], len(backlog))
    _note(f"ingest ceiling: {ceiling.rate:,.0f} rec/s")
    worker = spawn_worker(
        broker.bootstrap,
        input_topics=[topics["requests"]],
        output_topic=topics["results"],
        dlq_topic=topics["dlq"],
        group_id="bench-worker",
        extra_env={"INFER_WORKER_LOGGING__LEVEL": "warning", **override_env(dict(overrides))},
        command=("run", "--procs", str(opts.procs)),
    )
    collector = Collector(broker.bootstrap, [topics["results"], topics["dlq"]])
    try:
        await collector.start()
        keys = {k for k, _ in backlog if k is not None}
        drain = await _drain_worker(opts, topics, worker, collector, keys, nvml)
        _note(f"worker drain: {drain.rate:,.0f} img/s, mean batch {drain.mean_batch:.1f}")
        rate = opts.rate or drain.rate / 2
        _note(f"paced at {rate:,.0f} requests/s for {opts.duration:g} s ...")
        paced = await _paced(broker, opts, settings, topics, worker, collector, inputs, rate)
        exit_code = await asyncio.to_thread(worker.terminate)
    finally:
        worker.kill()
        await collector.stop()
    if paced["answered"] != paced["sent"]:
        raise BenchError(
            f"paced run: {paced['answered']} of {paced['sent']} requests answered ok "
            f"({paced['errors']} errors)"
        )
    if exit_code != 0:
        raise BenchError(f"the worker exited with {exit_code}; its log: {worker.log_path}")
    return ceiling.rate, drain, paced, exit_code


def _library_versions(settings: Settings) -> dict[str, str]:
    names = ["onnxruntime"] if settings.model.backend == "onnxruntime" else ["torch", "cupy"]
    out = {}
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            out[name] = str(getattr(module, "__version__", "?"))
    return out


def _note(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


# --- output --------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(summary: Mapping[str, Any]) -> str:
    s, p = summary, summary["paced"]
    busy = s["gpu_busy"]
    busy_text = "n/a" if busy is None else f"{busy:.0%}"
    if busy is None and s["gpu_busy_note"]:
        busy_text += f"  ({s['gpu_busy_note']})"
    rows = [
        (f"engine alone, batch {s['engine_batch']}", f"{s['engine_img_s']:,.0f} img/s"),
        ("bare consumer drain (ceiling)", f"{s['ingest_ceiling_rec_s']:,.0f} rec/s"),
        (
            f"worker drain, run --procs {s['procs']}",
            f"{s['worker_img_s']:,.0f} img/s  ({_fmt(s['worker_to_ceiling'], '.3g')}x the "
            f"ceiling, {_fmt(s['worker_to_engine'], '.3g')}x the engine)",
        ),
        ("mean batch in the drain", f"{s['mean_batch']:.1f}"),
        ("GPU busy in the drain", busy_text),
        (
            f"paced, Poisson at {p['rate']:,.0f}/s",
            f"{p['throughput']:,.0f}/s answered" + ("" if p["sustained"] else "  (NOT sustained)"),
        ),
        (
            "  end to end",
            f"p50 {p['p50_ms']:.1f} ms  p95 {p['p95_ms']:.1f} ms  p99 {p['p99_ms']:.1f} ms",
        ),
    ]
    lines = [f"  {label:<32} {value}" for label, value in rows]
    for stage, q in p["stages"].items():
        lines.append(f"  {'  ' + stage:<32} p50 {q['p50_ms']:.2f} ms  p99 {q['p99_ms']:.2f} ms")
    return "\n".join(lines)


def write_summary(summary: Mapping[str, Any], opts: ModelBenchOptions) -> Path:
    day = dt.date.fromisoformat(summary["date"])
    opts.results_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(
        opts.results_dir, day, summary["device"], summary["payload"], summary["procs"]
    )
    text = json.dumps(summary, indent=2) + "\n"
    path.write_text(text)
    if opts.json_out:
        Path(opts.json_out).write_text(text)
    return path


def run_modelbench(opts: ModelBenchOptions) -> int:
    """0 when every request was answered ok and the worker stopped cleanly (the
    summary is written and printed); BenchError (exit 1) otherwise; ConfigError
    (exit 2) for bad options or a missing library."""
    with children_die_with_this_process("bench"):
        summary = asyncio.run(_bench(opts))
    print(table(summary))
    path = write_summary(summary, opts)
    print(f"results: {path}" + (f" (and {opts.json_out})" if opts.json_out else ""))
    return 0
