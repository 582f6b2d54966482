"""Every model the suite serves, in one catalogue: the bundled ones, the small
models tests/onnx_models.py writes (each a shape real models have), and the
real third-party ones (tests/real_models.py). Each entry builds its worker
configuration and draws requests of mixed free-dimension sizes; the property
test (tests/unit/model/test_batch_equals_alone.py) holds them all to one
rule: a batch answers each request exactly as that request alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests import onnx_models, real_models
from tests.models import cpu_stage, jobs_for
from worker.compute.engines import load_engine
from worker.config import BatchingConfig, ModelConfig, load_settings
from worker.contract import Tensor
from worker.flow.messages import Answer, Batch

Values = dict[str, Any]  # request input -> numpy row, or a text


@dataclass(frozen=True)
class Served:
    name: str
    config: Callable[[Path], ModelConfig]  # given a directory for model files
    request: Callable[[np.random.Generator], Values]
    max_batch: int = 12  # rows one drawn batch may have (slow models: fewer)


def _env(env: dict[str, str]) -> ModelConfig:
    return load_settings(env=env).model


def _tensor_model(build: Callable[[Path], Path], **env: str) -> Callable[[Path], ModelConfig]:
    def config(tmp: Path) -> ModelConfig:
        path = build(tmp / f"{build.__name__}.onnx")
        return _env({"INFER_WORKER_MODEL__PATH": str(path), **env})

    return config


def _real(name: str) -> Callable[[Path], ModelConfig]:
    def config(tmp: Path) -> ModelConfig:
        model = real_models.MODELS[name]
        return _env({"INFER_WORKER_MODEL__PATH": str(real_models.model_path(name)), **model.env})

    return config


WORDS = (
    "good", "great", "battery", "screen", "slow", "terrible", "love", "it", "the", "and",
    "was", "not", "very", "fast", "broke", "after", "two", "days", "would", "buy", "again",
)  # fmt: skip


def _digit(rng: np.random.Generator) -> Values:
    side = int(rng.choice([8, 12, 16, 24]))
    shape = (side, side) if rng.random() < 0.5 else (side, side, 1)
    return {"image": rng.integers(0, 256, shape).astype(np.uint8)}


def _review(rng: np.random.Generator) -> Values:
    return {"text": " ".join(rng.choice(WORDS, int(rng.integers(1, 30))))}


def _features(rng: np.random.Generator) -> Values:
    return {"features": rng.normal(size=onnx_models.FEATURES).astype(np.float32)}


def _ranked(rng: np.random.Generator) -> Values:
    ids = rng.integers(1, onnx_models.VOCAB, int(rng.integers(1, 40))).astype(np.int64)
    return {**_features(rng), "ids": ids}


def _row(rng: np.random.Generator) -> Values:
    return {"x": rng.normal(size=int(rng.integers(1, 12))).astype(np.float32)}


def _fixed(rng: np.random.Generator) -> Values:
    return {"x": rng.normal(size=onnx_models.FEATURES).astype(np.float32)}


def _chunk(rng: np.random.Generator) -> Values:
    return {"input": rng.normal(size=int(rng.choice([4, 6, 9]))).astype(np.float32),
            "state": rng.normal(size=(2, 3)).astype(np.float32)}  # fmt: skip


def _table(rng: np.random.Generator) -> Values:
    return {"age": rng.normal(40, 12, 1).astype(np.float32),
            "income": rng.normal(50, 20, 1).astype(np.float32),
            "tenure": rng.exponential(3, 1).astype(np.float32),
            "plan": rng.integers(0, 4, 1).astype(np.int64)}  # fmt: skip


def _sklearn(tmp: Path) -> ModelConfig:
    path, _ = onnx_models.sklearn_pipeline(tmp / "table.onnx")
    return _env({"INFER_WORKER_MODEL__PATH": str(path)})


CATALOGUE: dict[str, Served] = {
    s.name: s
    for s in (
        Served("digits", lambda tmp: ModelConfig(), _digit),
        Served("sentiment", lambda tmp: ModelConfig(path="builtin:sentiment"), _review),
        Served("tabular", _tensor_model(onnx_models.tabular), _features),
        Served("ranker", _tensor_model(onnx_models.ranker), _ranked),
        Served("ranker-padded",
               _tensor_model(onnx_models.ranker, INFER_WORKER_MODEL__INPUTS__IDS__PAD="true"),
               _ranked),
        Served("strided", _tensor_model(onnx_models.strided), _row),
        Served("fixed-batch", _tensor_model(onnx_models.fixed_batch), _fixed),
        Served("recurrent",
               _tensor_model(onnx_models.recurrent, INFER_WORKER_MODEL__INPUTS__SR__VALUE="8000"),
               _chunk),
        Served("sklearn-table", _sklearn, _table),
        *(
            Served(name, _real(name), model.request, 3 if "fixed batch" in model.kind else 8)
            for name, model in real_models.MODELS.items()
        ),
    )
}  # fmt: skip


class Runner:
    """One model's CPU stage, built once, run on batches of requests."""

    def __init__(self, cfg: ModelConfig, batching: BatchingConfig | None = None) -> None:
        self.engine = load_engine(cfg)
        self.stage = cpu_stage(cfg, self.engine, batching)
        self.inputs = self.stage.binding.inputs

    async def answer(self, requests: list[Values]) -> list[Answer]:
        given = [
            {k: v if isinstance(v, str) else Tensor.from_numpy(v) for k, v in r.items()}
            for r in requests
        ]
        batch = Batch(jobs_for(self.inputs, given), time.monotonic(), "full")
        return (await self.stage.run_batch(batch)).answers

    def close(self) -> None:
        self.stage.close()
        self.engine.close()
