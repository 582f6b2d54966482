"""ONNX Runtime engine: the CPU default and the numerical reference.

The session is created once; ``InferenceSession.run`` is thread-safe, so several
batches may run concurrently from the worker's thread pool. Every input and
output the model declares is described (``worker.model.io``), with ONNX's symbolic
dimension names kept: they are how the worker knows which dimensions it pads and
which outputs follow a padded input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from worker.compute.engines.base import Feeds
from worker.config import ModelConfig
from worker.flow.errors import ConfigError, EngineDead, InferenceFailed
from worker.model.files import content_version
from worker.model.io import EngineInfo, RawTensor, batched_io, dim, onnx_dtype, unbatched_io


class OnnxRuntimeEngine:
    def __init__(self, path: Path, cfg: ModelConfig) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = cfg.intra_op_threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self._session: ort.InferenceSession | None = ort.InferenceSession(
                str(path), sess_options=opts, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # boundary: ORT raises its own untyped errors
            raise ConfigError(f"model.path: cannot load {path}: {exc}") from exc
        describe = unbatched_io if cfg.unbatched else batched_io
        io = describe(
            [_raw(arg, "input") for arg in self._session.get_inputs()],
            [_raw(arg, "output") for arg in self._session.get_outputs()],
        )
        # model.unbatched: the batch axis the worker sees is virtual (one request
        # per run): dropped from each feed before the run, added to each output.
        self._virtual = (
            frozenset(d.name for d in (*io.inputs, *io.outputs) if d.batched)
            if cfg.unbatched
            else frozenset()
        )
        if cfg.output is not None and cfg.output not in io.output_names:
            raise ConfigError(
                f"model.output: {cfg.output!r} not in model outputs {list(io.output_names)}"
            )
        self.info = EngineInfo(
            backend="onnxruntime",
            name=cfg.name,
            version=content_version(path),
            io=io,
            max_batch_size=io.batch,
        )
        self._closed = False

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        session = self._session
        if self._closed or session is None:
            raise EngineDead("onnxruntime session is closed")
        given = dict(feeds)
        for name in self._virtual & given.keys():
            given[name] = given[name][0]  # a run of one request: its tensor whole
        try:
            values = session.run(None, given)
        except Exception as exc:  # boundary: translate once into our vocabulary
            raise InferenceFailed(f"onnxruntime: {exc}") from exc
        out = dict(zip(self.info.output_names, values, strict=True))
        for name in self._virtual & out.keys():
            out[name] = np.asarray(out[name])[None]
        return out

    def close(self) -> None:
        """The session released now, its weights and arena freed, though the
        engine may still be referenced (the worker's list of its models holds
        a model evicted by demand: ``worker.app.demand``)."""
        self._closed = True
        self._session = None


def _raw(arg: ort.NodeArg, where: str) -> RawTensor:
    """A tensor as onnxruntime reports it: ``tensor(float)``, dims as ints, symbols
    or ``None``."""
    dtype = onnx_dtype(arg.type, f"{where} {arg.name!r}")
    return arg.name, dtype, tuple(dim(d) for d in arg.shape)
