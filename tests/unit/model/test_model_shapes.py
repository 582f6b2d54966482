"""The CPU stage answers each request exactly as the model alone would, for the
shapes real models have (issue 26): an output whose length follows the input's
under a fresh symbol (rows run at equal lengths, never padded), a fixed batch
(runs of that size, the filler dropped), a shared scalar fed as a constant, a
recurrent state batched on its second axis, and a tensor marked ``pad``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from tests.models import model_inputs, run_stage
from tests.onnx_models import (
    fixed_batch,
    lying_output,
    ranker,
    recurrent,
    run_alone,
    strided,
    unbatched_recurrent,
)
from worker.config import ModelConfig, load_settings
from worker.config.model import ConstantInput, TensorInput
from worker.contract import Request, Tensor
from worker.flow.errors import ConfigError, InvalidRequest

RNG = np.random.default_rng(26)


def tensors(request: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: Tensor.from_numpy(v) for k, v in request.items()}


async def test_an_output_of_a_fresh_symbol_is_answered_at_the_requests_own_length(
    tmp_path: Path,
) -> None:
    path = strided(tmp_path / "strided.onnx")
    lengths = [5, 8, 5, 3, 8, 8, 1, 5]
    rows = [RNG.normal(size=n).astype(np.float32) for n in lengths]
    runs: list[dict[str, tuple[int, ...]]] = []
    done = await run_stage(ModelConfig(path=str(path)), [tensors({"x": r}) for r in rows],
                           runs=runs)  # fmt: skip
    for answer, row in zip(done.answers, rows, strict=True):
        assert answer.error is None and answer.outputs is not None
        alone = run_alone(path, {"x": row})["half"]
        assert answer.outputs["half"].shape == alone.shape == ((len(row) + 1) // 2,)
        np.testing.assert_array_equal(answer.outputs["half"], alone)
    # One run per distinct length, each holding exactly its rows: nothing padded.
    assert sorted(r["x"] for r in runs) == [(1, 1), (1, 3), (3, 5), (3, 8)]


async def test_a_fixed_batch_model_runs_in_runs_of_its_size(tmp_path: Path) -> None:
    path = fixed_batch(tmp_path / "fixed.onnx", batch=2)
    rows = [RNG.normal(size=4).astype(np.float32) for _ in range(5)]
    runs: list[dict[str, tuple[int, ...]]] = []
    done = await run_stage(ModelConfig(path=str(path)), [tensors({"x": r}) for r in rows],
                           runs=runs)  # fmt: skip
    assert [r["x"] for r in runs] == [(2, 4)] * 3  # the last run filled up with a repeat
    session = ort.InferenceSession(str(path))
    for answer, row in zip(done.answers, rows, strict=True):
        assert answer.outputs is not None
        (want,) = session.run(None, {"x": np.stack([row, row])})
        np.testing.assert_allclose(answer.outputs["y"], want[0], rtol=1e-6)


def _recurrent_alone(path: Path, request: dict[str, np.ndarray], sr: int) -> dict[str, Any]:
    session = ort.InferenceSession(str(path))
    out, state = session.run(None, {
        "input": request["input"][None],
        "state": request["state"][:, None],
        "sr": np.array(sr, np.int64),
    })  # fmt: skip
    return {"output": out[0], "stateN": state[:, 0]}


async def test_a_shared_scalar_is_a_constant_and_a_state_batches_on_its_axis(
    tmp_path: Path,
) -> None:
    path = recurrent(tmp_path / "vad.onnx")
    cfg = ModelConfig(path=str(path), inputs={"sr": ConstantInput(value=8000)})  # type: ignore[arg-type]
    requests = [
        {"input": RNG.normal(size=n).astype(np.float32),
         "state": RNG.normal(size=(2, 3)).astype(np.float32)}
        for n in (6, 6, 4, 6, 4)
    ]  # fmt: skip
    done = await run_stage(cfg, [tensors(r) for r in requests])
    for answer, request in zip(done.answers, requests, strict=True):
        assert answer.error is None and answer.outputs is not None
        alone = _recurrent_alone(path, request, 8000)
        assert answer.outputs["stateN"].shape == (2, 3)
        np.testing.assert_allclose(answer.outputs["stateN"], alone["stateN"], rtol=1e-6)
        np.testing.assert_allclose(answer.outputs["output"], alone["output"], rtol=1e-6)
    # A request that carries the constant is told the worker sets it (at intake).
    inputs = model_inputs(cfg)
    given = Request(v=1, id="r", inputs=tensors({**requests[0], "sr": np.array(1, np.int64)}))
    with pytest.raises(InvalidRequest, match=r"inputs\.sr: set by the worker \(model\.inputs"):
        inputs.check(given)


async def test_a_tensor_marked_pad_shares_runs_across_lengths(tmp_path: Path) -> None:
    path = ranker(tmp_path / "ranker.onnx")
    requests = [
        {"features": RNG.normal(size=4).astype(np.float32),
         "ids": RNG.integers(1, 50, n).astype(np.int64)}
        for n in (3, 4, 3, 2, 4)
    ]  # fmt: skip
    for pad, expected_runs in ((True, 2), (False, 3)):
        runs: list[dict[str, tuple[int, ...]]] = []
        cfg = ModelConfig(path=str(path), inputs={"ids": TensorInput(pad=pad)})
        done = await run_stage(cfg, [tensors(r) for r in requests], runs=runs)
        # Padded: lengths 2 and 3..4 fall in two power-of-two buckets; exact: three.
        assert len(runs) == expected_runs
        for answer, request in zip(done.answers, requests, strict=True):
            assert answer.outputs is not None
            alone = run_alone(path, request)
            assert answer.outputs["token_scores"].shape == alone["token_scores"].shape
            np.testing.assert_allclose(answer.outputs["score"], alone["score"], rtol=1e-5,
                                       atol=1e-6)  # fmt: skip


async def test_a_size_the_model_refuses_fails_alone_not_its_batch() -> None:
    """PP-OCR's detector takes heights and widths in multiples of 32: a 100x200
    request fails in onnxruntime; it is answered inference_failed on its own
    while the rest of its batch is answered as alone."""
    from tests import real_models
    from tests.served import Runner

    runner = Runner(load_settings(env={
        "INFER_WORKER_MODEL__PATH": str(real_models.model_path("ppocr-det"))}).model)  # fmt: skip
    try:
        good = real_models.requests("ppocr-det", np.random.default_rng(3), 4)
        odd = {"x": RNG.normal(size=(3, 100, 200)).astype(np.float32)}
        answers = await runner.answer([good[0], odd, *good[1:]])
    finally:
        runner.close()
    assert answers[1].error is not None and answers[1].error.code == "inference_failed"
    for answer, request in zip([answers[0], *answers[2:]], good, strict=True):
        assert answer.error is None and answer.outputs is not None
        for name, want in real_models.reference("ppocr-det", request).items():
            real_models.close_enough("ppocr-det", answer.outputs[name], want)


async def test_an_output_that_breaks_its_declaration_is_an_error_not_a_row(
    tmp_path: Path,
) -> None:
    """Issue 37: the model declares y [1, seq] and returns [n, 2]. The row at axis
    0 of a run of one was the first of n rows, answered ok; now every request
    of the run is answered inference_failed naming the output and both shapes."""
    path = lying_output(tmp_path / "lying.onnx")
    rows = [RNG.normal(size=(3, 2)).astype(np.float32) for _ in range(2)]
    done = await run_stage(ModelConfig(path=str(path)), [tensors({"x": r}) for r in rows])
    for answer in done.answers:
        assert answer.outputs is None and answer.error is not None
        assert answer.error.code == "inference_failed"
        assert "output 'y'" in answer.error.message
        assert "[1, seq]" in answer.error.message and "[3, 2]" in answer.error.message


async def test_an_output_s_rows_declared_in_the_configuration_answer_as_the_model_alone(
    tmp_path: Path,
) -> None:
    """Issue 37: with ``model.output_axes.y = "none"`` (the batch-1 model's output
    has no batch axis: the whole output is the row) every request is answered
    exactly what the model returns for it alone; a batch that is not one is
    refused at binding, naming the setting."""
    path = lying_output(tmp_path / "lying.onnx")
    rows = [RNG.normal(size=(n, 2)).astype(np.float32) for n in (3, 5, 1)]
    cfg = ModelConfig(path=str(path), output_axes={"y": "none"})
    done = await run_stage(cfg, [tensors({"x": r}) for r in rows])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for answer, row in zip(done.answers, rows, strict=True):
        assert answer.error is None and answer.outputs is not None, answer.error
        (alone,) = session.run(["y"], {"x": row[None]})  # the whole output: [n, 2]
        np.testing.assert_array_equal(answer.outputs["y"], alone)
    with pytest.raises(ConfigError, match=r'output_axes\.score = "none": only a model of fixed'):
        await run_stage(ModelConfig(path=str(ranker(tmp_path / "r.onnx")),
                                    output_axes={"score": "none"}), [])  # fmt: skip
    with pytest.raises(ConfigError, match=r"output_axes\.z: the model has no output"):
        await run_stage(ModelConfig(path=str(path), output_axes={"z": 0}), [])


async def test_a_model_without_a_batch_axis_runs_one_request_whole_per_run(
    tmp_path: Path,
) -> None:
    """``model.unbatched`` (issue 37): input ``[seq, 4]``, state-shaped ``[1, 1, 3]``,
    no batch axis anywhere. Each request is the model's inputs whole, one per
    run, answered as the model alone (sequences of different lengths together)."""
    path = unbatched_recurrent(tmp_path / "ur.onnx")
    requests = [
        {"x": RNG.normal(size=(n, 4)).astype(np.float32),
         "h": RNG.normal(size=(1, 1, 3)).astype(np.float32)}
        for n in (3, 7, 1, 7)
    ]  # fmt: skip
    runs: list[dict[str, tuple[int, ...]]] = []
    done = await run_stage(ModelConfig(path=str(path), unbatched=True),
                           [tensors(r) for r in requests], runs=runs)  # fmt: skip
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for answer, request in zip(done.answers, requests, strict=True):
        assert answer.error is None and answer.outputs is not None, answer.error
        y, h = session.run(["y", "hN"], request)
        np.testing.assert_array_equal(answer.outputs["y"], y)
        np.testing.assert_array_equal(answer.outputs["hN"], h)
    assert len(runs) == len(requests)  # one request per run
    with pytest.raises(ConfigError, match=r"model\.unbatched"):
        ModelConfig(path=str(path), unbatched=True, backend="torch")
