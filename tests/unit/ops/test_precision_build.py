"""``build-engine --backend onnxruntime``: INT8 and FP16 builds of real models
(the bundled digits classifier, small ONNX models written in tests/onnx_models.py)
from calibration files, run by ONNX Runtime; the build record, the cache, and
the refusals (exit 2 naming the flag, the input and what it takes). Calibration
from a topic is tested on the embedded broker (tests/integration/test_precision.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests import onnx_models
from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
from worker.config import ModelConfig, PreprocessConfig, Settings
from worker.model.files import bundled_file, content_version, resolve_model_path
from worker.model.inputs import bind_model
from worker.model.inputs.image import resolve
from worker.model.io import TensorDesc
from worker.model.preprocess import preprocess
from worker.ops.build_engine import main
from worker.ops.calibration import from_files
from worker.ops.precision import PrecisionBuild, build_precision, record_path

DIGITS = bundled_file("digits_samples.npz")


def build(tmp: Path, precision: str, *args: str, model: str = "builtin:digits") -> list[str]:
    return [model, "--backend", "onnxruntime", "--precision", precision,
            "--out-dir", str(tmp), *args]  # fmt: skip


def test_int8_digits_from_files_record_names_the_served_version(tmp_path: Path) -> None:
    built = build_precision(
        PrecisionBuild(Settings(), "int8", out_dir=tmp_path, calibration_files=(DIGITS,))
    )
    record = json.loads(record_path(built.path).read_text())
    assert record == built.record and not built.cached
    # The version every result will carry is the engine's, computed the same way.
    served = OnnxRuntimeEngine(built.path, ModelConfig(path=str(built.path)))
    assert record["model_version"] == content_version(built.path) == served.info.version
    assert record["output"]["sha256"].startswith(record["model_version"])
    source = resolve_model_path("builtin:digits")
    assert record["source"]["version"] == content_version(source)
    assert record["precision"] == "int8" and record["options"]["format"] == "QDQ"
    assert record["calibration"]["samples"] == 256 and record["calibration"]["files"]
    assert record["onnxruntime_version"] == ort.__version__
    logits = record["agreement_with_float32"]["outputs"]["logits"]
    assert logits["top1_agreement"] >= 0.95 and 0 < logits["max_abs_diff"] < 1.0
    proto = onnx.load(str(built.path))
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in proto.graph.node}
    # Weights within +-64: no CPU's int8 kernel saturates on them, so the agreement
    # measured here holds on any x86 CPU (with VNNI or without; ARM never saturates).
    assert record["options"]["reduce_range"] is True
    weights = [onnx.numpy_helper.to_array(t) for t in proto.graph.initializer
               if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2]  # fmt: skip
    assert weights and all(np.abs(w.astype(np.int16)).max() <= 64 for w in weights)
    # Its inputs and outputs are the float32 model's: requests do not change.
    session = ort.InferenceSession(str(built.path), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type) for i in session.get_inputs()] == [("image", "tensor(float)")]


def test_calibration_feeds_are_what_the_worker_feeds_the_engine() -> None:
    """Images resized and normalised by the worker's binding, not the raw pixels."""
    model = ModelConfig()
    path = resolve_model_path(model.path)
    io = OnnxRuntimeEngine(path, model).info.io
    inputs = bind_model(model, io, Settings().limits).inputs
    calibration = from_files((DIGITS,), inputs, limit=40, batch_size=16)
    assert [len(r["image"]) for r in calibration.runs] == [16, 16, 8]
    with np.load(DIGITS) as data:
        images = data["images"][:40]
    want = preprocess(list(images), resolve(PreprocessConfig(), io.inputs[0]))
    got = np.concatenate([r["image"] for r in calibration.runs])
    np.testing.assert_array_equal(got, want)
    assert got.min() < -0.9 and got.max() > 0.9  # normalised to [-1, 1], not 0..255


def test_rebuild_is_cached_and_a_replaced_output_is_built_again(tmp_path: Path) -> None:
    args = build(tmp_path, "int8", "--calibration-files", str(DIGITS))
    assert main(args) == 0
    (out,) = tmp_path.glob("*.onnx")
    first = record_path(out).read_text()
    built = build_precision(
        PrecisionBuild(Settings(), "int8", out_dir=tmp_path, calibration_files=(DIGITS,))
    )
    assert built.cached and built.path == out and record_path(out).read_text() == first
    # The same samples stored another way are the same calibration feeds: a hit.
    with np.load(DIGITS) as data:
        np.save(tmp_path / "images.npy", data["images"])
    again = build_precision(
        PrecisionBuild(
            Settings(), "int8", out_dir=tmp_path, calibration_files=(tmp_path / "images.npy",)
        )
    )
    assert again.cached and again.path == out
    # Other samples: another key, another file.
    fewer = dataclasses.replace(
        PrecisionBuild(Settings(), "int8", out_dir=tmp_path, calibration_files=(DIGITS,)),
        calibration_count=64,
    )
    assert build_precision(fewer).path != out
    # An output replaced since its build is not trusted: built again.
    out.write_bytes(b"not the built model")
    rebuilt = build_precision(
        PrecisionBuild(Settings(), "int8", out_dir=tmp_path, calibration_files=(DIGITS,))
    )
    assert not rebuilt.cached and content_version(out) == rebuilt.record["model_version"]


def test_fp16_keeps_float32_inputs_and_outputs(tmp_path: Path) -> None:
    out = tmp_path / "digits-fp16.onnx"
    assert main(build(tmp_path, "fp16", "--out", str(out))) == 0
    record = json.loads(record_path(out).read_text())
    assert record["model_version"] == content_version(out) and record["calibration"] is None
    model = onnx.load(str(out))
    weights = {t.name: t.data_type for t in model.graph.initializer}
    assert weights["W1"] == onnx.TensorProto.FLOAT16
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.type for i in session.get_inputs()] == ["tensor(float)"]
    assert [o.type for o in session.get_outputs()] == ["tensor(float)"]
    with np.load(DIGITS) as data:
        x = preprocess(list(data["images"]), resolve(PreprocessConfig(), _digits_input()))
    (want,) = ort.InferenceSession(
        str(resolve_model_path("builtin:digits")), providers=["CPUExecutionProvider"]
    ).run(None, {"image": x})
    (got,) = session.run(None, {"image": x})
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.99
    assert np.max(np.abs(got - want)) < 0.05


def test_a_model_without_float_weights_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    half = tmp_path / "half.onnx"
    assert main(build(tmp_path, "fp16", "--out", str(half))) == 0
    capsys.readouterr()
    assert main(build(tmp_path, "fp16", model=str(half))) == 2
    assert "no float32 weights to convert to float16" in capsys.readouterr().err
    assert main(build(tmp_path, "int8", "--calibration-files", str(DIGITS), model=str(half))) == 2
    assert "no float32 weights of Conv, ConvTranspose, Gemm, MatMul" in capsys.readouterr().err


def test_calibration_shapes_that_do_not_fit_exit_2_naming_the_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rgb = tmp_path / "rgb.npy"
    np.save(rgb, np.zeros((4, 8, 8, 3), np.uint8))
    assert main(build(tmp_path, "int8", "--calibration-files", str(rgb))) == 2
    err = capsys.readouterr().err
    assert f"--calibration-files {rgb} [sample 0]: inputs.image.shape: expected [H, W, 1]" in err
    assert "image float32 [1, 8, 8]" in err

    table = onnx_models.tabular(tmp_path / "tabular.onnx")
    wide = tmp_path / "wide.npy"
    np.save(wide, np.zeros((4, 5), np.float32))
    assert main(build(tmp_path, "int8", "--calibration-files", str(wide), model=str(table))) == 2
    err = capsys.readouterr().err
    assert "inputs.features.shape[0]: expected 4 (float32 [4]), got 5" in err
    assert not list(tmp_path.glob("*.build.json"))


def test_calibration_flags_usage_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(build(tmp_path, "int8")) == 2
    assert "--precision int8 needs calibration samples" in capsys.readouterr().err
    assert main(build(tmp_path, "fp32")) == 2
    assert "builds fp16 or int8" in capsys.readouterr().err
    assert main(build(tmp_path, "int8", "--calibration-files", str(tmp_path / "none"))) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert (
        main(build(tmp_path, "int8", "--calibration-files", str(DIGITS), "--quantize-ops", ","))
        == 2
    )
    assert "--quantize-ops: name op types" in capsys.readouterr().err
    out = tmp_path / "all.onnx"
    args = ("--calibration-files", str(DIGITS), "--quantize-ops", "all", "--out", str(out))
    assert main(build(tmp_path, "int8", *args)) == 0
    assert json.loads(record_path(out).read_text())["options"]["op_types"] == "all"


def test_two_inputs_from_an_npz_and_a_fixed_batch(tmp_path: Path) -> None:
    ranker = onnx_models.ranker(tmp_path / "ranker.onnx")
    rng = np.random.default_rng(0)
    samples = tmp_path / "ranker.npz"
    np.savez(samples, features=rng.normal(size=(20, 4)).astype(np.float32),
             ids=rng.integers(1, 50, (20, 6)).astype(np.int64))  # fmt: skip
    settings = dataclasses.replace(Settings(), model=ModelConfig(path=str(ranker)))
    built = build_precision(
        PrecisionBuild(settings, "int8", out_dir=tmp_path, calibration_files=(samples,))
    )
    assert built.record["calibration"]["samples"] == 20
    score = built.record["agreement_with_float32"]["outputs"]["score"]
    assert score["max_abs_diff"] < 0.1

    fixed = onnx_models.fixed_batch(tmp_path / "fixed.onnx", batch=4)
    rows = tmp_path / "rows.npy"
    np.save(rows, rng.normal(size=(10, 4)).astype(np.float32))
    settings = dataclasses.replace(Settings(), model=ModelConfig(path=str(fixed)))
    model = settings.model
    io = OnnxRuntimeEngine(fixed, model).info.io
    inputs = bind_model(model, io, settings.limits).inputs
    runs = from_files((rows,), inputs, limit=100, batch_size=32).runs
    # Runs of the model's batch, the last filled with its own last row (as served).
    assert [len(r["x"]) for r in runs] == [4, 4, 4]
    np.testing.assert_array_equal(runs[-1]["x"][2], runs[-1]["x"][1])
    built = build_precision(
        PrecisionBuild(settings, "int8", out_dir=tmp_path, calibration_files=(rows,))
    )
    assert built.record["calibration"]["engine_runs"] == 3


def _digits_input() -> TensorDesc:
    model = ModelConfig()
    return OnnxRuntimeEngine(resolve_model_path(model.path), model).info.io.inputs[0]


def test_weights_in_constant_nodes_below_opset_13_are_quantized_per_channel(
    tmp_path: Path,
) -> None:
    """As paddle2onnx writes models (every weight a Constant node, opset 11): the
    weights become int8 initializers with one scale per output channel."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    scales = np.array([1.0, 0.1, 3.0, 0.01], np.float32)[:, None, None, None]
    weight = (rng.normal(size=(4, 3, 3, 3)) * scales).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(weight)),
            helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
        ],
        "paddle_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    proto.ir_version = 7
    source = tmp_path / "paddle_like.onnx"
    onnx.save(proto, str(source))
    rows = tmp_path / "rows.npy"
    np.save(rows, rng.normal(size=(64, 3, 8, 8)).astype(np.float32))
    settings = dataclasses.replace(Settings(), model=ModelConfig(path=str(source)))
    built = build_precision(
        PrecisionBuild(settings, "int8", out_dir=tmp_path, calibration_files=(rows,))
    )
    model = onnx.load(str(built.path))
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 13
    assert not [n for n in model.graph.node if n.op_type == "Constant"]
    init = {t.name: t for t in model.graph.initializer}
    assert init["w_quantized"].data_type == onnx.TensorProto.INT8
    assert list(init["w_scale"].dims) == [4]  # one scale per output channel
    y = built.record["agreement_with_float32"]["outputs"]["y"]
    assert y["max_abs_diff"] < 0.1 * np.abs(weight).sum(axis=(1, 2, 3)).max()
