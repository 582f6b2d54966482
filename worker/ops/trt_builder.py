"""The TensorRT builder for ``build-engine``: parse the ONNX model, add one
optimization profile per slot over every input's range, set the precision, run
the build. Inputs: the batch dimension spans the requested batch range; any
other dynamic dimension (a text model's sequence) spans 1..``max_length``, with
its optimum at ``max_length``. INT8 calibration takes a model of one image
input. Not verified here: TensorRT cannot be installed on the machines this
project is tested on (DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from worker.flow.errors import ConfigError
from worker.model.preprocess import ImagePreprocess
from worker.ops.engine_checks import load_samples, make_calibrator
from worker.ops.files import atomic_write

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Calibration:
    samples: Path
    preprocess: ImagePreprocess
    cache_file: Path
    opt_batch: int


@dataclass(frozen=True)
class BuildRequest:
    precision: str
    batches: tuple[int, int, int]  # min, opt, max
    profiles: int
    max_length: int  # the upper bound of every dynamic non-batch dimension (0: none)
    workspace_mb: int
    device: int


def build_serialized(
    trt: Any,
    onnx_path: Path,
    request: BuildRequest,
    *,
    calibration: Calibration | None,
    timing_cache: Path | None,
    digest: str,
) -> bytes:
    """Runs the TensorRT builder and returns the serialized plan; the timing cache
    file, if given, is rewritten with what this build learned.

    The plan is copied out of TensorRT's host memory here, while the builder,
    network, parser and calibrator it came from are all still referenced."""
    import cupy

    from worker.compute.engines.tensorrt_plan import make_logger

    logger = make_logger(trt)
    with cupy.cuda.Device(request.device):
        builder = trt.Builder(logger)
        network, _parser, inputs = parse_network(trt, builder, logger, onnx_path)
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, request.workspace_mb << 20)
        first = add_profiles(builder, config, inputs, request, onnx_path)
        # Kept referenced until the build is done: TensorRT calls back into it.
        _calibrator = set_precision(trt, config, request, inputs, first, calibration)
        cache = attach_timing_cache(config, timing_cache)
        log.info("engine_build_started", onnx=str(onnx_path), precision=request.precision,
                 key=digest)  # fmt: skip
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise ConfigError(f"TensorRT failed to build {onnx_path}: {logger.last_errors()}")
        if timing_cache is not None:
            atomic_write(timing_cache, bytes(memoryview(cache.serialize())))
        return bytes(memoryview(serialized))


def parse_network(
    trt: Any, builder: Any, logger: Any, onnx_path: Path
) -> tuple[Any, Any, list[tuple[Any, tuple[int, ...]]]]:
    """The ONNX model as a TensorRT network, its parser (which holds the weights
    the network refers to: keep it until the build is done), and its inputs with
    their dims (-1: dynamic)."""
    network = builder.create_network(0)  # TensorRT 10: networks are explicit-batch
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConfigError(f"{onnx_path}: TensorRT cannot parse it: {errors}")
    inputs = []
    for i in range(network.num_inputs):
        inp = network.get_input(i)
        inputs.append((inp, tuple(int(d) for d in inp.shape)))
    return network, parser, inputs


def add_profiles(
    builder: Any,
    config: Any,
    inputs: list[tuple[Any, tuple[int, ...]]],
    request: BuildRequest,
    onnx_path: Path,
) -> Any:
    """``profiles`` identical optimization profiles: the batch dimension over the
    batch range, other dynamic dimensions over 1..max_length (optimum at the
    top); returns the first (None when nothing is dynamic, which takes none)."""
    dynamic = any(d < 0 for _, dims in inputs for d in dims)
    if not dynamic:
        log.warning("engine_static_shapes", ignored="min/opt/max batch")
        return None
    if any(d < 0 for _, dims in inputs for d in dims[1:]) and request.max_length < 1:
        raise ConfigError(
            f"{onnx_path}: an input has a dynamic dimension besides the batch; pass "
            "--max-length (the longest sequence the plan takes: model.inputs.*.max_length)"
        )
    first: Any = None
    for _ in range(request.profiles):
        profile = builder.create_optimization_profile()
        for inp, dims in inputs:
            shapes = []
            for pick, length in zip(request.batches, (1, request.max_length, request.max_length),
                                    strict=True):  # fmt: skip
                batch = dims[0] if dims[0] >= 0 else pick
                rest = tuple(d if d >= 0 else length for d in dims[1:])
                shapes.append((batch, *rest))
            profile.set_shape(inp.name, *shapes)
        config.add_optimization_profile(profile)
        first = first or profile
    return first


def set_precision(
    trt: Any,
    config: Any,
    request: BuildRequest,
    inputs: list[tuple[Any, tuple[int, ...]]],
    first_profile: Any,
    calibration: Calibration | None,
) -> Any:
    """Builder flags for ``precision``; returns the INT8 calibrator (or None)."""
    from worker.compute.engines.cuda import compute_capability, gpu_name

    calibrator = None
    precision = request.precision
    if precision == "fp32":
        # TensorRT enables TF32 (10-bit mantissa inputs to GEMMs/convolutions)
        # by default; "fp32" promises no reduced precision.
        config.clear_flag(trt.BuilderFlag.TF32)
    if precision in ("fp16", "int8", "fp8"):
        config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        assert calibration is not None
        if len(inputs) != 1:
            raise ConfigError("int8 calibration takes a model of one (image) input")
        ((inp, dims),) = inputs
        samples, _ = load_samples(calibration.samples, calibration.preprocess)
        # TensorRT 10 calibrates at the calibration profile's OPT shape (its MIN
        # and MAX are overwritten by OPT; getBatchSize is a deprecated leftover of
        # implicit batch), so every get_batch buffer must hold exactly that many
        # rows, in the network input's type.
        calib_batch = dims[0] if dims[0] >= 0 else calibration.opt_batch
        in_dtype = np.dtype(trt.nptype(inp.dtype))
        calibrator = make_calibrator(trt, samples, calib_batch, calibration.cache_file, in_dtype)
        config.set_flag(trt.BuilderFlag.INT8)
        config.int8_calibrator = calibrator
        if first_profile is not None:
            config.set_calibration_profile(first_profile)
    if precision == "fp8":
        if not hasattr(trt.BuilderFlag, "FP8"):
            raise ConfigError(f"TensorRT {trt.__version__} has no FP8 builder flag")
        if compute_capability(request.device) < (8, 9):
            raise ConfigError(
                f"{gpu_name(request.device)} has no FP8 (needs compute capability 8.9+: "
                "Ada, Hopper)"
            )
        config.set_flag(trt.BuilderFlag.FP8)
    return calibrator


def attach_timing_cache(config: Any, timing_cache: Path | None) -> Any:
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
