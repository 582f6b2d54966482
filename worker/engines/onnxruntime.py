"""ONNX Runtime engine: the CPU default and the numerical reference.

The session is created once; ``InferenceSession.run`` is thread-safe, so several
batches may run concurrently from the worker's thread pool.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from worker.config import ModelConfig
from worker.engines.base import EngineInfo, content_version
from worker.errors import ConfigError, EngineDead, InferenceFailed


class OnnxRuntimeEngine:
    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = cfg.intra_op_threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self._session = ort.InferenceSession(
                str(path), sess_options=opts, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # boundary: ORT raises its own untyped errors
            raise ConfigError(f"model.path: cannot load {path}: {exc}") from exc
        inputs = self._session.get_inputs()
        if len(inputs) != 1:
            raise ConfigError(f"model.path: expected one model input, found {len(inputs)}")
        outputs = tuple(o.name for o in self._session.get_outputs())
        if cfg.output is not None and cfg.output not in outputs:
            raise ConfigError(f"model.output: {cfg.output!r} not in model outputs {outputs}")
        self._input = inputs[0].name
        batch_dim = inputs[0].shape[0]
        self.info = EngineInfo(
            backend="onnxruntime",
            name=cfg.name,
            version=content_version(path),
            input_name=self._input,
            output_names=outputs,
            max_batch_size=batch_dim if isinstance(batch_dim, int) else None,
            input_shape=tuple(d if isinstance(d, int) else None for d in inputs[0].shape[1:]),
        )
        self._closed = False

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        if self._closed:
            raise EngineDead("onnxruntime session is closed")
        try:
            values = self._session.run(None, {self._input: batch})
        except Exception as exc:  # boundary: translate once into our vocabulary
            raise InferenceFailed(f"onnxruntime: {exc}") from exc
        return dict(zip(self.info.output_names, values, strict=True))

    def close(self) -> None:
        self._closed = True
