"""The bundled models' inputs as the worker binds them, for tests that build
stages or jobs without a worker process."""

from __future__ import annotations

from typing import Any

from worker.config import LimitsConfig, ModelConfig, PreprocessConfig
from worker.engines import load_engine
from worker.inference.preprocess import ImagePreprocess
from worker.inputs import ModelInputs, bind
from worker.inputs.image import resolve_declared


def model_inputs(
    model: ModelConfig | None = None, limits: LimitsConfig | None = None
) -> ModelInputs:
    """``model``'s request inputs bound to its file (default: the digits model)."""
    cfg = model or ModelConfig()
    engine = load_engine(cfg)
    try:
        return bind(cfg, engine.info.io, limits or LimitsConfig())
    finally:
        engine.close()


def image_pre(**settings: Any) -> ImagePreprocess:
    """Preprocessing from ``[model.preprocess]`` keys, completed as the worker
    completes them; size and channels default to the bundled digits model's
    (8x8, grey), which these tests were written for."""
    cfg = PreprocessConfig(**{"size": (8, 8), "channels": 1, **settings})
    return resolve_declared(cfg, "tests give the size")
