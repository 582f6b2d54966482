"""``infer-worker build-engine``: ONNX -> TensorRT plan, cached; and an accuracy check.

(``--backend torch``: ``worker.ops.build_torch``; ``--backend onnxruntime``, INT8 and
FP16 ONNX models for the CPU path: ``worker.ops.precision``.)

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
  [N, H, W, C], preprocessed with ``worker.model.preprocess``, the worker's own
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

import structlog

from worker.compute.engines.cuda import gpu_name
from worker.config import PreprocessConfig, load_settings
from worker.flow.errors import ConfigError, WorkerError
from worker.model.preprocess import ImagePreprocess
from worker.ops import precision_cli
from worker.ops.engine_checks import (
    AccuracyReport,
    calibration_sha256,
    compare_outputs,
    evaluate_accuracy,
    load_samples,
    onnx_image_preprocess,
)
from worker.ops.files import atomic_write, file_sha256

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
    max_length: int = 0  # the top of dynamic non-batch dimensions (sequence models)

    def digest(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def check_profile(min_batch: int, opt_batch: int, max_batch: int) -> None:
    if not 1 <= min_batch <= opt_batch <= max_batch:
        raise ConfigError(
            f"batch profile must satisfy 1 <= min <= opt <= max, got "
            f"{min_batch}/{opt_batch}/{max_batch}"
        )


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
    max_length: int = 0,
) -> Path:
    """Build (or reuse) the plan for these inputs; returns its path.

    ``profiles`` identical optimization profiles are added, because TensorRT lets
    concurrently running execution contexts of a dynamic-shape engine use one
    profile each: the plan serves up to that many GPU slots (``gpu.num_slots``).
    """
    from worker.compute.engines.tensorrt_plan import import_tensorrt
    from worker.ops.trt_builder import BuildRequest, Calibration, build_serialized

    trt = import_tensorrt()
    opt = max_batch if opt_batch is None else opt_batch
    batches = (min_batch, opt, max_batch)
    _check_request(precision, batches, profiles, calibration_npz)
    # Calibration images are preprocessed as the worker would, for this model.
    pp = onnx_image_preprocess(onnx_path, preprocess_cfg) if calibration_npz else None
    key = _engine_key(trt, onnx_path, precision, batches, profiles, calibration_npz, pp, device)
    if max_length:
        key = EngineKey(**{**asdict(key), "max_length": max_length})
    digest = key.digest()
    plan_path = out_dir / f"{digest}.plan"
    if plan_path.is_file() and not force:
        log.info("engine_cache_hit", plan=str(plan_path))
        return plan_path

    calibration = None
    if precision == "int8":
        assert calibration_npz is not None and pp is not None
        calibration = Calibration(calibration_npz, pp, out_dir / f"{digest}.calib", opt)
    request = BuildRequest(precision, batches, profiles, max_length, workspace_mb, device)
    plan = build_serialized(
        trt, onnx_path, request, calibration=calibration, timing_cache=timing_cache, digest=digest
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
    preprocess_cfg: ImagePreprocess | None,
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
            if precision == "int8" and calibration_npz is not None and preprocess_cfg is not None
            else None
        ),
    )


def _write_plan(out_dir: Path, key: EngineKey, onnx_path: Path, plan: bytes) -> None:
    """``<digest>.plan`` and, beside it, ``<digest>.json`` naming what it was built
    from and ``<digest>.io.json``: the ONNX model's inputs and outputs with the
    symbols of their dynamic dimensions, which the plan does not keep (the
    engine reads them to cut per-token outputs back to each request's length)."""
    from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
    from worker.compute.engines.tensorrt_plan import io_json
    from worker.config import ModelConfig

    digest = key.digest()
    atomic_write(out_dir / f"{digest}.plan", plan)
    meta = {**asdict(key), "key": digest, "onnx": str(onnx_path)}
    atomic_write(out_dir / f"{digest}.json", json.dumps(meta, indent=2).encode())
    described = OnnxRuntimeEngine(onnx_path, ModelConfig(path=str(onnx_path)))
    atomic_write(out_dir / f"{digest}.io.json", io_json(described.info.io).encode())


# --- CLI -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="tensorrt: the ONNX model (FP32); torch: torchvision:NAME, FILE.py:CALLABLE "
        "or package.module:CALLABLE (a zero-argument factory returning an nn.Module); "
        "onnxruntime: the ONNX model (FP32) or builtin:NAME",
    )
    parser.add_argument(
        "--backend",
        choices=("tensorrt", "torch", "onnxruntime"),
        default="tensorrt",
        help="tensorrt: a plan (default); torch: an exported program (.pt2) for model.backend "
        "= 'torch' (--max-batch, --config, --out-dir and --force apply); onnxruntime: an "
        "INT8 or FP16 ONNX model for the CPU path (see below)",
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
        "--max-length", type=int, default=0,
        help="the longest sequence, for models with a dynamic dimension besides the batch "
        "(a text model's: its model.inputs.*.max_length)",
    )  # fmt: skip
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
    precision_cli.add_arguments(parser)


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes, got {text!r}") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return dims


def run(args: argparse.Namespace) -> int:
    if args.backend == "onnxruntime":
        return precision_cli.run(args)
    if args.backend == "torch":
        from worker.ops.build_torch import input_shape_of, run_cli, torch_missing

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
            max_length=args.max_length,
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
