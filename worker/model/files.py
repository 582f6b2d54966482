"""Where model files come from: ``builtin:NAME`` (the models shipped in the
package), or a path; and the content hash every result names its model by."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

from worker.flow.errors import ConfigError


@dataclass(frozen=True)
class Builtin:
    """A model in ``worker/model/bundled``; ``tokenizer`` for the text models."""

    file: str
    tokenizer: str | None = None
    max_length: int = 128  # its text input's truncation, when it has one
    # A stateful model's states: (input, the output carrying the next, initial).
    states: tuple[tuple[str, str, float], ...] = ()


BUILTIN_MODELS: Final = {
    "digits": Builtin("digits.onnx"),
    "sentiment": Builtin("sentiment.onnx", tokenizer="sentiment.tokenizer.json", max_length=64),
    # An anomaly detector per sensor (scripts/build_sensor_model.py): stateful.
    "sensor": Builtin("sensor.onnx", states=(("mean", "meanN", 0.0), ("var", "varN", 1.0))),
}


def bundled_file(name: str) -> Path:
    """A file shipped with the bundled models (``worker/model/bundled``): models,
    tokenizers, held-out samples, training records."""
    return Path(str(resources.files("worker.model") / "bundled" / name))


def resolve_model_path(path: str) -> Path:
    """``builtin:NAME`` names a model shipped in the package; anything else is a file."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            known = ", ".join(sorted(BUILTIN_MODELS))
            raise ConfigError(f"model.path: unknown builtin model {name!r} (builtin: {known})")
        return bundled_file(BUILTIN_MODELS[name].file)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.path: {path} is not a file")
    return p


def resolve_tokenizer_path(path: str, setting: str) -> Path:
    """A tokenizer.json file, or ``builtin:NAME`` for a bundled text model's."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        builtin = BUILTIN_MODELS.get(name)
        if builtin is None or builtin.tokenizer is None:
            known = ", ".join(sorted(n for n, b in BUILTIN_MODELS.items() if b.tokenizer))
            raise ConfigError(f"{setting}: no builtin tokenizer {name!r} (builtin: {known})")
        return bundled_file(builtin.tokenizer)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{setting}: {path} is not a file")
    return p


def content_version(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]
