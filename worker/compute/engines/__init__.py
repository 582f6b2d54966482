"""Engines behind two small protocols (``base``), chosen per model in config.

``load_engine`` is the one factory: it imports the concrete engine lazily, so
the worker imports on any host and only the configured backend's library has to
be installed. Concrete engines import ``base`` and ``cuda`` only.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.compute.engines.base import Engine, GpuEngine
from worker.config import ModelConfig
from worker.config.model import GPU_BACKENDS, is_gpu_backend
from worker.flow.errors import ConfigError
from worker.model.files import resolve_model_path
from worker.model.io import EngineInfo


def load_engine(
    cfg: ModelConfig,
    *,
    device: int = 0,
    max_batch_size: int = 64,
    cuda_graphs: bool = False,
    buckets: Sequence[int] = (),
) -> Engine | GpuEngine:
    """The engine for ``cfg.backend``: a CPU ``Engine`` for ``onnxruntime``, a
    ``GpuEngine`` for ``tensorrt``, ``torch`` and ``gpu-twin`` (``device``, ``max_batch_size``
    apply to those; ``cuda_graphs`` to TensorRT; ``buckets``, the padded batch
    sizes, to both; torch takes its other settings from ``cfg.torch``)."""
    path = resolve_model_path(cfg.path)
    if cfg.backend == "onnxruntime":
        from worker.compute.engines.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(path, cfg)
    if cfg.backend == "tensorrt":
        from worker.compute.engines.tensorrt import TensorRTEngine

        return TensorRTEngine(
            path, cfg, device=device, cuda_graphs=cuda_graphs, buckets=buckets or None
        )
    if cfg.backend == "torch":
        from worker.compute.engines.torch import TorchEngine

        return TorchEngine(
            path, cfg, device=device, max_batch_size=max_batch_size, buckets=buckets or None
        )
    if cfg.backend == "gpu-twin":
        from worker.compute.engines.twin import TwinEngine

        return TwinEngine(path, cfg, max_batch_size=max_batch_size, buckets=buckets or None)
    raise ConfigError(
        f"model.backend: {cfg.backend!r} is not available in this build of the worker"
    )


__all__ = ["GPU_BACKENDS", "Engine", "EngineInfo", "GpuEngine", "is_gpu_backend", "load_engine"]
