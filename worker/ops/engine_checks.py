"""What ``build-engine`` checks a plan with: calibration samples (INT8) and the
accuracy of a reduced-precision plan against the FP32 ONNX Runtime reference.

Samples are an ``.npz``: ``images`` (uint8 [N, H, W, C], preprocessed here with
the worker's own contract, ``worker.model.preprocess``) or ``inputs``
(already preprocessed float32), and optionally ``labels``. TensorRT, CuPy and
ONNX Runtime are imported inside functions: this module imports anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from worker.config import ModelConfig, PreprocessConfig
from worker.flow.errors import ConfigError
from worker.model.inputs.image import resolve
from worker.model.preprocess import ImagePreprocess, preprocess
from worker.ops.files import atomic_write, file_sha256


def onnx_image_preprocess(onnx_path: Path, cfg: PreprocessConfig | None) -> ImagePreprocess:
    """``[model.preprocess]`` (or none) completed from the ONNX model's first input,
    as the worker would bind it."""
    from worker.compute.engines.onnxruntime import OnnxRuntimeEngine

    engine = OnnxRuntimeEngine(onnx_path, ModelConfig(path=str(onnx_path)))
    try:
        return resolve(cfg or PreprocessConfig(), engine.info.io.inputs[0])
    finally:
        engine.close()


def load_samples(path: Path, cfg: ImagePreprocess) -> tuple[np.ndarray, np.ndarray | None]:
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
            f32 = dataclasses.replace(cfg, dtype="float32")
            inputs = preprocess(list(images), f32)
        else:
            raise ConfigError(f"{path}: needs an 'images' or an 'inputs' array")
    if len(inputs) == 0:
        raise ConfigError(f"{path}: no samples")
    if labels is not None and len(labels) != len(inputs):
        raise ConfigError(f"{path}: {len(labels)} labels for {len(inputs)} samples")
    return inputs, labels


# --- building ------------------------------------------------------------------------


def calibration_sha256(path: Path, cfg: ImagePreprocess) -> str:
    """The calibration data's identity: the samples file and, since ``images`` are
    preprocessed here, the preprocessing that turns them into model inputs."""
    digest = hashlib.sha256(file_sha256(path).encode())
    digest.update(json.dumps(asdict(cfg), sort_keys=True).encode())
    return digest.hexdigest()


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
            atomic_write(cache_file, bytes(memoryview(cache)))

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

    from worker.compute.engines.tensorrt import TensorRTEngine

    if reference != "onnxruntime":
        raise ConfigError(f"unknown reference {reference!r}")
    cfg = preprocess_cfg or PreprocessConfig()
    inputs, labels = load_samples(samples_npz, onnx_image_preprocess(onnx_path, cfg))
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
            (spec,) = engine.inputs  # an image classifier: one input
            feeds = {spec.name: padded.astype(spec.dtype)}
            got.append(engine.run(feeds)[out_name][: len(chunk)])
            (ref,) = session.run([out_name], {in_name: chunk})
            want.append(np.asarray(ref))
    finally:
        engine.close()
    return compare_outputs(np.concatenate(got), np.concatenate(want), labels)
