"""Which request input feeds which model input: decided once, at start-up.

The rules, in order (each refusal is a ``ConfigError`` naming the setting, so
the worker exits 2 before it reads a record):

1. every ``[model.inputs.NAME]`` entry binds its kind to the model inputs it
   names (``feed``, else NAME; a text's ``ids``, ``mask``, ``type_ids``);
2. the classifier shorthand: with no image entry, the one remaining model input
   shaped like an image (one row of rank 3, floating point) is fed by request
   input ``model.input`` through ``[model.preprocess]``, as before inputs had
   kinds (the bundled digits model, and every config written for it);
3. every model input still unclaimed is a tensor of its own name.

A model input fed twice, a feed the model does not have, or a dtype the wire
cannot carry stops start-up. The builtin text model brings its text input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from worker.config import LimitsConfig, ModelConfig
from worker.config.model import ImageInput, InputConfig, TensorInput, TextInput
from worker.config.runtime import BatchingConfig
from worker.contract import DTYPES
from worker.errors import ConfigError
from worker.inputs.base import InputKind
from worker.inputs.batch import ModelInputs
from worker.inputs.image import ImageKind
from worker.inputs.tensor import TensorKind
from worker.inputs.text import TextKind
from worker.model import BUILTIN_MODELS, ModelIO, TensorDesc

Binder = Callable[[str, InputConfig, ModelIO, LimitsConfig, str], InputKind]


def _tensor(name: str, cfg: InputConfig, io: ModelIO, limits: LimitsConfig, at: str) -> InputKind:
    assert isinstance(cfg, TensorInput)
    return TensorKind(name, cfg, _feed(name, cfg.feed, io, at), cfg.max_length)


def _image(name: str, cfg: InputConfig, io: ModelIO, limits: LimitsConfig, at: str) -> InputKind:
    assert isinstance(cfg, ImageInput)
    feed = _feed(name, cfg.feed, io, at)
    return ImageKind(name, cfg, feed, limits.max_image_pixels, setting=at)


def _text(name: str, cfg: InputConfig, io: ModelIO, limits: LimitsConfig, at: str) -> InputKind:
    assert isinstance(cfg, TextInput)
    return TextKind(name, cfg, io, at)


# One line per kind: adding a kind is its module and this line.
KINDS: Final[dict[str, Binder]] = {"tensor": _tensor, "image": _image, "text": _text}


def _feed(name: str, feed: str, io: ModelIO, at: str) -> TensorDesc:
    target = feed or name
    desc = io.input(target)
    if desc is None:
        hint = "" if feed else f'; set feed = "..." to name the one {name!r} feeds'
        raise ConfigError(
            f"{at}{'.feed' if feed else ''}: the model has no input {target!r} (its inputs: "
            f"{', '.join(io.input_names)}){hint}"
        )
    return desc


def _image_shaped(desc: TensorDesc) -> bool:
    return len(desc.shape) == 3 and desc.dtype.kind == "f"


def configured_inputs(model: ModelConfig) -> dict[str, InputConfig]:
    """``[model.inputs]``, or for a builtin text model without any, its text input."""
    if model.inputs or not model.path.startswith("builtin:"):
        return dict(model.inputs)
    name = model.path.removeprefix("builtin:")
    builtin = BUILTIN_MODELS.get(name)
    if builtin is None or builtin.tokenizer is None:
        return {}
    return {"text": TextInput(tokenizer=f"builtin:{name}", max_length=builtin.max_length)}


def bind(
    model: ModelConfig,
    io: ModelIO,
    limits: LimitsConfig,
    batching: BatchingConfig | None = None,
) -> ModelInputs:
    """The request inputs of ``model`` bound to ``io`` (see the module docstring)."""
    kinds: list[InputKind] = []
    fed_by: dict[str, str] = {}

    def claim(kind: InputKind, at: str) -> None:
        if kind.name in {k.name for k in kinds}:
            raise ConfigError(f"{at}: request input {kind.name!r} is defined twice")
        for feed in kind.feeds:
            if feed.name in fed_by:
                raise ConfigError(
                    f"{at}: the model input {feed.name!r} is already fed by request input "
                    f"{fed_by[feed.name]!r}"
                )
            if feed.dtype.name not in DTYPES:
                raise ConfigError(
                    f"{at}: the model input {feed.name!r} is {feed.dtype.name}, which the wire "
                    f"contract cannot carry (supported: {', '.join(sorted(DTYPES))})"
                )
            fed_by[feed.name] = kind.name
        kinds.append(kind)

    entries = configured_inputs(model)
    for name, cfg in entries.items():
        at = f"model.inputs.{name}"
        claim(KINDS[cfg.kind](name, cfg, io, limits, at), at)
    rest = [t for t in io.inputs if t.name not in fed_by]
    images = [t for t in rest if _image_shaped(t)]
    if not any(isinstance(c, ImageInput) for c in entries.values()) and len(images) == 1:
        shorthand = ImageKind(model.input, model.preprocess, images[0], limits.max_image_pixels)
        claim(shorthand, "model.input")
    for desc in io.inputs:
        if desc.name not in fed_by:
            at = f"model.inputs.{desc.name}"
            claim(TensorKind(desc.name, TensorInput(), desc, 0), at)
    if not kinds:
        raise ConfigError("model.path: the model declares no inputs")
    b = batching or BatchingConfig()
    return ModelInputs(kinds, split_by_length=b.split_by_length, length_buckets=b.length_buckets)


def is_classifier(inputs: ModelInputs) -> bool:
    """One request input, an image: softmax / top-k by default (``PostprocessConfig``)."""
    return len(inputs.kinds) == 1 and isinstance(inputs.kinds[0], ImageKind)


def summary(inputs: ModelInputs) -> Mapping[str, str]:
    """For the start-up log: request input -> what it feeds."""
    return {k.name: k.describe() for k in inputs.kinds}
