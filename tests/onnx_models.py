"""Small ONNX models written here (no binary fixtures), of the shapes users serve:
a tabular scorer, a two-input ranker with a free sequence dimension and a
per-token output, a model with fixed batch. Built with ``onnx.helper``; the
weights are seeded, so every build is the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def wide(path: Path, seed: int = 0, mib: int = 16) -> Path:
    """``features`` float32 [batch, 4] -> ``probabilities`` float32 [batch, 3]
    through one hidden layer wide enough that its weights hold about ``mib``
    MiB (a model whose memory matters: loaded and evicted by demand)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    width = mib * (1 << 20) // (4 * (FEATURES + 3))
    w1 = rng.normal(0, 0.5, size=(FEATURES, width)).astype(np.float32)
    w2 = rng.normal(0, 1 / np.sqrt(width), size=(width, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["hr"]),
            helper.make_node("MatMul", ["hr", "w2"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
        ],
        "wide",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
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
            helper.make_tensor_value_info("token_scores", TensorProto.FLOAT, ["batch", "sequence"]),
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


def sklearn_pipeline(path: Path, seed: int = 0) -> tuple[Path, Any]:
    """A scikit-learn pipeline over a table, converted by skl2onnx as tabular
    models are shipped: one input per column (``age``, ``income``, ``tenure``
    float32 [batch, 1], scaled; ``plan`` int64 [batch, 1], one-hot encoded) ->
    logistic regression. Outputs ``label`` int64 [batch] and ``probabilities``
    float32 [batch, 2] (no ZipMap: the worker carries tensors). Returns the file
    and the fitted pipeline (the reference)."""
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType, Int64TensorType
    from sklearn.compose import ColumnTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    rng = np.random.default_rng(seed)
    n = 400
    age, income = rng.normal(40, 12, n), rng.normal(50, 20, n)
    tenure, plan = rng.exponential(3, n), rng.integers(0, 4, n)
    table = np.stack([age, income, tenure, plan], axis=1)  # the columns, in input order
    y = ((income - 50) / 20 + 0.6 * plan - tenure / 3 > 0.5).astype(np.int64)
    columns = ColumnTransformer([
        ("numeric", StandardScaler(), [0, 1, 2]),
        ("plan", OneHotEncoder(handle_unknown="ignore"), [3]),
    ])  # fmt: skip
    pipeline = Pipeline([("columns", columns), ("model", LogisticRegression())])
    pipeline.fit(table, y)
    onnx_model = convert_sklearn(
        pipeline,
        initial_types=[
            ("age", FloatTensorType([None, 1])),
            ("income", FloatTensorType([None, 1])),
            ("tenure", FloatTensorType([None, 1])),
            ("plan", Int64TensorType([None, 1])),
        ],
        options={id(pipeline.steps[-1][1]): {"zipmap": False}},
        target_opset=17,
    )
    path.write_bytes(onnx_model.SerializeToString())
    return path, pipeline


def strided(path: Path) -> Path:
    """``x`` float32 [batch, length] -> ``half`` float32 [batch, half]: every second
    value (``x[:, ::2]``), times 2. The output's length follows the input's but
    under a fresh symbol, as exporters write it (``p2o.DynamicDimension.3``,
    ``unk__12``): nothing ties the two, so no padded run could be cut back."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["x", "start", "end", "axis", "step"], ["every"]),
            helper.make_node("Mul", ["every", "two"], ["half"]),
        ],
        "strided",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "length"])],
        [helper.make_tensor_value_info("half", TensorProto.FLOAT, ["batch", "half"])],
        [
            numpy_helper.from_array(np.array([0], np.int64), "start"),
            numpy_helper.from_array(np.array([1 << 30], np.int64), "end"),
            numpy_helper.from_array(np.array([1], np.int64), "axis"),
            numpy_helper.from_array(np.array([2], np.int64), "step"),
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        ],
    )
    return _save(graph, path)


def fixed_batch(path: Path, batch: int = 2, seed: int = 0) -> Path:
    """``x`` float32 [``batch``, 4] -> ``y`` float32 [``batch``, 3]: a linear layer
    exported with its batch dimension fixed (as many mobile and TensorRT-era
    exports are)."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).normal(size=(FEATURES, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "fixed_batch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, FEATURES])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
        [numpy_helper.from_array(w, "w")],
    )
    return _save(graph, path)


def lying_output(path: Path) -> Path:
    """``x`` float32 [1, n, 2] -> ``y`` declared [1, seq], returned [n, 2]: a
    fixed-batch-1 model whose output declaration does not hold (Squeeze drops
    the batch axis; shape inference cannot tell the rank, so onnxruntime keeps
    the declaration and only warns at run time, ``VerifyOutputSizes``), like the
    PyPI OCR model of issue 37 that declares [1, seqlen] and returns [seqlen, 1, C]."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Squeeze", ["x"], ["y"])],
        "lying_output",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq"])],
    )
    return _save(graph, path)


def unbatched_recurrent(path: Path, seed: int = 0) -> Path:
    """A recurrent model without a batch axis (issue 37's ``[seq_len, 576]`` input
    and ``[1, 1, 128]`` state): ``x`` float32 [seq, 4], ``h`` float32 [1, 1, 3]
    -> ``y`` float32 [seq, 3] = tanh(x @ w + h), ``hN`` float32 [1, 1, 3], the
    mean of ``y`` over the sequence: each chunk depends on the state before it."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).normal(size=(4, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),  # [seq, 3]
            helper.make_node("Squeeze", ["h", "axis0"], ["h2"]),  # [1, 3]
            helper.make_node("Add", ["xw", "h2"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["y"]),
            helper.make_node("ReduceMean", ["y"], ["m"], axes=[0], keepdims=1),  # [1, 3]
            helper.make_node("Unsqueeze", ["m", "axis0"], ["hN"]),  # [1, 1, 3]
        ],
        "unbatched_recurrent",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["seq", 4]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, 1, 3]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["seq", 3]),
            helper.make_tensor_value_info("hN", TensorProto.FLOAT, [1, 1, 3]),
        ],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        ],
    )
    return _save(graph, path)


def recurrent(path: Path, seed: int = 0) -> Path:
    """A voice-activity detector's shape: ``input`` float32 [batch, samples],
    ``state`` float32 [2, batch, 3] (batch on axis 1), ``sr`` int64 [] (one sample
    rate for the whole batch) -> ``output`` float32 [batch, 1] and ``stateN``
    float32 [2, batch, 3]. ``stateN = tanh(state + mean(input) * w + sr / 16000)``,
    ``output = sum(stateN over layers and units)``: every row depends on its own
    input and state, and on the shared rate."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).normal(size=(1, 1, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1], keepdims=0),  # [b]
            helper.make_node("Unsqueeze", ["mean", "axes_last"], ["mean2"]),  # [1, b, 1]
            helper.make_node("Mul", ["mean2", "w"], ["push"]),  # [1, b, 3]
            helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT),
            helper.make_node("Div", ["srf", "rate"], ["bias"]),
            helper.make_node("Add", ["state", "push"], ["moved"]),
            helper.make_node("Add", ["moved", "bias"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["stateN"]),
            helper.make_node("ReduceSum", ["stateN", "axes02"], ["summed"], keepdims=0),  # [b]
            helper.make_node("Unsqueeze", ["summed", "axis1"], ["output"]),  # [b, 1]
        ],
        "recurrent",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "samples"]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", 3]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "batch", 3]),
        ],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array([1], np.int64), "axis1"),
            numpy_helper.from_array(np.array([0, 2], np.int64), "axes_last"),
            numpy_helper.from_array(np.array([0, 2], np.int64), "axes02"),
            numpy_helper.from_array(np.array(16000.0, np.float32), "rate"),
        ],
    )
    return _save(graph, path)


def conv_detector(path: Path, squeezed: bool = False, seed: int = 0) -> Path:
    """A fully convolutional map, as detectors are: ``x`` float32 [batch, 1, H, W]
    (H, W free) -> ``heat`` float32 [batch, 1, h, w], one 12x12 convolution (no
    padding), so it runs at H, W >= 12 only and fails on 1x1. ``squeezed``: the
    map goes through a Squeeze without axes, which drops every axis of length 1
    at run time while the file still declares four (shape inference cannot tell
    which are 1): a declaration a run at batch 1 breaks."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).normal(size=(1, 1, 12, 12)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["map" if squeezed else "heat"])]
    if squeezed:
        nodes.append(helper.make_node("Squeeze", ["map"], ["heat"]))
    graph = helper.make_graph(
        nodes,
        "conv_detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, "H", "W"])],
        [helper.make_tensor_value_info("heat", TensorProto.FLOAT, ["batch", 1, "h", "w"])],
        [numpy_helper.from_array(w, "w")],
    )
    return _save(graph, path)


def run_each_alone(path: Path, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``run_alone`` on each of many requests, with one session (a session per
    request costs a load of the model each; hundreds of them cost minutes)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    out = []
    for feed in feeds:
        values = session.run(None, {k: v[None] for k, v in feed.items()})
        out.append({n: np.asarray(v)[0] for n, v in zip(names, values, strict=True)})
    return out
