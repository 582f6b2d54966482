"""Train the small bundled digits classifier and export it to ONNX by hand.

The model is a one-hidden-layer MLP trained on scikit-learn's offline 8x8 hand-written
digits dataset (``sklearn.datasets.load_digits``; it ships with scikit-learn, so nothing is
downloaded). It is exported with ``onnx.helper`` only (no skl2onnx) as::

    image float32 [batch, 1, 8, 8] -> Flatten -> Gemm -> Relu -> Gemm -> logits float32 [batch, 10]

Preprocessing contract (what the worker does before calling the model):

    x = img_uint8_hwc.astype(float32) / 255.0
    x = (x - 0.5) / 0.5
    x = x.transpose(HWC -> CHW)            # NCHW for a batch

Outputs (in ``--out-dir``, default ``worker/model/bundled``):

* ``digits.onnx``        - the model (opset 17, dynamic batch dimension "batch")
* ``digits_samples.npz`` - held-out test images (uint8 [M, 8, 8, 1]) and labels (int64 [M])
* ``digits.json``        - metadata, including the held-out accuracy measured with ONNX Runtime

To retrain (deterministic for a given ``--seed``)::

    pip install -e '.[train]' && python scripts/train_digits.py
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import sklearn
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

OPSET = 17
IR_VERSION = 8  # the IR version that goes with opset 17; readable by older runtimes
NUM_CLASSES = 10
HIDDEN = 64
MEAN = 0.5
STD = 0.5
PRODUCER = "infer-worker/scripts/train_digits.py"
DATASET = "sklearn.datasets.load_digits (UCI ML hand-written digits, 1797 images)"


def to_uint8_images(data: np.ndarray) -> np.ndarray:
    """Flat 0..16 digit values [N, 64] -> uint8 HWC images [N, 8, 8, 1]."""
    imgs = np.clip(np.rint(data * 255.0 / 16.0), 0, 255).astype(np.uint8)
    return imgs.reshape(-1, 8, 8, 1)


def preprocess(images: np.ndarray) -> np.ndarray:
    """uint8 HWC [N, 8, 8, 1] -> float32 NCHW [N, 1, 8, 8] (the worker's contract)."""
    x = images.astype(np.float32) / np.float32(255.0)
    x = (x - np.float32(MEAN)) / np.float32(STD)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)


def build_onnx(clf: MLPClassifier, seed: int, n_train: int) -> onnx.ModelProto:
    """Build Flatten -> Gemm -> Relu -> Gemm from the trained MLP weights."""
    w1 = np.asarray(clf.coefs_[0], dtype=np.float32)  # [64, HIDDEN]
    b1 = np.asarray(clf.intercepts_[0], dtype=np.float32)  # [HIDDEN]
    w2 = np.asarray(clf.coefs_[1], dtype=np.float32)  # [HIDDEN, 10]
    b2 = np.asarray(clf.intercepts_[1], dtype=np.float32)  # [10]
    if w2.shape[1] != NUM_CLASSES:
        raise RuntimeError(f"expected {NUM_CLASSES} output units, got {w2.shape[1]}")

    initializers = [
        numpy_helper.from_array(w1, name="W1"),
        numpy_helper.from_array(b1, name="b1"),
        numpy_helper.from_array(w2, name="W2"),
        numpy_helper.from_array(b2, name="b2"),
    ]
    nodes = [
        helper.make_node("Flatten", ["image"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "W1", "b1"], ["hidden_pre"], name="gemm1"),
        helper.make_node("Relu", ["hidden_pre"], ["hidden"], name="relu1"),
        helper.make_node("Gemm", ["hidden", "W2", "b2"], ["logits"], name="gemm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        inputs=[helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        outputs=[
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", NUM_CLASSES])
        ],
        initializer=initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=PRODUCER,
        producer_version="1",
        ir_version=IR_VERSION,
    )
    model.doc_string = (
        f"8x8 hand-written digit classifier (MLP 64-{HIDDEN}-{NUM_CLASSES}, ReLU) trained on "
        f"{DATASET}; stratified 80/20 split, seed={seed}, {n_train} training images. "
        "Input: uint8 HWC image -> float32 /255 -> (x-0.5)/0.5 -> NCHW [batch,1,8,8]. "
        "Output: unnormalised class logits [batch,10] for digits 0-9."
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("worker/model/bundled"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    seed: int = args.seed
    out_dir: Path = args.out_dir

    digits = load_digits()
    images = to_uint8_images(np.asarray(digits.data))
    labels = np.asarray(digits.target, dtype=np.int64)
    x_train_img, x_test_img, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=seed, stratify=labels
    )

    x_train = preprocess(x_train_img).reshape(len(x_train_img), -1)
    x_test = preprocess(x_test_img).reshape(len(x_test_img), -1)

    clf = MLPClassifier(hidden_layer_sizes=(HIDDEN,), max_iter=500, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x_train, y_train)
    if list(clf.classes_) != list(range(NUM_CLASSES)):
        raise RuntimeError(f"unexpected classes {clf.classes_}")
    sk_acc = float(np.mean(clf.predict(x_test) == y_test))

    model = build_onnx(clf, seed, len(x_train_img))
    model_bytes = model.SerializeToString()

    sess = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    (logits,) = sess.run(["logits"], {"image": preprocess(x_test_img)})
    n_correct = int(np.sum(np.argmax(logits, axis=1) == y_test))
    ort_acc = n_correct / len(y_test)
    print(f"sklearn held-out accuracy: {sk_acc:.4f}")
    print(f"onnxruntime held-out accuracy: {ort_acc:.4f} ({n_correct}/{len(y_test)})")
    assert ort_acc == sk_acc, f"ORT accuracy {ort_acc} != sklearn accuracy {sk_acc}"

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "digits.onnx").write_bytes(model_bytes)
    np.savez_compressed(
        out_dir / "digits_samples.npz",
        images=np.ascontiguousarray(x_test_img, dtype=np.uint8),
        labels=np.ascontiguousarray(y_test, dtype=np.int64),
    )
    meta = {
        "name": "digits",
        "input": "image",
        "output": "logits",
        "num_classes": NUM_CLASSES,
        "preprocess": {
            "size": [8, 8],
            "channels": 1,
            "scale": 1.0 / 255.0,
            "mean": [MEAN],
            "std": [STD],
            "layout": "NCHW",
            "dtype": "float32",
        },
        "heldout_accuracy": ort_acc,
        "heldout_samples": len(y_test),
        "seed": seed,
        "dataset": DATASET,
        "sklearn_version": sklearn.__version__,
        "onnx_opset": OPSET,
    }
    (out_dir / "digits.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    for name in ("digits.onnx", "digits_samples.npz", "digits.json"):
        path = out_dir / name
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
