"""Labelled requests for the bundled models, and what the model itself answers
offline: what ``demo``, ``produce --samples``, the benchmarks and the tests send.

``digits``: the 360 held-out 8x8 digits (image tensors; the demo repeats them at
8x8, 16x16 and 24x24 so the worker resizes). ``sentiment``: the 400 held-out
synthetic reviews of the bundled text model (strings the worker tokenizes).
``sensor``: 24 sensors' readings for the bundled stateful anomaly detector, each
sensor a record key (the worker keeps its running mean and variance), labelled
1 where a spike was injected.
Each set knows how to read the predicted class from a result, and counts the
model's own correct answers on the same inputs without Kafka (ONNX Runtime on
the same preprocessing or tokenizer), which the demo's stream must equal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np

from worker.compute.engines import load_engine
from worker.config import ModelConfig
from worker.contract import Request, Result, Tensor, encode_request
from worker.model.files import bundled_file, resolve_tokenizer_path
from worker.model.inputs.image import resolve
from worker.model.postprocess import softmax
from worker.model.preprocess import preprocess

DEMO_MODELS: Final = ("digits", "sentiment", "sensor")


@dataclass
class Sample:
    """A held-out digit: uint8 [H, W, 1] and its label."""

    id: str
    image: np.ndarray
    label: int


@dataclass
class TextSample:
    """A held-out review of the bundled text model: 1 positive, 0 negative;
    ``tokens``: its length after tokenization (special tokens included)."""

    id: str
    text: str
    label: int
    tokens: int


def labelled_samples(repeat: int) -> list[Sample]:
    """The held-out set ``repeat`` times; pass r is upscaled (nearest) by 1 + r % 3,
    so requests arrive at 8x8, 16x16 and 24x24 and the worker resizes them."""
    with np.load(bundled_file("digits_samples.npz")) as data:
        images, labels = data["images"], data["labels"]
    out = []
    for r in range(repeat):
        k = 1 + r % 3
        for i, (img, label) in enumerate(zip(images, labels, strict=True)):
            big = np.kron(img, np.ones((k, k, 1), dtype=np.uint8)) if k > 1 else img
            out.append(Sample(f"{r}-{i}", np.ascontiguousarray(big), int(label)))
    return out


def sentiment_samples(repeat: int = 1, max_length: int = 64) -> list[TextSample]:
    """The bundled text model's held-out reviews, ``repeat`` times."""
    from tokenizers import Tokenizer

    path = bundled_file("sentiment_samples.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_file(str(resolve_tokenizer_path("builtin:sentiment", "tokenizer")))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    counts = [len(e.ids) for e in tokenizer.encode_batch(data["texts"])]
    rows = list(zip(data["texts"], data["labels"], counts, strict=True))
    return [
        TextSample(f"{r}-{i}", text, int(label), n)
        for r in range(repeat)
        for i, (text, label, n) in enumerate(rows)
    ]


def encode_samples(samples: list[Sample]) -> list[tuple[bytes | None, bytes]]:
    return [
        (s.id.encode(), _request(s.id, {"image": Tensor.from_numpy(s.image)}, s.label))
        for s in samples
    ]


def _request(rid: str, inputs: dict[str, Tensor | str], label: int) -> bytes:
    return encode_request(Request(v=1, id=rid, inputs=inputs, meta={"label": label}))


def offline_correct(samples: list[Sample], model: ModelConfig) -> int:
    """Correct predictions of the same ONNX model run directly, no Kafka."""
    engine = load_engine(model)
    name = model.output or engine.info.output_names[0]
    pre = resolve(model.preprocess, engine.info.io.inputs[0])
    correct = 0
    for start in range(0, len(samples), 256):
        chunk = samples[start : start + 256]
        batch = preprocess([s.image for s in chunk], pre)
        probs = softmax(engine.run({engine.info.io.inputs[0].name: batch})[name])
        correct += int((probs.argmax(axis=1) == [s.label for s in chunk]).sum())
    engine.close()
    return correct


def offline_text_correct(samples: list[TextSample], max_length: int = 64) -> int:
    """Correct answers of the bundled text model on the same texts: its tokenizer
    and its ONNX file, no Kafka (one text at a time: nothing padded)."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from worker.model.files import resolve_model_path

    tokenizer = Tokenizer.from_file(str(resolve_tokenizer_path("builtin:sentiment", "tokenizer")))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    session = ort.InferenceSession(
        str(resolve_model_path("builtin:sentiment")), providers=["CPUExecutionProvider"]
    )
    correct = 0
    for sample in samples:
        enc = tokenizer.encode(sample.text)
        feeds = {
            "input_ids": np.array([enc.ids], np.int64),
            "attention_mask": np.array([enc.attention_mask], np.int64),
        }
        logits = session.run(["logits"], feeds)[0]
        correct += int(int(np.argmax(logits[0])) == sample.label)
    return correct


@dataclass
class LabelledSet:
    """What the demo sends for one bundled model, and how it scores the answers."""

    model: str  # builtin model name
    description: str
    records: list[tuple[bytes | None, bytes]]
    labels: dict[str, int]  # request id -> label
    predicted: Callable[[Result], int]
    offline_correct: int
    keyed: bool = False  # a stateful model's: a key's records stay on one partition
    # What "accuracy" counts for this model, printed beside the figure.
    accuracy_means: str = "top-1 answer equals the label"


def _top1(result: Result) -> int:
    return int(result.outputs["topk_indices"].to_numpy()[0])


def _argmax_logits(result: Result) -> int:
    return int(np.argmax(result.outputs["logits"].to_numpy()))


def labelled_set(model: str, repeat: int) -> LabelledSet:
    """The demo's requests for ``model`` (one of ``DEMO_MODELS``), ``repeat`` times
    over its held-out samples."""
    if model == "digits":
        digits = labelled_samples(repeat)
        sizes = sorted({f"{s.image.shape[0]}x{s.image.shape[1]}" for s in digits})
        return LabelledSet(
            "digits",
            f"labelled digit requests ({', '.join(sizes)})",
            encode_samples(digits),
            {s.id: s.label for s in digits},
            _top1,
            offline_correct(digits, ModelConfig()),
        )
    if model == "sentiment":
        texts = sentiment_samples(repeat)
        lengths = [s.tokens for s in texts]
        records: list[tuple[bytes | None, bytes]] = [
            (s.id.encode(), _request(s.id, {"text": s.text}, s.label)) for s in texts
        ]
        return LabelledSet(
            "sentiment",
            f"labelled review texts ({min(lengths)} to {max(lengths)} tokens)",
            records,
            {s.id: s.label for s in texts},
            _argmax_logits,
            offline_text_correct(texts),
        )
    if model == "sensor":
        return sensor_set(repeat)
    raise ValueError(f"no labelled samples for {model!r} (demo models: {', '.join(DEMO_MODELS)})")


SENSOR_THRESHOLD: Final = 9.0  # a squared z-score over 9: three standard deviations


def sensor_set(repeat: int) -> LabelledSet:
    """Every sensor's readings in order, ``repeat`` times (each repetition a
    sequence of its own: ``sequence_start`` on its first reading, ``sequence_end``
    on its last), interleaved across sensors; and the model's own answers run
    sequentially per sensor, its state threaded, without Kafka."""
    import onnxruntime as ort

    from worker.model.files import resolve_model_path

    with np.load(bundled_file("sensor_samples.npz")) as data:
        readings, labels = data["readings"], data["labels"]
    sensors, count = readings.shape
    session = ort.InferenceSession(
        str(resolve_model_path("builtin:sensor")), providers=["CPUExecutionProvider"]
    )
    records: list[tuple[bytes | None, bytes]] = []
    truth: dict[str, int] = {}
    correct = 0
    for r in range(repeat):
        for s in range(sensors):
            mean, var = np.zeros((1, 1), np.float32), np.ones((1, 1), np.float32)
            for t in range(count):
                x = readings[s, t].reshape(1, 1)
                score, mean, var = session.run(None, {"x": x, "mean": mean, "var": var})
                correct += int((float(score[0, 0]) > SENSOR_THRESHOLD) == bool(labels[s, t]))
        for t in range(count):
            for s in range(sensors):
                rid = f"{r}-s{s}-{t}"
                request = Request(
                    v=1, id=rid, inputs={"x": Tensor.from_numpy(readings[s, t].reshape(1))},
                    meta={"label": int(labels[s, t])},
                    sequence_start=t == 0, sequence_end=t == count - 1,
                )  # fmt: skip
                records.append((f"sensor-{s}".encode(), encode_request(request)))
                truth[rid] = int(labels[s, t])
    return LabelledSet(
        "sensor",
        f"readings of {sensors} sensors, a stateful sequence per sensor "
        f"({count} readings a sequence, {repeat} sequence{'s' * (repeat != 1)} per sensor)",
        records, truth, _anomaly, correct, keyed=True,
        accuracy_means=f"readings flagged anomalous (score > {SENSOR_THRESHOLD}) or not "
        "as labelled",
    )  # fmt: skip


def _anomaly(result: Result) -> int:
    return int(float(result.outputs["score"].to_numpy().reshape(-1)[0]) > SENSOR_THRESHOLD)
