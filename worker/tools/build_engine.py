"""``infer-worker build-engine``: ONNX -> TensorRT plan, cached; and an accuracy check.

A plan is specific to the ONNX model, the TensorRT version, the GPU, the
precision and the batch profile, and building one takes minutes. So plans are
cached under a key of exactly those (``<out_dir>/<key>.plan``, with the key's
components in ``<key>.json``): building again with the same inputs returns the
existing file, which is what makes a deployment reproducible (pin the plan, or
pin the inputs and the timing cache). The timing cache (``--timing-cache``)
records the tactic choices, so a rebuild on the same GPU is fast and picks the
same kernels.

Precisions:
- ``fp32``: no reduced precision.
- ``fp16``: ``BuilderFlag.FP16``.
- ``int8``: ``BuilderFlag.INT8`` (+ FP16 for layers left unquantised), calibrated
  with ``IInt8EntropyCalibrator2`` on a sample ``.npz``: ``images`` (uint8
  [N, H, W, C], preprocessed here with ``worker.preprocess``, the worker's own
  contract) or ``inputs`` (already preprocessed float32).
- ``fp8``: ``BuilderFlag.FP8`` (+ FP16), on GPUs that have FP8 (compute 8.9+).
  TensorRT quantises to FP8 only where the ONNX has Q/DQ nodes (e.g. from NVIDIA
  ModelOpt); there is no FP8 calibrator.

``evaluate_accuracy`` runs a plan and the FP32 ONNX model (ONNX Runtime, CPU) on
the same samples and reports top-1 agreement and accuracy, which is how a
reduced-precision plan is accepted or rejected.

TensorRT and CuPy are imported inside functions: this module imports anywhere,
and ``run`` (the CLI) explains what is missing and returns 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import structlog

from worker.config import ModelConfig, PreprocessConfig, load_settings
from worker.errors import ConfigError, WorkerError
from worker.inference.preprocess import preprocess

log = structlog.get_logger(__name__)

Precision = Literal["fp32", "fp16", "int8", "fp8"]
PRECISIONS: Final[tuple[Precision, ...]] = ("fp32", "fp16", "int8", "fp8")
EXIT_UNAVAILABLE: Final = 2


@dataclass(frozen=True)
class EngineKey:
    """Everything a plan depends on; its digest names the cached file."""

    onnx_sha256: str
    tensorrt_version: str
    gpu_name: str
    precision: Precision
    min_batch: int
    opt_batch: int
    max_batch: int
    profiles: int = 1  # identical optimization profiles, one per concurrent slot
    calibration_sha256: str | None = None  # int8 only: other samples, other scales

    def digest(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _calibration_sha256(path: Path, cfg: PreprocessConfig) -> str:
    """The calibration data's identity: the samples file and, since ``images`` are
    preprocessed here, the preprocessing that turns them into model inputs."""
    digest = hashlib.sha256(file_sha256(path).encode())
    digest.update(json.dumps(asdict(cfg), sort_keys=True).encode())
    return digest.hexdigest()


def check_profile(min_batch: int, opt_batch: int, max_batch: int) -> None:
    if not 1 <= min_batch <= opt_batch <= max_batch:
        raise ConfigError(
            f"batch profile must satisfy 1 <= min <= opt <= max, got "
            f"{min_batch}/{opt_batch}/{max_batch}"
        )


def load_samples(path: Path, cfg: PreprocessConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """Model inputs (float32, preprocessed) and labels (if present) from an npz with
    ``images`` (uint8 [N, H, W, C], preprocessed here) or ``inputs``."""
    with np.load(path) as npz:
        labels = np.asarray(npz["labels"]) if "labels" in npz.files else None
        if "inputs" in npz.files:
            inputs = np.ascontiguousarray(npz["inputs"], dtype=np.float32)
        elif "images" in npz.files:
            images = np.asarray(npz["images"])
            if images.dtype != np.uint8 or images.ndim not in (3, 4):
                raise ConfigError(f"{path}: images must be uint8 [N, H, W(, C)]")
            if images.ndim == 3:
                images = images[..., None]
            f32 = PreprocessConfig(**{**asdict(cfg), "dtype": "float32"})
            inputs = preprocess(list(images), f32)
        else:
            raise ConfigError(f"{path}: needs an 'images' or an 'inputs' array")
    if len(inputs) == 0:
        raise ConfigError(f"{path}: no samples")
    if labels is not None and len(labels) != len(inputs):
        raise ConfigError(f"{path}: {len(labels)} labels for {len(inputs)} samples")
    return inputs, labels


# --- building ------------------------------------------------------------------------


def gpu_name(device: int = 0) -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _compute_capability(device: int) -> tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    return int(props["major"]), int(props["minor"])


def _atomic_write(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one, never a torn plan."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_engine(
    onnx_path: Path,
    out_dir: Path,
    *,
    precision: Precision = "fp16",
    min_batch: int = 1,
    opt_batch: int | None = None,
    max_batch: int = 64,
    profiles: int = 4,
    calibration_npz: Path | None = None,
    preprocess_cfg: PreprocessConfig | None = None,
    timing_cache: Path | None = None,
    workspace_mb: int = 4096,
    device: int = 0,
    force: bool = False,
) -> Path:
    """Build (or reuse) the plan for these inputs; returns its path.

    ``profiles`` identical optimization profiles are added, because TensorRT lets
    concurrently running execution contexts of a dynamic-shape engine use one
    profile each: the plan serves up to that many GPU slots (``gpu.num_slots``).
    """
    from worker.engines.tensorrt import import_tensorrt, make_logger

    trt = import_tensorrt()
    import cupy

    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    opt = max_batch if opt_batch is None else opt_batch
    check_profile(min_batch, opt, max_batch)
    if profiles < 1:
        raise ConfigError(f"profiles must be >= 1, got {profiles}")
    if precision == "int8" and calibration_npz is None:
        raise ConfigError("int8 needs --calibration SAMPLES.npz")
    key = EngineKey(
        onnx_sha256=file_sha256(onnx_path),
        tensorrt_version=str(trt.__version__),
        gpu_name=gpu_name(device),
        precision=precision,
        min_batch=min_batch,
        opt_batch=opt,
        max_batch=max_batch,
        profiles=profiles,
        calibration_sha256=(
            _calibration_sha256(calibration_npz, preprocess_cfg or PreprocessConfig())
            if precision == "int8" and calibration_npz is not None
            else None
        ),
    )
    digest = key.digest()
    plan_path = out_dir / f"{digest}.plan"
    if plan_path.is_file() and not force:
        log.info("engine_cache_hit", plan=str(plan_path))
        return plan_path

    logger = make_logger(trt)
    with cupy.cuda.Device(device):
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # TensorRT 10: networks are explicit-batch
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ConfigError(f"{onnx_path}: TensorRT cannot parse it: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
        if network.num_inputs != 1:
            raise ConfigError(f"{onnx_path}: expected one input, found {network.num_inputs}")
        inp = network.get_input(0)
        dims = tuple(int(d) for d in inp.shape)
        if any(d < 0 for d in dims[1:]):
            raise ConfigError(f"{onnx_path}: only the batch dimension may be dynamic ({dims})")
        shapes = ((min_batch, *dims[1:]), (opt, *dims[1:]), (max_batch, *dims[1:]))
        first_profile: Any = None
        if dims[0] >= 0:  # a static batch: no profiles, every run has dims[0] rows
            log.warning("engine_static_batch", batch=dims[0], ignored="min/opt/max batch")
        for _ in range(profiles if dims[0] < 0 else 0):
            profile = builder.create_optimization_profile()
            profile.set_shape(inp.name, *shapes)
            config.add_optimization_profile(profile)
            if first_profile is None:
                first_profile = profile

        calibrator = None
        if precision == "fp32":
            # TensorRT enables TF32 (10-bit mantissa inputs to GEMMs/convolutions)
            # by default; "fp32" promises no reduced precision.
            config.clear_flag(trt.BuilderFlag.TF32)
        if precision in ("fp16", "int8", "fp8"):
            config.set_flag(trt.BuilderFlag.FP16)
        if precision == "int8":
            assert calibration_npz is not None
            inputs, _ = load_samples(calibration_npz, preprocess_cfg or PreprocessConfig())
            cache_file = out_dir / f"{digest}.calib"
            # TensorRT 10 calibrates at the calibration profile's OPT shape (its MIN
            # and MAX are overwritten by OPT; getBatchSize is a deprecated leftover of
            # implicit batch), so every get_batch buffer must hold exactly that many
            # rows, in the network input's type.
            calib_batch = dims[0] if dims[0] >= 0 else opt
            in_dtype = np.dtype(trt.nptype(inp.dtype))
            calibrator = make_calibrator(trt, inputs, calib_batch, cache_file, in_dtype)
            config.set_flag(trt.BuilderFlag.INT8)
            config.int8_calibrator = calibrator
            if first_profile is not None:
                config.set_calibration_profile(first_profile)
        if precision == "fp8":
            if not hasattr(trt.BuilderFlag, "FP8"):
                raise ConfigError(f"TensorRT {trt.__version__} has no FP8 builder flag")
            if _compute_capability(device) < (8, 9):
                raise ConfigError(
                    f"{gpu_name(device)} has no FP8 (needs compute capability 8.9+: Ada, Hopper)"
                )
            config.set_flag(trt.BuilderFlag.FP8)

        cache_bytes = timing_cache.read_bytes() if timing_cache and timing_cache.is_file() else b""
        cache = config.create_timing_cache(cache_bytes)
        # set_timing_cache returns False (and the cache is not used) for one made on
        # another GPU or TensorRT version: start a fresh one, which then replaces
        # the stale file, rather than failing the build or serialising nothing.
        if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
            log.warning("timing_cache_mismatch", path=str(timing_cache), action="rebuilt")
            cache = config.create_timing_cache(b"")
            config.set_timing_cache(cache, ignore_mismatch=False)

        log.info("engine_build_started", onnx=str(onnx_path), precision=precision, key=digest)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise ConfigError(f"TensorRT failed to build {onnx_path}: {logger.last_errors()}")
        if timing_cache is not None:
            _atomic_write(timing_cache, bytes(memoryview(cache.serialize())))
    _atomic_write(plan_path, bytes(memoryview(serialized)))
    meta = {**asdict(key), "key": digest, "onnx": str(onnx_path)}
    _atomic_write(out_dir / f"{digest}.json", json.dumps(meta, indent=2).encode())
    log.info("engine_built", plan=str(plan_path))
    return plan_path


def make_calibrator(
    trt: Any,
    inputs: np.ndarray,
    batch_size: int,
    cache_file: Path,
    dtype: np.dtype[Any] | None = None,
) -> Any:
    """An ``IInt8EntropyCalibrator2`` over preprocessed float32 ``inputs``, fed in
    batches of exactly ``batch_size`` rows (the calibration profile's OPT batch)
    converted to the network input's ``dtype``; the calibration table is cached
    next to the plan, so rebuilding skips calibration."""
    import cupy

    dt = np.dtype(np.float32) if dtype is None else np.dtype(dtype)

    class _Calibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._inputs = inputs
            self._batch = batch_size
            self._next = 0
            self._device = cupy.empty((batch_size, *inputs.shape[1:]), dtype=dt)

        def get_batch_size(self) -> int:
            return self._batch

        def get_batch(self, names: Sequence[str]) -> list[int] | None:
            if self._next + self._batch > len(self._inputs):
                return None  # TensorRT calibrates on whole batches only
            chunk = self._inputs[self._next : self._next + self._batch]
            self._next += self._batch
            self._device.set(np.ascontiguousarray(chunk, dtype=dt))
            cupy.cuda.runtime.deviceSynchronize()  # build time, not the serving path
            return [int(self._device.data.ptr)]

        def read_calibration_cache(self) -> bytes | None:
            return cache_file.read_bytes() if cache_file.is_file() else None

        def write_calibration_cache(self, cache: Any) -> None:
            _atomic_write(cache_file, bytes(memoryview(cache)))

    if len(inputs) < batch_size:
        raise ConfigError(f"calibration needs at least {batch_size} samples, got {len(inputs)}")
    return _Calibrator()


# --- accuracy ------------------------------------------------------------------------


@dataclass(frozen=True)
class AccuracyReport:
    samples: int
    top1_agreement: float  # share of samples where engine and reference agree on top-1
    accuracy: float | None  # engine top-1 vs labels, when the samples have labels
    reference_accuracy: float | None
    max_abs_diff: float  # largest |engine - reference| over the raw outputs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_outputs(
    engine: np.ndarray, reference: np.ndarray, labels: np.ndarray | None = None
) -> AccuracyReport:
    """Top-1 agreement/accuracy of ``engine`` against ``reference`` outputs."""
    if engine.shape != reference.shape:
        raise ValueError(f"engine output {engine.shape} != reference {reference.shape}")
    n = engine.shape[0]
    e = engine.reshape(n, -1).astype(np.float32)
    r = reference.reshape(n, -1).astype(np.float32)
    top_e, top_r = e.argmax(axis=1), r.argmax(axis=1)
    agree = float(np.mean(top_e == top_r)) if n else math.nan
    acc = ref_acc = None
    if labels is not None:
        acc = float(np.mean(top_e == labels))
        ref_acc = float(np.mean(top_r == labels))
    diff = float(np.max(np.abs(e - r))) if e.size else 0.0
    return AccuracyReport(n, agree, acc, ref_acc, diff)


def evaluate_accuracy(
    plan: Path,
    samples_npz: Path,
    *,
    onnx_path: Path,
    preprocess_cfg: PreprocessConfig | None = None,
    reference: Literal["onnxruntime"] = "onnxruntime",
    output: str | None = None,
    device: int = 0,
) -> AccuracyReport:
    """Run ``plan`` and the FP32 ONNX model on the same samples and compare."""
    import onnxruntime as ort

    from worker.engines.tensorrt import TensorRTEngine

    if reference != "onnxruntime":
        raise ConfigError(f"unknown reference {reference!r}")
    cfg = preprocess_cfg or PreprocessConfig()
    inputs, labels = load_samples(samples_npz, cfg)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    in_name = session.get_inputs()[0].name
    out_name = output or session.get_outputs()[0].name
    engine = TensorRTEngine(
        plan, ModelConfig(path=str(plan), backend="tensorrt", preprocess=cfg), device=device
    )
    try:
        if out_name not in engine.info.output_names:
            raise ConfigError(
                f"output {out_name!r} not in engine outputs {engine.info.output_names}"
            )
        step = engine.max_batch_size
        got: list[np.ndarray] = []
        want: list[np.ndarray] = []
        for start in range(0, len(inputs), step):
            chunk = inputs[start : start + step]
            pad = max(0, engine.min_batch_size - len(chunk))
            padded = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)]) if pad else chunk
            got.append(engine.run(padded.astype(engine.input.dtype))[out_name][: len(chunk)])
            (ref,) = session.run([out_name], {in_name: chunk})
            want.append(np.asarray(ref))
    finally:
        engine.close()
    return compare_outputs(np.concatenate(got), np.concatenate(want), labels)


# --- CLI -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("onnx", type=Path, help="the ONNX model (FP32)")
    parser.add_argument("--out-dir", type=Path, default=Path("engines"), help="plan cache dir")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp16")
    parser.add_argument("--min-batch", type=int, default=1)
    parser.add_argument("--opt-batch", type=int, default=None, help="default: --max-batch")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument(
        "--profiles", type=int, default=4, help="optimization profiles = GPU slots it serves"
    )
    parser.add_argument(
        "--calibration", type=Path, default=None, help="int8: samples npz (images or inputs)"
    )
    parser.add_argument(
        "--timing-cache", type=Path, default=None, help="default: OUT_DIR/timing.cache"
    )
    parser.add_argument("--workspace-mb", type=int, default=4096)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument(
        "--config", type=Path, default=None, help="worker TOML whose [model.preprocess] to use"
    )
    parser.add_argument(
        "--evaluate", type=Path, default=None, help="samples npz: compare with ONNX Runtime"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")


def run(args: argparse.Namespace) -> int:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        print(
            "build-engine needs TensorRT (the 'tensorrt' Python package, version 10 or newer) "
            "and an NVIDIA GPU; it is not installed here. Install it from NVIDIA "
            "(https://docs.nvidia.com/deeplearning/tensorrt/) or use the torch/onnxruntime "
            "backends.",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    try:
        cfg = load_settings(args.config).model.preprocess if args.config else PreprocessConfig()
        plan = build_engine(
            args.onnx,
            args.out_dir,
            precision=args.precision,
            min_batch=args.min_batch,
            opt_batch=args.opt_batch,
            max_batch=args.max_batch,
            profiles=args.profiles,
            calibration_npz=args.calibration,
            preprocess_cfg=cfg,
            timing_cache=args.timing_cache or args.out_dir / "timing.cache",
            workspace_mb=args.workspace_mb,
            device=args.device,
            force=args.force,
        )
        print(plan)
        if args.evaluate is not None:
            report = evaluate_accuracy(
                plan, args.evaluate, onnx_path=args.onnx, preprocess_cfg=cfg, device=args.device
            )
            print(json.dumps(report.to_dict(), indent=2))
    except WorkerError as exc:
        print(f"build-engine: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infer-worker build-engine", description="Build a TensorRT plan from ONNX"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
