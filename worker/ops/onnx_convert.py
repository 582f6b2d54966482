"""The ONNX side of ``build-engine --backend onnxruntime``: what a model must have
to be converted, ONNX Runtime's quantizer and float16 converter called on it
(their errors translated once, here), and the built model checked against the
float32 one. ``onnx`` and ONNX Runtime's tools are imported inside functions:
the worker does not need them (``pip install -e '.[quantize]'``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from worker.flow.errors import ConfigError, WorkerError
from worker.ops.calibration import CalibrationSet

# The ops whose weights int8 quantizes (what makes a model worth quantizing).
WEIGHTED_OPS: Final = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
FLOAT: Final = 1  # onnx.TensorProto.FLOAT


class BuildFailed(WorkerError):
    """The quantizer or converter failed, or ONNX Runtime cannot run its output."""


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


def check_weights(proto: Any, precision: str, source: Path) -> None:
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


def weights_as_initializers(onnx: Any, proto: Any, per_channel: bool) -> Any:
    """A copy of ``proto`` the quantizer can quantize: the tensors of ``Constant``
    nodes moved into initializers (paddle2onnx writes every weight as a Constant,
    which the quantizer would otherwise leave float and wrap in Q/DQ as if it were
    an activation: a file as large as the float32 one, scaled per tensor by its
    calibrated range), and for per-channel scales an opset of at least 13
    (DequantizeLinear's ``axis``)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    graph = copy.graph
    kept = []
    for node in graph.node:
        values = [a for a in node.attribute if a.name == "value"]
        if node.op_type == "Constant" and len(node.attribute) == 1 and values:
            tensor = graph.initializer.add()
            tensor.CopyFrom(values[0].t)
            tensor.name = node.output[0]
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    opset = next((o.version for o in copy.opset_import if o.domain in ("", "ai.onnx")), 13)
    if per_channel and opset < 13:
        from onnx import version_converter

        try:
            copy = version_converter.convert_version(copy, 13)
        except Exception as exc:  # boundary: the converter's own errors
            raise BuildFailed(
                f"per-channel int8 needs opset 13, and converting the model from opset {opset} "
                f"failed ({exc}); build it with --per-tensor"
            ) from exc
    return copy


def quantize(
    source: Path,
    out: Path,
    calibration: CalibrationSet,
    per_channel: bool,
    ops: frozenset[str],
    reduce_range: bool = True,
) -> None:
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

    # reduce_range (the default): weights within +-64 so that no CPU saturates. On x86
    # without VNNI, ONNX Runtime's U8S8 kernels add pairs of uint8 x int8 products
    # in 16 bits (VPMADDUBSW), which clamps at 32,767: 255 x 127 x 2 does not fit,
    # 255 x 64 x 2 does. With full-range weights the same file answered differently
    # by CPU (digits: largest logit difference 0.21 with VNNI, 2.68 without), so a
    # build's measured agreement did not hold where it was served. BENCHMARKS.md,
    # "INT8 weights in a reduced range": as fast with VNNI, the same agreement.
    root = logging.getLogger()
    root.addFilter(_no_preprocessing_hint)
    try:
        quantize_static(
            str(source), str(out), Reader(calibration.runs),
            quant_format=QuantFormat.QDQ, per_channel=per_channel,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
            reduce_range=reduce_range, calibrate_method=CalibrationMethod.MinMax,
            op_types_to_quantize=sorted(ops) or None,
        )  # fmt: skip
    except Exception as exc:  # boundary: the quantizer raises whatever it meets
        raise BuildFailed(f"onnxruntime quantize_static failed on {source}: {exc}") from exc
    finally:
        root.removeFilter(_no_preprocessing_hint)


def _no_preprocessing_hint(record: logging.LogRecord) -> bool:
    """The quantizer's advice to run its pre-processing (symbolic shape inference,
    which needs sympy, and graph optimisation) is not passed on: this build
    prepares the model its own way (``weights_as_initializers``) and is measured
    as it is (BENCHMARKS.md). Warned twice per build to the root logger, the
    advice would read as a problem with the user's model."""
    return "pre-processing before quantization" not in record.getMessage()


def to_float16(onnx: Any, proto: Any, out: Path) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    try:
        converted = convert_float_to_float16(proto, keep_io_types=True)
        onnx.save(converted, str(out))
    except Exception as exc:  # boundary: the converter raises whatever it meets
        raise BuildFailed(f"onnxruntime convert_float_to_float16 failed: {exc}") from exc


def check_agreement(
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
