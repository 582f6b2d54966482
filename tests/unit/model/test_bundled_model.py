"""The bundled digits model (worker/model/bundled/digits.*) is real, loadable and as
accurate as recorded.

Only numpy, onnxruntime and the standard library are used here; the preprocessing contract is
re-implemented with numpy so that this test pins it independently of the worker's code:
uint8 HWC -> float32 / 255 -> (x - mean) / std -> NCHW.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

MODELS = files("worker.model") / "bundled"


@pytest.fixture(scope="module")
def meta() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((MODELS / "digits.json").read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def samples() -> tuple[np.ndarray, np.ndarray]:
    with (MODELS / "digits_samples.npz").open("rb") as fh, np.load(fh) as npz:
        images = np.array(npz["images"])
        labels = np.array(npz["labels"])
    return images, labels


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    model_bytes = (MODELS / "digits.onnx").read_bytes()
    return ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])


def preprocess(images: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    pp = meta["preprocess"]
    mean = np.asarray(pp["mean"], dtype=np.float32)
    std = np.asarray(pp["std"], dtype=np.float32)
    x = images.astype(np.float32) / np.float32(255.0)
    x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)


def run(session: ort.InferenceSession, meta: dict[str, Any], x: np.ndarray) -> np.ndarray:
    (out,) = session.run([meta["output"]], {meta["input"]: x})
    return np.asarray(out)


def test_metadata_matches_preprocessing_contract(meta: dict[str, Any]) -> None:
    assert meta["name"] == "digits"
    assert meta["num_classes"] == 10
    pp = meta["preprocess"]
    assert pp["size"] == [8, 8]
    assert pp["channels"] == 1
    assert pp["scale"] == pytest.approx(1.0 / 255.0)
    assert pp["mean"] == [0.5]
    assert pp["std"] == [0.5]
    assert pp["layout"] == "NCHW"
    assert pp["dtype"] == "float32"
    assert meta["onnx_opset"] == 17


def test_samples_shape_and_classes(
    meta: dict[str, Any], samples: tuple[np.ndarray, np.ndarray]
) -> None:
    images, labels = samples
    m = meta["heldout_samples"]
    assert images.dtype == np.uint8
    assert images.shape == (m, 8, 8, 1)
    assert labels.dtype == np.int64
    assert labels.shape == (m,)
    assert set(np.unique(labels).tolist()) == set(range(10))


def test_io_names_match_metadata(session: ort.InferenceSession, meta: dict[str, Any]) -> None:
    inputs = session.get_inputs()
    outputs = session.get_outputs()
    assert [i.name for i in inputs] == [meta["input"]]
    assert [o.name for o in outputs] == [meta["output"]]
    assert inputs[0].type == "tensor(float)"
    assert outputs[0].type == "tensor(float)"
    assert inputs[0].shape[1:] == [1, 8, 8]
    assert not isinstance(inputs[0].shape[0], int)  # dynamic batch dimension
    assert outputs[0].shape[1:] == [meta["num_classes"]]


def test_heldout_accuracy_matches_recorded(
    session: ort.InferenceSession,
    meta: dict[str, Any],
    samples: tuple[np.ndarray, np.ndarray],
) -> None:
    images, labels = samples
    logits = run(session, meta, preprocess(images, meta))
    assert logits.shape == (len(labels), meta["num_classes"])
    assert logits.dtype == np.float32
    assert np.all(np.isfinite(logits))
    n_correct = int(np.sum(np.argmax(logits, axis=1) == labels))
    accuracy = n_correct / len(labels)
    # Same correct count as when the model was exported, hence the exact same float.
    assert n_correct == round(meta["heldout_accuracy"] * meta["heldout_samples"])
    assert accuracy == meta["heldout_accuracy"]
    assert accuracy >= 0.9


@pytest.mark.parametrize("batch", [1, 64])
def test_dynamic_batch(
    session: ort.InferenceSession,
    meta: dict[str, Any],
    samples: tuple[np.ndarray, np.ndarray],
    batch: int,
) -> None:
    images, _ = samples
    assert len(images) >= batch
    x = preprocess(images, meta)
    full = run(session, meta, x)
    out = run(session, meta, x[:batch])
    assert out.shape == (batch, meta["num_classes"])
    # Batching must not change the per-item result.
    np.testing.assert_allclose(out, full[:batch], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.argmax(out, axis=1), np.argmax(full[:batch], axis=1))
