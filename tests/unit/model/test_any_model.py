"""The CPU stage serves models of any inputs: answers through a batch equal the
model run on each request alone (padding never changes an answer), per-token
outputs come back at each request's own length, and outputs are selected and
postprocessed as configured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from tests.models import run_stage
from tests.onnx_models import ranker, run_alone, tabular
from worker.config import BatchingConfig, ModelConfig, PostprocessConfig
from worker.contract import Tensor

pytest.importorskip("onnx")


def ranker_requests(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        length = int(rng.integers(1, 40))
        out.append({
            "features": Tensor.from_numpy(rng.normal(size=4).astype(np.float32)),
            "ids": Tensor.from_numpy(rng.integers(1, 50, length).astype(np.int64)),
        })  # fmt: skip
    return out


@pytest.mark.parametrize("split", [True, False])
async def test_two_inputs_with_a_free_dimension_equal_each_request_alone(
    tmp_path: Path, split: bool
) -> None:
    path = ranker(tmp_path / "ranker.onnx")
    requests = ranker_requests(np.random.default_rng(1), 48)
    done = await run_stage(
        ModelConfig(path=str(path)), requests, BatchingConfig(split_by_length=split)
    )
    assert done.engine_rows == 48
    for answer, given in zip(done.answers, requests, strict=True):
        assert answer.error is None and answer.outputs is not None
        alone = run_alone(path, {k: t.to_numpy() for k, t in given.items()})
        assert set(answer.outputs) == {"score", "token_scores"}  # postprocessing off
        # Equal up to float rounding: a sum over padded zeros may add in another order.
        np.testing.assert_allclose(answer.outputs["score"], alone["score"], rtol=1e-5, atol=1e-6)
        # The per-token output at the request's own length, not the batch's.
        assert answer.outputs["token_scores"].shape == (given["ids"].shape[0],)
        np.testing.assert_array_equal(answer.outputs["token_scores"], alone["token_scores"])


async def test_a_tabular_model_needs_only_its_path(tmp_path: Path) -> None:
    path = tabular(tmp_path / "tabular.onnx")
    rng = np.random.default_rng(2)
    rows = [rng.normal(size=4).astype(np.float32) for _ in range(10)]
    done = await run_stage(
        ModelConfig(path=str(path)), [{"features": Tensor.from_numpy(r)} for r in rows]
    )
    for answer, row in zip(done.answers, rows, strict=True):
        assert answer.outputs is not None
        alone = run_alone(path, {"features": row})
        assert answer.outputs.keys() == {"score", "probabilities"}
        np.testing.assert_allclose(
            answer.outputs["probabilities"], alone["probabilities"], rtol=1e-6
        )


async def test_outputs_are_selected_and_postprocessed_as_configured(tmp_path: Path) -> None:
    path = str(tabular(tmp_path / "tabular.onnx"))
    row = {"features": Tensor.from_numpy(np.array([1, 2, 3, 4], np.float32))}
    alone = run_alone(Path(path), {"features": row["features"].to_numpy()})

    only = await run_stage(ModelConfig(path=path, outputs=("score",)), [row])
    assert only.answers[0].outputs is not None and set(only.answers[0].outputs) == {"score"}

    top = await run_stage(
        ModelConfig(path=path, output="probabilities", outputs=("score",),
                    postprocess=PostprocessConfig(softmax=False, top_k=2)),
        [row],
    )  # fmt: skip
    out = top.answers[0].outputs
    assert out is not None and set(out) == {"score", "topk_indices", "topk_scores"}
    assert out["topk_indices"].tolist() == np.argsort(-alone["probabilities"])[:2].tolist()

    unit = await run_stage(
        ModelConfig(path=path, output="score", postprocess=PostprocessConfig(normalize=True)),
        [row],
    )
    out = unit.answers[0].outputs
    assert out is not None
    np.testing.assert_allclose(out["score"], np.sign(alone["score"]), rtol=1e-6)
    np.testing.assert_array_equal(out["probabilities"], alone["probabilities"])


async def test_postprocessing_a_per_token_output_runs_after_the_cut(tmp_path: Path) -> None:
    path = ranker(tmp_path / "ranker.onnx")
    requests = ranker_requests(np.random.default_rng(3), 6)
    post = PostprocessConfig(softmax=True, top_k=2)
    cfg = ModelConfig(path=str(path), output="token_scores", postprocess=post)
    done = await run_stage(cfg, requests)
    for answer, given in zip(done.answers, requests, strict=True):
        alone = run_alone(path, {k: t.to_numpy() for k, t in given.items()})["token_scores"]
        e = np.exp(alone - alone.max())
        probs = e / e.sum()  # over the request's own tokens, none padded
        assert answer.outputs is not None
        k = min(2, len(alone))
        np.testing.assert_allclose(
            answer.outputs["topk_scores"], np.sort(probs)[::-1][:k], rtol=1e-5
        )


async def test_the_bundled_text_model_equals_tokenizer_and_model_alone() -> None:
    from tokenizers import Tokenizer

    from worker.model.files import resolve_model_path, resolve_tokenizer_path

    texts = ["I love it", "The battery was terrible and the screen was slow, avoid.", "ok"]
    done = await run_stage(ModelConfig(path="builtin:sentiment"), [{"text": t} for t in texts])
    tok = Tokenizer.from_file(str(resolve_tokenizer_path("builtin:sentiment", "t")))
    session = ort.InferenceSession(str(resolve_model_path("builtin:sentiment")))
    for answer, text in zip(done.answers, texts, strict=True):
        enc = tok.encode(text)
        feeds = {"input_ids": np.array([enc.ids]), "attention_mask": np.array([enc.attention_mask])}
        logits, scores = session.run(None, feeds)
        assert answer.outputs is not None
        np.testing.assert_allclose(answer.outputs["logits"], logits[0], rtol=1e-6)
        np.testing.assert_allclose(answer.outputs["token_scores"], scores[0], rtol=1e-6)
        assert answer.outputs["token_scores"].shape == (len(enc.ids),)
    assert done.answers[0].outputs is not None and done.answers[0].outputs["logits"].argmax() == 1
    assert done.answers[1].outputs is not None and done.answers[1].outputs["logits"].argmax() == 0
