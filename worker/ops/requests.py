"""The requests ``infer-worker produce`` sends: image files, texts, a bundled
model's samples, each with a fresh unique id; cycled to a count for a backlog or
a steady stream (``produce --count``), never capped without a word."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from worker.config import LimitsConfig
from worker.contract import (
    EncodedImage,
    ModelRef,
    Request,
    Tensor,
    decode_request,
    encode_request,
    sniff_format,
)
from worker.flow.errors import ConfigError


@dataclass(frozen=True)
class LabelledRequest:
    id: str
    label: str  # what the person asked for: a file name or "sample 3 (a 7)"
    value: bytes


def with_meta(
    requests: Sequence[LabelledRequest],
    meta: Mapping[str, Any],
    model: str | None = None,
    version: str | None = None,
) -> list[LabelledRequest]:
    """``requests`` with ``meta`` added to each one's (``produce --meta``: a label
    ``compare --label-key`` reads, a trace id, anything the results should echo),
    naming ``model`` at ``version`` when given (``produce --model-name``)."""
    if not meta and model is None:
        return list(requests)
    out = []
    for r in requests:
        request = decode_request(r.value)
        merged = {**(request.meta or {}), **meta} or None
        ref = None if model is None else ModelRef(model, version)
        named = msgspec.structs.replace(request, meta=merged, model=ref)
        out.append(LabelledRequest(r.id, r.label, encode_request(named)))
    return out


def parse_meta(items: Sequence[str]) -> dict[str, Any]:
    """``key=value`` pairs; a value that reads as JSON (a number, true, a list)
    is sent as that, anything else as a string (``label=7`` is the int 7)."""
    meta: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--meta {item!r}: expected key=value")
        try:
            meta[key.strip()] = json.loads(text)
        except ValueError:
            meta[key.strip()] = text
    return meta


def from_file(path: Path, limits: LimitsConfig, input_name: str = "image") -> LabelledRequest:
    """A request for one file: image files as sent, ``.npy`` as a tensor (any
    dtype the contract carries: the worker checks it against the model)."""
    rid = f"{path.stem}-{uuid.uuid4().hex[:8]}"
    request = Request(v=1, id=rid, inputs={input_name: _file_input(path, limits)})
    return LabelledRequest(rid, str(path), encode_request(request))


def from_named_files(named: Mapping[str, Path], limits: LimitsConfig) -> LabelledRequest:
    """One request of several named inputs (``produce --input NAME=FILE``), each
    file read as ``from_file`` reads one."""
    rid = f"request-{uuid.uuid4().hex[:8]}"
    inputs = {name: _file_input(path, limits) for name, path in named.items()}
    label = ", ".join(f"{name}={path}" for name, path in named.items())
    return LabelledRequest(rid, label, encode_request(Request(v=1, id=rid, inputs=inputs)))


def _file_input(path: Path, limits: LimitsConfig) -> Tensor | EncodedImage:
    if path.suffix.lower() == ".npy":
        try:
            return Tensor.from_numpy(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    fmt = sniff_format(data)
    if fmt is None:
        raise ConfigError(f"{path}: not a JPEG, PNG or WebP file (or a .npy array)")
    if len(data) > limits.max_tensor_bytes:
        raise ConfigError(
            f"{path}: {len(data)} bytes; the worker takes files up to "
            f"limits.max_tensor_bytes = {limits.max_tensor_bytes}"
        )
    return EncodedImage(fmt, data)


def from_text(text: str, input_name: str = "text") -> LabelledRequest:
    """A request for one text (a text input: the worker tokenizes it)."""
    rid = f"text-{uuid.uuid4().hex[:8]}"
    label = text if len(text) <= 40 else text[:37] + "..."
    return LabelledRequest(
        rid, repr(label), encode_request(Request(v=1, id=rid, inputs={input_name: text}))
    )


# What each bundled model's outputs mean, for the one line ``produce`` prints.
OUTPUT_LABELS: Mapping[str, Mapping[str, Sequence[str]]] = {
    "sentiment": {"logits": ("negative", "positive")},
}


def from_samples(n: int, model: str = "digits") -> list[LabelledRequest]:
    """``n`` labelled held-out samples of a bundled model: digits (8x8, grey) or
    sentiment (review texts; 1 = positive). Past the held-out set they cycle
    (each copy a request of its own), which is said on stderr."""
    if n <= 0:
        return []
    run = uuid.uuid4().hex[:8]
    base: list[tuple[str, Request]] = []
    if model == "sentiment":
        from worker.ops.samples import sentiment_samples

        for i, text in enumerate(sentiment_samples(1)):
            request = Request(v=1, id="", inputs={"text": text.text}, meta={"label": text.label})
            base.append((f"sample {i} ({'positive' if text.label else 'negative'})", request))
    else:
        from worker.ops.samples import labelled_samples

        for i, sample in enumerate(labelled_samples(1)):
            request = Request(v=1, id="", inputs={"image": Tensor.from_numpy(sample.image)},
                              meta={"label": sample.label})  # fmt: skip
            base.append((f"sample {i} (a {sample.label})", request))
    if n > len(base):
        print(f"--samples {n}: the {len(base)} held-out {model} samples, cycled "
              f"({n} requests, each with its own id)", file=sys.stderr)  # fmt: skip
    out = []
    for i in range(n):
        label, request = base[i % len(base)]
        rid = f"sample-{i}-{run}"
        value = encode_request(msgspec.structs.replace(request, id=rid))
        out.append(LabelledRequest(rid, label, value))
    return out


def cycled(requests: Sequence[LabelledRequest], count: int) -> Iterator[LabelledRequest]:
    """``count`` requests: ``requests`` over and over, each copy after the first
    pass with an id of its own (``<id>-<pass>``), so every answer is told apart;
    fewer than given takes the first ``count``."""
    if count < 1:
        raise ConfigError(f"--count must be >= 1, got {count}")
    if not requests:
        return
    for i in range(count):
        passes, r = divmod(i, len(requests))
        original = requests[r]
        if passes == 0:
            yield original
            continue
        rid = f"{original.id}-{passes}"
        request = msgspec.structs.replace(decode_request(original.value), id=rid)
        yield LabelledRequest(rid, original.label, encode_request(request))
