"""Engines behind one small protocol, chosen per model in config.

An engine runs one preprocessed batch (first dimension = batch) and returns its
named outputs with the same first dimension. It is called from a worker thread,
never on the event loop. Per-batch failures raise ``InferenceFailed``; an engine
that can run nothing any more raises ``EngineDead``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    name: str
    version: str  # content hash of the model file: results name exactly what ran
    input_name: str
    output_names: tuple[str, ...]
    max_batch_size: int | None  # None: any batch size


class Engine(Protocol):
    info: EngineInfo

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


BUILTIN_MODELS = {"digits": "digits.onnx"}


def resolve_model_path(path: str) -> Path:
    """``builtin:NAME`` names a model shipped in the package; anything else is a file."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise ConfigError(f"model.path: unknown builtin model {name!r}")
        return Path(str(resources.files("worker") / "models" / BUILTIN_MODELS[name]))
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.path: {path} is not a file")
    return p


def content_version(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def load_engine(cfg: ModelConfig) -> Engine:
    path = resolve_model_path(cfg.path)
    if cfg.backend == "onnxruntime":
        from .onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(path, cfg)
    raise ConfigError(
        f"model.backend: {cfg.backend!r} is not available in this build of the worker"
    )
