"""Small ONNX models written here (no binary fixtures), of the shapes users serve:
a tabular scorer, a two-input ranker with a free sequence dimension and a
per-token output, a model with fixed batch. Built with ``onnx.helper``; the
weights are seeded, so every build is the same model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

VOCAB = 50
FEATURES = 4


def _save(graph: object, path: Path) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(
        graph,  # type: ignore[arg-type]
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name="infer-worker-tests",
    )
    model.ir_version = 8  # what onnxruntime >= 1.15 reads
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def tabular(path: Path, seed: int = 0) -> Path:
    """``features`` float32 [batch, 4] -> ``score`` float32 [batch, 1] and
    ``probabilities`` float32 [batch, 3] (a linear layer and a softmax)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(FEATURES, 1)).astype(np.float32)
    w3 = rng.normal(size=(FEATURES, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "w1"], ["score"]),
            helper.make_node("MatMul", ["features", "w3"], ["logits3"]),
            helper.make_node("Softmax", ["logits3"], ["probabilities"], axis=-1),
        ],
        "tabular",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES])],
        [
            helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 3]),
        ],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w3, "w3")],
    )
    return _save(graph, path)


def ranker(path: Path, seed: int = 0) -> Path:
    """Two inputs: ``features`` float32 [batch, 4] and ``ids`` int64
    [batch, sequence]. Outputs ``score`` float32 [batch, 1] = features . w + the
    sum of the ids' embeddings, and ``token_scores`` float32 [batch, sequence],
    each id's embedding (a per-token output). Id 0 embeds to 0, so padding with
    0 changes no answer (as a real model's padding id must not)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
    emb = rng.normal(size=(VOCAB,)).astype(np.float32)
    emb[0] = 0.0
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "w"], ["dense"]),
            helper.make_node("Gather", ["emb", "ids"], ["token_scores"], axis=0),
            helper.make_node("ReduceSum", ["token_scores", "axes"], ["bag"], keepdims=1),
            helper.make_node("Add", ["dense", "bag"], ["score"]),
        ],
        "ranker",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [
            helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info(
                "token_scores", TensorProto.FLOAT, ["batch", "sequence"]
            ),
        ],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(emb, "emb"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
    )
    return _save(graph, path)


def run_alone(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model on one request, as a batch of one, nothing padded: the reference
    every answer through the worker must equal."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    values = session.run(None, {k: v[None] for k, v in feeds.items()})
    return {n: np.asarray(v)[0] for n, v in zip(names, values, strict=True)}
