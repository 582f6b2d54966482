"""The GPU stage with models of any inputs: tensors with a free dimension and a
text, collated on the host into pinned twins, copied in on the slot's stream,
run at the length buckets warmed at start-up, outputs copied back at the run's
shape and cut back to each request's length. Answers equal the CPU stage's on
the same model (ONNX Runtime), which equal the model run on each request alone.

- a two-input CuPy engine (features float32 [4] and ids int64 [sequence] ->
  score [1] and token_scores [sequence]): the stage and the layouts without
  torch or TensorRT;
- the bundled text model (builtin:sentiment) run by a CuPy engine with its ONNX
  weights, texts tokenized per batch;
- the torch engine on an exported two-input program (dynamic batch and sequence).

Run on an H100 on 2026-11-26 (issue 40): all pass (BENCHMARKS.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu.support import gpu_stage
from tests.models import cpu_stage
from worker.compute.engines import load_engine
from worker.compute.engines.base import EngineSlot
from worker.config import BatchingConfig, GpuConfig, LimitsConfig, ModelConfig
from worker.config.model import TensorInput
from worker.contract import Tensor
from worker.flow.messages import Batch, Completed
from worker.model.inputs import bind
from worker.model.io import ModelIO, TensorDesc
from worker.model.shapes import SlotShapes, dense

from .support import queues, run_stage
from .support import request_jobs as jobs

pytestmark = pytest.mark.gpu

F32, I64 = np.dtype(np.float32), np.dtype(np.int64)
VOCAB, MAX_LEN = 50, 32


@dataclass
class RankerEngine:
    """score = features . w + sum(emb[ids]); token_scores = emb[ids] (emb[0] = 0):
    CuPy ops on dense views of the slot's buffers, on its stream."""

    w: np.ndarray
    emb: np.ndarray
    max_batch_size: int = 64
    min_batch_size: int = 1
    device: int = 0
    seen: list[tuple[int, dict[str, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        io = ModelIO(
            (TensorDesc("features", F32, (4,)), TensorDesc("ids", I64, ("sequence",))),
            (TensorDesc("score", F32, (1,)), TensorDesc("token_scores", F32, ("sequence",))),
        )
        from worker.model.io import EngineInfo

        self.info = EngineInfo("cupy", "ranker", "0", io, self.max_batch_size)
        self.inputs: tuple[TensorDesc, ...] = ()
        self.outputs: tuple[TensorDesc, ...] = ()

    def prepare(self, shapes: SlotShapes) -> None:
        top = shapes.max_lengths
        self.inputs = tuple(TensorDesc(t.name, t.dtype, t.row_at(top)) for t in self.info.io.inputs)
        self.outputs = tuple(
            TensorDesc(t.name, t.dtype, t.row_at(top)) for t in self.info.io.outputs
        )

    def create_context(self, slot: EngineSlot) -> Any:
        import cupy

        return cupy.asarray(self.w), cupy.asarray(self.emb)

    def enqueue(self, slot: EngineSlot, batch_size: int, lengths: Mapping[str, int]) -> Any:
        w, emb = slot.context
        n, length = batch_size, lengths["sequence"]
        self.seen.append((n, dict(lengths)))
        with slot.stream:
            features = dense(slot.engine_inputs["features"], n, (4,))
            ids = dense(slot.engine_inputs["ids"], n, (length,))
            tokens = emb[ids]
            dense(slot.engine_outputs["token_scores"], n, (length,))[...] = tokens
            score = features @ w + tokens.sum(axis=1, keepdims=True)
            dense(slot.engine_outputs["score"], n, (1,))[...] = score
        return {"score": (1,), "token_scores": (length,)}

    def run(self, feeds: Any) -> dict[str, np.ndarray]:
        tokens = self.emb[feeds["ids"]]
        return {"score": feeds["features"] @ self.w + tokens.sum(1, keepdims=True),
                "token_scores": tokens}  # fmt: skip

    def close(self) -> None:
        pass


def ranker_engine(seed: int = 0) -> RankerEngine:
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=VOCAB).astype(np.float32)
    emb[0] = 0
    return RankerEngine(rng.normal(size=(4, 1)).astype(np.float32), emb)


async def gpu_answers(
    engine: Any, model: ModelConfig, requests: list[dict[str, Any]], sizes: list[int]
) -> list[Completed]:
    inputs = bind(model, engine.info.io, LimitsConfig(), BatchingConfig())
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, model, 64, 2, GpuConfig(), batching=BatchingConfig())
    try:
        all_jobs = jobs(inputs, requests)
        batches, start = [], 0
        for i, size in enumerate(sizes):
            batches.append(Batch(all_jobs[start : start + size], time.monotonic(), "full", i + 1))
            start += size
        return await run_stage(stage, source, sink, batches)
    finally:
        stage.close()


async def test_a_two_input_model_with_a_free_dimension(cp: Any) -> None:
    engine = ranker_engine()
    # pad: id 0 embeds to 0, so padding is harmless and runs go to the length buckets.
    model = ModelConfig(path="unused", backend="torch",
                        inputs={"ids": TensorInput(max_length=MAX_LEN, pad=True)})  # fmt: skip
    rng = np.random.default_rng(1)
    requests = [
        {"features": Tensor.from_numpy(rng.normal(size=4).astype(np.float32)),
         "ids": Tensor.from_numpy(rng.integers(1, VOCAB, int(n)).astype(np.int64))}
        for n in rng.integers(1, MAX_LEN + 1, 100)
    ]  # fmt: skip
    done = await gpu_answers(engine, model, requests, [37, 63])
    answers = [a for c in done for a in c.answers]
    for answer, given in zip(answers, requests, strict=True):
        feeds = {k: t.to_numpy()[None] for k, t in given.items()}
        want = engine.run(feeds)
        assert answer.error is None and answer.outputs is not None
        np.testing.assert_allclose(answer.outputs["score"], want["score"][0], rtol=1e-5, atol=1e-5)
        assert answer.outputs["token_scores"].shape == (given["ids"].shape[0],)
        np.testing.assert_allclose(answer.outputs["token_scores"], want["token_scores"][0])
    # Every run at a length the slots were warmed at (powers of two up to 32).
    assert {lengths["sequence"] for _, lengths in engine.seen} <= {1, 2, 4, 8, 16, 32}


@dataclass
class SentimentEngine:
    """The bundled text model's graph (mean of masked token weights + bias, and
    each token's positive-minus-negative weight), in CuPy, with its ONNX weights."""

    max_batch_size: int = 64
    min_batch_size: int = 1
    device: int = 0

    def __post_init__(self) -> None:
        import onnx
        from onnx import numpy_helper

        from worker.model.files import resolve_model_path

        path = resolve_model_path("builtin:sentiment")
        weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
        self.weights, self.bias = weights["weights"], weights["bias"]
        self.info = load_engine(ModelConfig(path="builtin:sentiment")).info
        self.inputs: tuple[TensorDesc, ...] = ()
        self.outputs: tuple[TensorDesc, ...] = ()

    def prepare(self, shapes: SlotShapes) -> None:
        top = shapes.max_lengths
        io = self.info.io
        self.inputs = tuple(TensorDesc(t.name, t.dtype, t.row_at(top)) for t in io.inputs)
        self.outputs = tuple(TensorDesc(t.name, t.dtype, t.row_at(top)) for t in io.outputs)

    def create_context(self, slot: EngineSlot) -> Any:
        import cupy

        return cupy.asarray(self.weights), cupy.asarray(self.bias)

    def enqueue(self, slot: EngineSlot, batch_size: int, lengths: Mapping[str, int]) -> Any:
        weights, bias = slot.context
        (length,) = lengths.values()
        n = batch_size
        with slot.stream:
            ids = dense(slot.engine_inputs["input_ids"], n, (length,))
            mask = dense(slot.engine_inputs["attention_mask"], n, (length,)).astype(np.float32)
            masked = weights[ids] * mask[:, :, None]
            mean = masked.sum(1) / np.maximum(mask.sum(1, keepdims=True), 1.0)
            dense(slot.engine_outputs["logits"], n, (2,))[...] = mean + bias
            dense(slot.engine_outputs["token_scores"], n, (length,))[...] = (
                masked[:, :, 1] - masked[:, :, 0]
            )
        return {"logits": (2,), "token_scores": (length,)}

    def run(self, feeds: Any) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        pass


async def test_the_bundled_text_model_equals_the_cpu_stage(cp: Any) -> None:
    from worker.ops.samples import sentiment_samples

    texts = [s.text for s in sentiment_samples()[:90]]
    requests: list[dict[str, Any]] = [{"text": t} for t in texts]
    gpu_model = ModelConfig(path="builtin:sentiment", backend="torch")
    gpu = await gpu_answers(SentimentEngine(), gpu_model, requests, [50, 40])
    cpu_model = ModelConfig(path="builtin:sentiment")
    engine = load_engine(cpu_model)
    inputs = bind(cpu_model, engine.info.io, LimitsConfig())
    stage = cpu_stage(cpu_model, engine)
    cpu = await stage.run_batch(Batch(jobs(inputs, requests), time.monotonic(), "full"))
    stage.close()
    got = [a for c in gpu for a in c.answers]
    for g, c in zip(got, cpu.answers, strict=True):
        assert g.outputs is not None and c.outputs is not None
        np.testing.assert_allclose(g.outputs["logits"], c.outputs["logits"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g.outputs["token_scores"], c.outputs["token_scores"],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.needs_torch
async def test_the_torch_engine_on_an_exported_two_input_program(
    cp: Any, torch: Any, tmp_path: Path
) -> None:
    from tests.unit.compute.engines.test_torch_cpu import MAX_LEN as TORCH_MAX
    from tests.unit.compute.engines.test_torch_cpu import export
    from worker.compute.engines.torch import TorchEngine

    path, module = export(tmp_path)
    model = ModelConfig(path=str(path), backend="torch",
                        inputs={"ids": TensorInput(max_length=TORCH_MAX)})  # fmt: skip
    engine = TorchEngine(path, model, max_batch_size=64)
    rng = np.random.default_rng(2)
    requests = [
        {"features": Tensor.from_numpy(rng.normal(size=4).astype(np.float32)),
         "ids": Tensor.from_numpy(rng.integers(1, 40, int(n)).astype(np.int64))}
        for n in rng.integers(1, TORCH_MAX + 1, 70)
    ]  # fmt: skip
    try:
        done = await gpu_answers(engine, model, requests, [64, 6])
    finally:
        engine.close()
    for answer, given in zip([a for c in done for a in c.answers], requests, strict=True):
        with torch.no_grad():
            want = module(
                *(torch.from_numpy(given[k].to_numpy()[None]) for k in ("features", "ids"))
            )
        assert answer.outputs is not None
        np.testing.assert_allclose(answer.outputs["score"], want["score"][0].numpy(), rtol=1e-4,
                                   atol=1e-4)  # fmt: skip
        tokens = want["token_scores"][0].numpy()
        np.testing.assert_allclose(answer.outputs["token_scores"], tokens, rtol=1e-4, atol=1e-4)
