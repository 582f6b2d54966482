"""The bundled models' inputs as the worker binds them, for tests that build
stages or jobs without a worker process."""

from __future__ import annotations

from worker.config import LimitsConfig, ModelConfig
from worker.engines import load_engine
from worker.inputs import ModelInputs, bind


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
