"""``build-engine --backend onnxruntime``: an ONNX model at INT8 or FP16 for the CPU path, cached.

- ``int8``: ONNX Runtime static quantization (``quantize_static``), QDQ format,
  weights int8 per output channel, activations uint8 (U8S8: what ONNX Runtime's
  x86 kernels are fastest at), ranges from MinMax calibration on samples turned
  into engine feeds exactly as the worker serves them (``worker.ops.calibration``).
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import structlog

from worker.config import Settings
from worker.flow.errors import ConfigError, WorkerError
from worker.model.files import content_version, resolve_model_path
from worker.ops.calibration import CalibrationSet, TopicSource, from_files, from_topic
from worker.ops.files import atomic_write, file_sha256

log = structlog.get_logger(__name__)

CpuPrecision = Literal["fp16", "int8"]
CPU_PRECISIONS: Final[tuple[CpuPrecision, ...]] = ("fp16", "int8")
# The ops whose weights int8 quantizes (what makes a model worth quantizing).
WEIGHTED_OPS: Final = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
FLOAT: Final = 1  # onnx.TensorProto.FLOAT


class BuildFailed(WorkerError):
    """The quantizer or converter failed, or ONNX Runtime cannot run its output."""


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


def import_onnx() -> Any:
    """``onnx``, once ONNX Runtime's quantization tools are known to import."""
    try:
        import onnx
        import onnxruntime.quantization  # noqa: F401 (needs onnx and ml_dtypes)
    except ImportError as exc:
        raise ConfigError(
            f"build-engine --backend onnxruntime needs {exc.name or 'onnx'} (ONNX Runtime's "
            "quantizer and float16 converter read models with onnx): "
            "pip install -e '.[quantize]'"
        ) from None
    return onnx


def build_precision(req: PrecisionBuild) -> Built:
    """Build (or reuse) ``req``'s model; returns its path and build record."""
    import onnxruntime as ort

    onnx = import_onnx()
    _check_request(req)
    started = time.monotonic()
    model_cfg = dataclasses.replace(req.settings.model, backend="onnxruntime")
    source = resolve_model_path(model_cfg.path)
    proto = onnx.load(str(source))
    _check_weights(proto, req.precision, source)
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
            _quantize(source, tmp, calibration, req.per_channel)
        else:
            _to_float16(onnx, proto, tmp)
        agreement = _agreement(source, tmp, calibration)
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


def _check_weights(proto: Any, precision: CpuPrecision, source: Path) -> None:
    """A model with nothing to convert is refused rather than copied: a "reduced
    precision" build that changed nothing would be a rollout of nothing."""
    floats = {t.name for t in proto.graph.initializer if t.data_type == FLOAT and _size(t) > 1}
    floats |= {
        n.output[0]
        for n in proto.graph.node
        if n.op_type == "Constant"
        and any(a.name == "value" and a.t.data_type == FLOAT and _size(a.t) > 1
                for a in n.attribute)
    }  # fmt: skip
    if precision == "fp16" and not floats:
        raise ConfigError(
            f"{source}: the model has no float32 weights to convert to float16 (already "
            "float16, or integer only)"
        )
    weighted = [n for n in proto.graph.node if n.op_type in WEIGHTED_OPS
                and len(n.input) > 1 and n.input[1] in floats]  # fmt: skip
    if precision == "int8" and not weighted:
        raise ConfigError(
            f"{source}: the model has no float32 weights of {', '.join(sorted(WEIGHTED_OPS))} "
            "to quantize to int8"
        )


def _size(tensor: Any) -> int:
    return int(np.prod(tensor.dims)) if len(tensor.dims) else 1


def _calibration(req: PrecisionBuild, source: Path) -> CalibrationSet | None:
    """The calibration feeds through the worker's binding of this model (or None)."""
    if not req.calibration_files and req.calibration_topic is None:
        return None
    from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
    from worker.kafka.credentials import connection
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
    topic = TopicSource(connection(s.kafka), req.calibration_topic, req.calibration_count)
    return from_topic(topic, binding.inputs, limits, s.kafka.content_type, req.batch_size)


def _options(req: PrecisionBuild) -> dict[str, Any]:
    if req.precision == "fp16":
        return {"converter": "convert_float_to_float16", "keep_io_types": True}
    return {
        "quantizer": "quantize_static",
        "format": "QDQ",
        "weight_type": "QInt8",
        "activation_type": "QUInt8",
        "per_channel": req.per_channel,
        "calibrate_method": "MinMax",
    }


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


def _quantize(source: Path, out: Path, calibration: CalibrationSet, per_channel: bool) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self, runs: Sequence[dict[str, np.ndarray]]) -> None:
            self._runs = iter(runs)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._runs, None)

    try:
        quantize_static(
            str(source), str(out), Reader(calibration.runs),
            quant_format=QuantFormat.QDQ, per_channel=per_channel,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )  # fmt: skip
    except Exception as exc:  # boundary: the quantizer raises whatever it meets
        raise BuildFailed(f"onnxruntime quantize_static failed on {source}: {exc}") from exc


def _to_float16(onnx: Any, proto: Any, out: Path) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    try:
        converted = convert_float_to_float16(proto, keep_io_types=True)
        onnx.save(converted, str(out))
    except Exception as exc:  # boundary: the converter raises whatever it meets
        raise BuildFailed(f"onnxruntime convert_float_to_float16 failed: {exc}") from exc


def _agreement(
    source: Path, built: Path, calibration: CalibrationSet | None
) -> dict[str, Any] | None:
    """The built model against the float32 one on the calibration runs: per
    output, the largest absolute difference and, for a float output ranking
    classes on its last axis, the share of rows (or positions) whose top-1
    agrees. Also proves ONNX Runtime's CPU provider loads and runs the output."""
    import onnxruntime as ort

    try:
        candidate = ort.InferenceSession(str(built), providers=["CPUExecutionProvider"])
    except Exception as exc:  # boundary: ORT's untyped errors
        raise BuildFailed(f"onnxruntime cannot load the built model: {exc}") from exc
    if calibration is None:
        return None
    reference = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    names = [o.name for o in reference.get_outputs()]
    diffs: dict[str, float] = dict.fromkeys(names, 0.0)
    agree: dict[str, list[int]] = {}
    for feeds in calibration.runs:
        want = reference.run(names, feeds)
        try:
            got = candidate.run(names, feeds)
        except Exception as exc:  # boundary
            raise BuildFailed(f"onnxruntime cannot run the built model: {exc}") from exc
        for name, w_out, g_out in zip(names, want, got, strict=True):
            w, g = np.asarray(w_out), np.asarray(g_out)
            if w.dtype.kind != "f" or w.shape != g.shape:
                continue
            diffs[name] = max(diffs[name], float(np.max(np.abs(w - g), initial=0.0)))
            if w.ndim >= 2 and w.shape[-1] > 1:
                same = w.argmax(axis=-1) == g.argmax(axis=-1)
                counts = agree.setdefault(name, [0, 0])
                counts[0] += int(same.sum())
                counts[1] += int(same.size)
    return {
        "on": "the calibration samples",
        "samples": calibration.samples,
        "outputs": {
            name: {
                "max_abs_diff": diffs[name],
                **({"top1_agreement": agree[name][0] / agree[name][1]} if name in agree else {}),
            }
            for name in names
        },
    }
