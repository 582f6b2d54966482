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
  [N, H, W, C], preprocessed with ``worker.inference.preprocess``, the worker's own
  contract) or ``inputs`` (already preprocessed float32).
- ``fp8``: ``BuilderFlag.FP8`` (+ FP16), on GPUs that have FP8 (compute 8.9+).
  TensorRT quantises to FP8 only where the ONNX has Q/DQ nodes (e.g. from NVIDIA
  ModelOpt); there is no FP8 calibrator.

``evaluate_accuracy`` (in ``engine_checks``) runs a plan and the FP32 ONNX model
(ONNX Runtime, CPU) on the same samples and reports top-1 agreement and accuracy, which is how a
reduced-precision plan is accepted or rejected.

TensorRT and CuPy are imported inside functions: this module imports anywhere,
and ``run`` (the CLI) explains what is missing and returns 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import structlog

from worker.config import PreprocessConfig, load_settings
from worker.errors import ConfigError, WorkerError
from worker.tools.engine_checks import (
    AccuracyReport,
    calibration_sha256,
    compare_outputs,
    evaluate_accuracy,
    load_samples,
    make_calibrator,
)
from worker.tools.files import atomic_write, file_sha256

__all__ = [
    "PRECISIONS",
    "AccuracyReport",
    "EngineKey",
    "add_arguments",
    "build_engine",
    "check_profile",
    "compare_outputs",
    "evaluate_accuracy",
    "file_sha256",
    "load_samples",
    "main",
    "run",
]

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


def check_profile(min_batch: int, opt_batch: int, max_batch: int) -> None:
    if not 1 <= min_batch <= opt_batch <= max_batch:
        raise ConfigError(
            f"batch profile must satisfy 1 <= min <= opt <= max, got "
            f"{min_batch}/{opt_batch}/{max_batch}"
        )


def gpu_name(device: int = 0) -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _compute_capability(device: int) -> tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    return int(props["major"]), int(props["minor"])


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
    from worker.engines.tensorrt import import_tensorrt

    trt = import_tensorrt()
    opt = max_batch if opt_batch is None else opt_batch
    batches = (min_batch, opt, max_batch)
    _check_request(precision, batches, profiles, calibration_npz)
    pp = preprocess_cfg or PreprocessConfig()
    key = _engine_key(trt, onnx_path, precision, batches, profiles, calibration_npz, pp, device)
    digest = key.digest()
    plan_path = out_dir / f"{digest}.plan"
    if plan_path.is_file() and not force:
        log.info("engine_cache_hit", plan=str(plan_path))
        return plan_path

    calibration = None
    if precision == "int8":
        assert calibration_npz is not None
        calibration = _Calibration(calibration_npz, pp, out_dir / f"{digest}.calib", opt)
    plan = _build_serialized(
        trt,
        onnx_path,
        key,
        calibration=calibration,
        timing_cache=timing_cache,
        workspace_mb=workspace_mb,
        device=device,
    )
    _write_plan(out_dir, key, onnx_path, plan)
    log.info("engine_built", plan=str(plan_path))
    return plan_path


def _check_request(
    precision: Precision,
    batches: tuple[int, int, int],
    profiles: int,
    calibration_npz: Path | None,
) -> None:
    """Rejects what cannot build, before hashing the model or touching the GPU."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    check_profile(*batches)
    if profiles < 1:
        raise ConfigError(f"profiles must be >= 1, got {profiles}")
    if precision == "int8" and calibration_npz is None:
        raise ConfigError("int8 needs --calibration SAMPLES.npz")


def _engine_key(
    trt: Any,
    onnx_path: Path,
    precision: Precision,
    batches: tuple[int, int, int],
    profiles: int,
    calibration_npz: Path | None,
    preprocess_cfg: PreprocessConfig,
    device: int,
) -> EngineKey:
    """The cache key of the plan these inputs would build."""
    min_batch, opt_batch, max_batch = batches
    return EngineKey(
        onnx_sha256=file_sha256(onnx_path),
        tensorrt_version=str(trt.__version__),
        gpu_name=gpu_name(device),
        precision=precision,
        min_batch=min_batch,
        opt_batch=opt_batch,
        max_batch=max_batch,
        profiles=profiles,
        calibration_sha256=(
            calibration_sha256(calibration_npz, preprocess_cfg)
            if precision == "int8" and calibration_npz is not None
            else None
        ),
    )


def _build_serialized(
    trt: Any,
    onnx_path: Path,
    key: EngineKey,
    *,
    calibration: _Calibration | None,
    timing_cache: Path | None,
    workspace_mb: int,
    device: int,
) -> bytes:
    """Runs the TensorRT builder for ``key`` and returns the serialized plan; the
    timing cache file, if given, is rewritten with what this build learned.

    The plan is copied out of TensorRT's host memory here, while the builder,
    network, parser and calibrator it came from are all still referenced."""
    import cupy

    from worker.engines.tensorrt import make_logger

    logger = make_logger(trt)
    with cupy.cuda.Device(device):
        builder = trt.Builder(logger)
        network, _parser, inp, dims = _parse_network(trt, builder, logger, onnx_path)
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
        batches = (key.min_batch, key.opt_batch, key.max_batch)
        first_profile = _add_profiles(builder, config, inp, dims, batches, key.profiles)
        # Kept referenced until the build is done: TensorRT calls back into it.
        _calibrator = _set_precision(
            trt, config, key.precision, inp, dims, first_profile, calibration, device
        )
        cache = _attach_timing_cache(config, timing_cache)
        log.info(
            "engine_build_started", onnx=str(onnx_path), precision=key.precision, key=key.digest()
        )
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise ConfigError(f"TensorRT failed to build {onnx_path}: {logger.last_errors()}")
        if timing_cache is not None:
            atomic_write(timing_cache, bytes(memoryview(cache.serialize())))
        return bytes(memoryview(serialized))


def _write_plan(out_dir: Path, key: EngineKey, onnx_path: Path, plan: bytes) -> None:
    """``<digest>.plan`` and, beside it, ``<digest>.json`` naming what it was built from."""
    digest = key.digest()
    atomic_write(out_dir / f"{digest}.plan", plan)
    meta = {**asdict(key), "key": digest, "onnx": str(onnx_path)}
    atomic_write(out_dir / f"{digest}.json", json.dumps(meta, indent=2).encode())


def _parse_network(
    trt: Any, builder: Any, logger: Any, onnx_path: Path
) -> tuple[Any, Any, Any, tuple[int, ...]]:
    """The ONNX model as a TensorRT network, its parser (which holds the weights
    the network refers to: keep it until the build is done), its one input and
    that input's dims."""
    network = builder.create_network(0)  # TensorRT 10: networks are explicit-batch
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConfigError(f"{onnx_path}: TensorRT cannot parse it: {errors}")
    if network.num_inputs != 1:
        raise ConfigError(f"{onnx_path}: expected one input, found {network.num_inputs}")
    inp = network.get_input(0)
    dims = tuple(int(d) for d in inp.shape)
    if any(d < 0 for d in dims[1:]):
        raise ConfigError(f"{onnx_path}: only the batch dimension may be dynamic ({dims})")
    return network, parser, inp, dims


def _add_profiles(
    builder: Any,
    config: Any,
    inp: Any,
    dims: tuple[int, ...],
    batches: tuple[int, int, int],
    profiles: int,
) -> Any:
    """``profiles`` identical optimization profiles over the batch range; returns
    the first (None for a static batch, which takes no profiles)."""
    shapes = tuple((b, *dims[1:]) for b in batches)
    first_profile: Any = None
    if dims[0] >= 0:  # a static batch: no profiles, every run has dims[0] rows
        log.warning("engine_static_batch", batch=dims[0], ignored="min/opt/max batch")
    for _ in range(profiles if dims[0] < 0 else 0):
        profile = builder.create_optimization_profile()
        profile.set_shape(inp.name, *shapes)
        config.add_optimization_profile(profile)
        if first_profile is None:
            first_profile = profile
    return first_profile


@dataclass(frozen=True)
class _Calibration:
    samples: Path
    preprocess: PreprocessConfig
    cache_file: Path
    opt_batch: int


def _set_precision(
    trt: Any,
    config: Any,
    precision: Precision,
    inp: Any,
    dims: tuple[int, ...],
    first_profile: Any,
    calibration: _Calibration | None,
    device: int,
) -> Any:
    """Builder flags for ``precision``; returns the INT8 calibrator (or None)."""
    calibrator = None
    if precision == "fp32":
        # TensorRT enables TF32 (10-bit mantissa inputs to GEMMs/convolutions)
        # by default; "fp32" promises no reduced precision.
        config.clear_flag(trt.BuilderFlag.TF32)
    if precision in ("fp16", "int8", "fp8"):
        config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        assert calibration is not None
        inputs, _ = load_samples(calibration.samples, calibration.preprocess)
        # TensorRT 10 calibrates at the calibration profile's OPT shape (its MIN
        # and MAX are overwritten by OPT; getBatchSize is a deprecated leftover of
        # implicit batch), so every get_batch buffer must hold exactly that many
        # rows, in the network input's type.
        calib_batch = dims[0] if dims[0] >= 0 else calibration.opt_batch
        in_dtype = np.dtype(trt.nptype(inp.dtype))
        calibrator = make_calibrator(trt, inputs, calib_batch, calibration.cache_file, in_dtype)
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
    return calibrator


def _attach_timing_cache(config: Any, timing_cache: Path | None) -> Any:
    cache_bytes = timing_cache.read_bytes() if timing_cache and timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    # set_timing_cache returns False (and the cache is not used) for one made on
    # another GPU or TensorRT version: start a fresh one, which then replaces
    # the stale file, rather than failing the build or serialising nothing.
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
        log.warning("timing_cache_mismatch", path=str(timing_cache), action="rebuilt")
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


# --- CLI -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="tensorrt: the ONNX model (FP32); torch: torchvision:NAME, FILE.py:CALLABLE "
        "or package.module:CALLABLE (a zero-argument factory returning an nn.Module)",
    )
    parser.add_argument(
        "--backend",
        choices=("tensorrt", "torch"),
        default="tensorrt",
        help="tensorrt: a plan (default); torch: an exported program (.pt2) for model.backend "
        "= 'torch' (--max-batch, --config, --out-dir and --force apply)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("engines"), help="cache dir")
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="fp16", help="default fp16; int8 needs samples"
    )
    parser.add_argument("--min-batch", type=int, default=1, help="smallest batch (default 1)")
    parser.add_argument("--opt-batch", type=int, default=None, help="default: --max-batch")
    parser.add_argument(
        "--max-batch", type=int, default=64, help="largest batch (batching.max_batch_size)"
    )
    parser.add_argument(
        "--profiles", type=int, default=4, help="optimization profiles = GPU slots it serves"
    )
    parser.add_argument(
        "--calibration", type=Path, default=None, help="int8: samples npz (images or inputs)"
    )
    parser.add_argument(
        "--timing-cache", type=Path, default=None, help="default: OUT_DIR/timing.cache"
    )
    parser.add_argument(
        "--workspace-mb", type=int, default=4096, help="builder workspace (default 4096 MiB)"
    )
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    parser.add_argument(
        "--config", type=Path, default=None, help="worker TOML whose [model.preprocess] to use"
    )
    parser.add_argument(
        "--evaluate", type=Path, default=None, help="samples npz: compare with ONNX Runtime"
    )
    parser.add_argument(
        "--input-shape",
        type=_shape,
        default=None,
        help="torch: one request's model input without the batch, e.g. 3,224,224 "
        "(default: what --config's [model.preprocess] produces)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes, got {text!r}") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return dims


def run(args: argparse.Namespace) -> int:
    if args.backend == "torch":
        from worker.tools.build_torch import input_shape_of, run_cli, torch_missing

        if torch_missing():
            return EXIT_UNAVAILABLE
        try:
            shape = args.input_shape or (
                input_shape_of(load_settings(args.config).model.preprocess) if args.config else None
            )
            if shape is None:
                raise ConfigError("--backend torch needs --input-shape or --config")
            return run_cli(args.model, args.out_dir, args.max_batch, shape, args.force)
        except WorkerError as exc:
            print(f"build-engine: {exc}", file=sys.stderr)
            return 1
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
        onnx = Path(args.model)
        plan = build_engine(
            onnx,
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
                plan, args.evaluate, onnx_path=onnx, preprocess_cfg=cfg, device=args.device
            )
            print(json.dumps(report.to_dict(), indent=2))
    except WorkerError as exc:
        print(f"build-engine: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infer-worker build-engine",
        description="Build a TensorRT plan from ONNX, or a torch exported program",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
