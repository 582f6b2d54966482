"""What the GPU stage does around the engine, decided once at start-up.

Pure functions of the engine's tensors and the model config: whether the
engine's input matches what preprocessing produces, and where postprocessing
runs (the kernels on device when they compute exactly what
``worker.inference.postprocess`` does, else the raw output comes back and the
NumPy reference runs on the host).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from worker.config import ModelConfig, PostprocessConfig
from worker.engines.base import GpuEngine, TensorSpec
from worker.errors import ConfigError
from worker.inference.preprocess import batch_shape


@dataclass(frozen=True)
class PostprocessPlan:
    """What the device does after the engine, fixed at start-up."""

    raw: TensorSpec  # the engine output that is postprocessed
    topk: int  # columns of the top-k results (0: none)
    gpu_softmax_rows: bool  # probabilities computed on device
    host_postprocess: bool  # raw output comes back and the host reference runs on it
    copy_back: tuple[str, ...]
    post: PostprocessConfig  # the resolved settings

    @property
    def result_specs(self) -> tuple[TensorSpec, ...]:
        """Device buffers the postprocess kernels write (beside the engine's own)."""
        if self.topk:
            return (
                TensorSpec("topk_indices", np.dtype(np.int64), (self.topk,)),
                TensorSpec("topk_scores", np.dtype(np.float32), (self.topk,)),
            )
        if self.gpu_softmax_rows:
            return (TensorSpec("probabilities", np.dtype(np.float32), self.raw.shape),)
        return ()


def postprocess_plan(
    engine: GpuEngine, model: ModelConfig, pp: PostprocessConfig | None = None
) -> PostprocessPlan:
    """Decide where postprocessing runs (see the module docstring); ``pp``: the
    resolved settings (default: ``model.postprocess`` resolved for a classifier)."""
    pp = pp if pp is not None else model.postprocess.resolved(classifier=True)
    raw_name = model.output or engine.info.output_names[0]
    specs = {t.name: t for t in engine.outputs}
    if raw_name not in specs:
        raise ConfigError(f"model.output: {raw_name!r} not in engine outputs {list(specs)}")
    raw = specs[raw_name]
    assert pp.top_k is not None and pp.softmax is not None
    # The kernels reduce over a whole row; the reference's softmax runs over the
    # last axis. They agree when the row is one softmax segment.
    kernel_fits = raw.dtype in (np.float32, np.float16) and (
        math.prod(raw.shape[:-1]) == 1 or not pp.softmax
    )
    wants_device_work = pp.top_k > 0 or pp.softmax
    if wants_device_work and not kernel_fits:
        return PostprocessPlan(raw, 0, False, True, (raw_name,), pp)
    names: list[str] = [raw_name] if pp.include_raw else []
    topk = min(pp.top_k, raw.row_elements) if pp.top_k > 0 else 0
    if topk:
        names += ["topk_indices", "topk_scores"]
    softmax_rows = not topk and pp.softmax
    if softmax_rows:
        names.append("probabilities")
    return PostprocessPlan(raw, topk, softmax_rows, False, tuple(names), pp)


def check_engine_input(engine: GpuEngine, model: ModelConfig) -> None:
    """The engine must take exactly what preprocessing produces per request."""
    pp = model.preprocess
    expected = batch_shape(pp, 1)[1:]
    if engine.input.shape != expected or engine.input.dtype != np.dtype(pp.dtype):
        raise ConfigError(
            f"model.preprocess: produces {pp.dtype}{list(expected)} per request but the "
            f"engine input {engine.input.name!r} is {engine.input.dtype}"
            f"{list(engine.input.shape)}"
        )
