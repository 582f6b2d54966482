"""A real ONNX model that fails on one kind of input: the bundled digits MLP plus
a branch that makes ONNX Runtime's Reshape fail for any batch containing an image
whose top-left pixel is bright (never the case in the digits data).

It fails the way a real model with a data-dependent bug does: the whole batch
raises, with no hint which request caused it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from worker.model.files import bundled_file


def build(out: Path) -> Path:
    base = onnx.load(str(bundled_file("digits.onnx")))
    graph = base.graph
    logits = graph.output[0].name
    graph.output.remove(graph.output[0])
    x = graph.input[0].name

    def const(name: str, value: np.ndarray) -> None:
        graph.initializer.append(numpy_helper.from_array(value, name))

    const("p_starts", np.array([0, 0, 0], dtype=np.int64))
    const("p_ends", np.array([1, 1, 1], dtype=np.int64))
    const("p_axes", np.array([1, 2, 3], dtype=np.int64))
    const("p_thresh", np.array(0.9, dtype=np.float32))
    const("p_64", np.array([64], dtype=np.int64))
    const("p_minus1", np.array([-1], dtype=np.int64))
    const("p_zero", np.array(0.0, dtype=np.float32))
    const("p_axes0", np.array([0], dtype=np.int64))
    graph.node.extend(
        [
            helper.make_node("Slice", [x, "p_starts", "p_ends", "p_axes"], ["p_corner"]),
            helper.make_node("ReduceMax", ["p_corner"], ["p_max"], keepdims=0),
            helper.make_node("Greater", ["p_max", "p_thresh"], ["p_flag_b"]),
            helper.make_node("Cast", ["p_flag_b"], ["p_flag"], to=TensorProto.INT64),
            helper.make_node("Unsqueeze", ["p_flag", "p_axes0"], ["p_flag1"]),  # [1]
            helper.make_node("Add", ["p_64", "p_flag1"], ["p_width"]),
            helper.make_node("Concat", ["p_minus1", "p_width"], ["p_shape"], axis=0),
            helper.make_node("Flatten", [x], ["p_flat"], axis=1),
            # [N, 64] -> [-1, 65] fails unless N is a multiple of 65 (batches are <= 64).
            helper.make_node("Reshape", ["p_flat", "p_shape"], ["p_reshaped"]),
            helper.make_node("ReduceSum", ["p_reshaped"], ["p_sum"], keepdims=0),
            helper.make_node("Mul", ["p_sum", "p_zero"], ["p_nothing"]),
            helper.make_node("Add", [logits, "p_nothing"], ["logits_checked"]),
        ]
    )
    graph.output.append(
        helper.make_tensor_value_info("logits_checked", TensorProto.FLOAT, ["batch", 10])
    )
    onnx.checker.check_model(base)
    onnx.save(base, str(out))
    return out
