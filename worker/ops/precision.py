"""``build-engine --backend onnxruntime``: an ONNX model at INT8 or FP16 for the CPU path, cached.

- ``int8``: ONNX Runtime static quantization (``quantize_static``), QDQ format,
  of the ops that carry weights (Conv, ConvTranspose, Gemm, MatMul; ``--quantize-ops``),
  weights int8 in 7 bits (``reduce_range``: the same answers on every x86 CPU,
  ``onnx_convert.quantize``) per output channel, activations uint8, ranges from MinMax
  calibration on samples turned into engine feeds exactly as the worker serves
  them (``worker.ops.calibration``). Weights written as ``Constant`` nodes are
  made initializers first (else they stay float), and a model below opset 13 is
  converted to it (per-channel scales need it). Quantizing every op the
  quantizer handles was faster but broke models (BENCHMARKS.md: magika agreed
  on 3% of files), and one scale per tensor broke an OCR recogniser entirely.
- ``fp16``: ``onnxruntime.transformers.float16.convert_float_to_float16`` with
  ``keep_io_types``: the model's inputs and outputs stay float32, so requests
  and results do not change; ONNX Runtime's default block list keeps the ops it
  has no float16 kernels for in float32.

Both need ``onnx`` (the quantizer and the converter read and write model
protos with it), which the worker itself does not: ``pip install -e
'.[quantize]'``. Each build writes the model and, beside it, ``<out>.build.json``:
the source and its content hash, the precision and options, the calibration
source and sample count, the versions of onnxruntime and onnx, the output's
content hash and the model version results will carry (``content_version``, as
the engine computes it), the top-1 agreement and largest difference against
the float32 model on the calibration samples, and when and how long it took.

The cache key is the content of everything the output depends on: the source
model's SHA-256, the precision and options, the library versions and the SHA-256
of the calibration feeds themselves (so the same samples stored another way, or
re-read from the same records, hit the cache, and a change of preprocessing
misses it). A build whose record carries its key, beside an output whose
content still has the recorded hash, is not redone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

import structlog

from worker.config import Settings
from worker.flow.errors import ConfigError
from worker.model.files import content_version, resolve_model_path
from worker.ops.calibration import CalibrationSet, TopicSource, from_files, from_topic
from worker.ops.files import atomic_write, file_sha256
from worker.ops.onnx_convert import (
    WEIGHTED_OPS,
    check_agreement,
    check_weights,
    import_onnx,
    quantize,
    to_float16,
    weights_as_initializers,
)

log = structlog.get_logger(__name__)

CpuPrecision = Literal["fp16", "int8"]
CPU_PRECISIONS: Final[tuple[CpuPrecision, ...]] = ("fp16", "int8")


@dataclass(frozen=True)
class PrecisionBuild:
    """What to build (``settings``: the worker's, whose [model] binds the inputs)."""

    settings: Settings
    precision: CpuPrecision
    out_dir: Path = Path("engines")
    out: Path | None = None  # default: OUT_DIR/<key>.onnx
    calibration_files: tuple[Path, ...] = ()
    calibration_topic: str | None = None
    calibration_count: int = 256
    per_channel: bool = True
    # Weights within +-64, so every x86 CPU computes the same answers (onnx_convert.
    # quantize says why); False only to measure what full range would change.
    reduce_range: bool = True
    # The op types int8 quantizes: WEIGHTED_OPS by default; () = every op type
    # ONNX Runtime's quantizer handles (elementwise, pooling, ... too).
    quantize_ops: tuple[str, ...] | None = None
    batch_size: int = 32  # rows per calibration run (a model's fixed batch wins)
    force: bool = False


@dataclass(frozen=True)
class PrecisionKey:
    """Everything the output depends on; its digest names the cached file."""

    source_sha256: str
    precision: CpuPrecision
    onnxruntime_version: str
    onnx_version: str
    options: tuple[tuple[str, Any], ...]
    calibration_sha256: str | None = None

    def digest(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Built:
    path: Path
    record: dict[str, Any] = field(hash=False)
    cached: bool = False


def record_path(out: Path) -> Path:
    return out.with_name(out.name + ".build.json")


def build_precision(req: PrecisionBuild) -> Built:
    """Build (or reuse) ``req``'s model; returns its path and build record."""
    import onnxruntime as ort

    onnx = import_onnx()
    _check_request(req)
    started = time.monotonic()
    model_cfg = dataclasses.replace(req.settings.model, backend="onnxruntime")
    source = resolve_model_path(model_cfg.path)
    proto = onnx.load(str(source))
    check_weights(proto, req.precision, source)
    calibration = _calibration(req, source)
    options = _options(req)
    key = PrecisionKey(
        source_sha256=file_sha256(source),
        precision=req.precision,
        onnxruntime_version=ort.__version__,
        onnx_version=onnx.__version__,
        options=tuple(sorted(options.items())),
        calibration_sha256=calibration.sha256() if calibration else None,
    )
    digest = key.digest()
    out = req.out or req.out_dir / f"{digest}.onnx"
    cached = _cached(out, digest)
    if cached is not None and not req.force:
        log.info("precision_cache_hit", model=str(out), key=digest)
        return Built(out, cached, cached=True)

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if req.precision == "int8":
            assert calibration is not None
            prepared = tmp.with_name(tmp.name + ".prepared.onnx")
            try:
                onnx.save(weights_as_initializers(onnx, proto, req.per_channel), str(prepared))
                quantize(
                    prepared, tmp, calibration, req.per_channel, _quantized_ops(req),
                    req.reduce_range,
                )  # fmt: skip
            finally:
                prepared.unlink(missing_ok=True)
        else:
            to_float16(onnx, proto, tmp)
        agreement = check_agreement(source, tmp, calibration)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    record = {
        "key": digest,
        "source": {"path": str(source), "sha256": key.source_sha256,
                   "version": content_version(source)},
        "precision": req.precision,
        "options": options,
        "calibration": None if calibration is None else {
            **calibration.source, "samples": calibration.samples,
            "engine_runs": len(calibration.runs), "sha256": key.calibration_sha256,
        },
        "onnxruntime_version": key.onnxruntime_version,
        "onnx_version": key.onnx_version,
        "output": {"path": str(out), "sha256": file_sha256(out), "bytes": out.stat().st_size},
        "model_version": content_version(out),
        "agreement_with_float32": agreement,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(time.monotonic() - started, 3),
    }  # fmt: skip
    atomic_write(record_path(out), (json.dumps(record, indent=2) + "\n").encode())
    log.info("precision_built", model=str(out), key=digest, version=record["model_version"])
    return Built(out, record)


def _check_request(req: PrecisionBuild) -> None:
    """Refuses what cannot build, before any model is read."""
    if req.precision not in CPU_PRECISIONS:
        raise ConfigError(
            f"--precision {req.precision}: --backend onnxruntime builds "
            f"{' or '.join(CPU_PRECISIONS)} (fp32 is the model itself)"
        )
    files, topic = bool(req.calibration_files), req.calibration_topic is not None
    if req.precision == "int8" and files == topic:
        raise ConfigError(
            "--precision int8 needs calibration samples: --calibration-files FILE|DIR ... "
            "or --calibration-topic TOPIC (one of them)"
        )
    if req.precision == "fp16" and topic:
        raise ConfigError("--calibration-topic: fp16 is not calibrated (leave it out)")
    if req.calibration_count < 1:
        raise ConfigError(f"--calibration-count must be >= 1, got {req.calibration_count}")
    if req.settings.model.state:
        raise ConfigError(
            "model.state: a stateful model's states are not calibration samples; "
            "build it without [model.state] configured"
        )


def _calibration(req: PrecisionBuild, source: Path) -> CalibrationSet | None:
    """The calibration feeds through the worker's binding of this model (or None)."""
    if not req.calibration_files and req.calibration_topic is None:
        return None
    from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
    from worker.model.inputs import bind_model
    from worker.model.inputs.binding import fit_limits

    s = req.settings
    model = dataclasses.replace(s.model, backend="onnxruntime")
    engine = OnnxRuntimeEngine(source, model)
    try:
        binding = bind_model(model, engine.info.io, s.limits, s.batching)
    finally:
        engine.close()
    limits = fit_limits(s.limits, binding.inputs)
    if req.calibration_files:
        return from_files(
            req.calibration_files, binding.inputs, req.calibration_count, req.batch_size
        )
    assert req.calibration_topic is not None
    topic = TopicSource(s.kafka, req.calibration_topic, req.calibration_count)
    return from_topic(topic, binding.inputs, limits, s.kafka.content_type, req.batch_size)


def _options(req: PrecisionBuild) -> dict[str, Any]:
    if req.precision == "fp16":
        return {"converter": "convert_float_to_float16", "keep_io_types": True}
    return {
        "quantizer": "quantize_static",
        "format": "QDQ",
        "weight_type": "QInt8",
        "reduce_range": req.reduce_range,
        "activation_type": "QUInt8",
        "per_channel": req.per_channel,
        "calibrate_method": "MinMax",
        "op_types": sorted(_quantized_ops(req)) or "all",
    }


def _quantized_ops(req: PrecisionBuild) -> frozenset[str]:
    return WEIGHTED_OPS if req.quantize_ops is None else frozenset(req.quantize_ops)


def _cached(out: Path, digest: str) -> dict[str, Any] | None:
    """The record of a finished build of ``digest`` at ``out``, if both are intact."""
    record = record_path(out)
    if not (out.is_file() and record.is_file()):
        return None
    try:
        meta = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("key") != digest:
        return None
    if meta.get("output", {}).get("sha256") != file_sha256(out):
        return None  # the file was replaced since: build again
    return meta
