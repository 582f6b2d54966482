"""Which request input feeds which model input, and on which dimensions a batch
may pad: decided once, at start-up.

The rules, in order (each refusal is a ``ConfigError`` naming the setting to
write, so the worker exits 2 before it reads a record):

1. every ``[model.inputs.NAME]`` entry binds its kind to the model inputs it
   names (``feed``, else NAME; a text's ``ids``, ``mask``, ``type_ids``); a
   ``constant`` is fed by the worker, never by requests, and so is each
   ``[model.state.NAME]`` (a sequence's state, ``worker.model.inputs.state``);
2. the classifier shorthand: where ``[model.preprocess]`` or ``model.input`` is
   set (or for the bundled digits model) and no entry is an image, the one
   remaining model input shaped like an image (one row of rank 3, floating
   point) is fed by request input ``model.input`` through ``[model.preprocess]``;
3. every model input still unclaimed is a tensor of its own name (a model
   input is a tensor unless the configuration says otherwise); one without a
   batch dimension (the whole batch shares it) needs ``value``.

Padding: rows of different lengths share an engine run only on a dimension
every input carrying it may pad (a text: the attention mask is fed; a tensor
marked ``pad``), and only when every output a result carries can be cut back
to each request's length on it: each of the output's free dimensions carries
an input's symbol. An output dimension an exporter names afresh (``unk__12``,
``p2o.DynamicDimension.3``) or writes as an expression ties to nothing, so
nothing is cut by guess: a tensor marked ``pad`` is refused at start-up (naming
the input and the output), and a text falls back to runs of equal lengths.
Every other free dimension groups rows by its exact length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import structlog

from worker.config import LimitsConfig, ModelConfig
from worker.config.model import (
    ConstantInput,
    ImageInput,
    InputConfig,
    StateConfig,
    TensorInput,
    TextInput,
)
from worker.config.runtime import BatchingConfig
from worker.contract import DTYPES
from worker.flow.errors import ConfigError
from worker.model.files import BUILTIN_MODELS
from worker.model.inputs.base import BoundInput
from worker.model.inputs.batch import ModelInputs
from worker.model.inputs.constant import BoundConstant
from worker.model.inputs.image import BoundImage
from worker.model.inputs.state import BoundState
from worker.model.inputs.tensor import BoundTensor
from worker.model.inputs.text import BoundText
from worker.model.io import ModelIO, TensorDesc
from worker.model.outputs import OutputPlan, select_outputs

log = structlog.get_logger(__name__)

Binder = Callable[[str, InputConfig, ModelIO, LimitsConfig, str], BoundInput]


def _tensor(name: str, cfg: InputConfig, io: ModelIO, limits: LimitsConfig, at: str) -> BoundInput:
    assert isinstance(cfg, TensorInput)
    feed = _feed(name, cfg.feed, io, at)
    _needs_batch(feed, at)
    return BoundTensor(name, cfg, feed, cfg.max_length)


def _image(name: str, cfg: InputConfig, io: ModelIO, limits: LimitsConfig, at: str) -> BoundInput:
    assert isinstance(cfg, ImageInput)
    feed = _feed(name, cfg.feed, io, at)
    _needs_batch(feed, at, first=True)
    return BoundImage(name, cfg, feed, limits.max_image_pixels, setting=at)


def _text(name: str, cfg: InputConfig, io: ModelIO, limits: LimitsConfig, at: str) -> BoundInput:
    assert isinstance(cfg, TextInput)
    kind = BoundText(name, cfg, io, at)
    for feed in kind.feeds:
        _needs_batch(feed, at, first=True)
    return kind


def _constant(
    name: str, cfg: InputConfig, io: ModelIO, limits: LimitsConfig, at: str
) -> BoundInput:
    assert isinstance(cfg, ConstantInput)
    return BoundConstant(name, cfg, _feed(name, cfg.feed, io, at), at)


# One line per kind: adding a kind is its module and this line.
KINDS: Final[dict[str, Binder]] = {
    "tensor": _tensor,
    "image": _image,
    "text": _text,
    "constant": _constant,
}


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


def _needs_batch(desc: TensorDesc, at: str, first: bool = False) -> None:
    """A request's row needs a batch dimension to join (the first, for images
    and texts, which the stages lay out row by row)."""
    if desc.batch_axis is None:
        raise ConfigError(
            f"{at}.value: the model input {desc.name!r} ({desc.shown()}) has no batch "
            "dimension: the whole batch shares it, so requests cannot carry it; set "
            "value = ... to feed it the same value every run"
        )
    if first and desc.batch_axis != 0:
        raise ConfigError(
            f"{at}: the model input {desc.name!r} ({desc.shown()}) has its batch dimension "
            f"at axis {desc.batch_axis}; this kind feeds inputs batched on their first axis"
        )


def _image_shaped(desc: TensorDesc) -> bool:
    return len(desc.shape) == 3 and desc.dtype.kind == "f" and desc.batch_axis == 0


def configured_inputs(model: ModelConfig) -> dict[str, InputConfig]:
    """``[model.inputs]``, or for a builtin text model without any, its text input."""
    if model.inputs or not model.path.startswith("builtin:"):
        return dict(model.inputs)
    name = model.path.removeprefix("builtin:")
    builtin = BUILTIN_MODELS.get(name)
    if builtin is None or builtin.tokenizer is None:
        return {}
    return {"text": TextInput(tokenizer=f"builtin:{name}", max_length=builtin.max_length)}


def configured_states(model: ModelConfig) -> dict[str, StateConfig]:
    """``[model.state]``, or for a builtin stateful model without any, its own."""
    if model.state or not model.path.startswith("builtin:"):
        return dict(model.state)
    builtin = BUILTIN_MODELS.get(model.path.removeprefix("builtin:"))
    states = builtin.states if builtin is not None else ()
    return {name: StateConfig(output=out, initial=initial) for name, out, initial in states}


def _wants_shorthand(model: ModelConfig) -> bool:
    """The classifier shorthand applies where the configuration asks for it (or
    for the bundled digits model, which brings its image input as the text model
    brings its text): never by default for a user's model."""
    return model.preprocess.given or bool(model.input) or model.path == "builtin:digits"


def bind(
    model: ModelConfig,
    io: ModelIO,
    limits: LimitsConfig,
    batching: BatchingConfig | None = None,
) -> ModelInputs:
    """The request inputs of ``model`` bound to ``io`` (see the module docstring)."""
    kinds: list[BoundInput] = []
    constants: list[BoundInput] = []
    fed_by: dict[str, str] = {}

    def claim(kind: BoundInput, at: str) -> None:
        if kind.name in {k.name for k in (*kinds, *constants)}:
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
        worker_fed = isinstance(kind, BoundConstant | BoundState)
        (constants if worker_fed else kinds).append(kind)

    entries = configured_inputs(model)
    for name, cfg in entries.items():
        at = f"model.inputs.{name}"
        claim(KINDS[cfg.kind](name, cfg, io, limits, at), at)
    for name, state in configured_states(model).items():
        claim(BoundState(name, state, io), f"model.state.{name}")
    if not any(isinstance(c, ImageInput) for c in entries.values()) and _wants_shorthand(model):
        images = [t for t in io.inputs if t.name not in fed_by and _image_shaped(t)]
        if len(images) == 1:
            shorthand = BoundImage(
                model.input or "image", model.preprocess, images[0], limits.max_image_pixels
            )
            claim(shorthand, "model.input")
        else:
            log.warning(
                "image_shorthand_unused",
                reason=f"the model has {len(images)} image-shaped inputs, the shorthand feeds one",
                fix='name each image input in [model.inputs.NAME] with kind = "image"',
            )
    for desc in io.inputs:
        if desc.name not in fed_by:
            at = f"model.inputs.{desc.name}"
            _needs_batch(desc, at)
            claim(BoundTensor(desc.name, TensorInput(), desc, 0), at)
    if not kinds:
        raise ConfigError("model.path: the model declares no inputs a request can carry")
    b = batching or BatchingConfig()
    candidate = ModelInputs(kinds, constants=constants)
    post = model.postprocess.resolved(is_classifier(candidate))
    selection = select_outputs(io, model.output, model.outputs, post.active)
    returned = [d for d in io.outputs if d.name in selection.returned]
    return ModelInputs(
        kinds,
        constants=constants,
        padded=_padded(candidate, returned),
        split_by_length=b.split_by_length,
        length_buckets=b.length_buckets,
        batch=io.batch,
    )


@dataclass(frozen=True)
class Binding:
    """What a stage runs a batch against, decided once at start-up: the request
    inputs bound to the model's, and the plan of the outputs a result carries."""

    inputs: ModelInputs
    outputs: OutputPlan
    # The model's inputs and outputs as bound: the file's, with the batch axes
    # the configuration gives where the file leaves them unnamed.
    io: ModelIO
    # A stateful model's bounds (model.state_ttl_s, model.max_sequences).
    state_ttl_s: float = 3600.0
    max_sequences: int = 100_000


def bind_model(
    model: ModelConfig,
    io: ModelIO,
    limits: LimitsConfig,
    batching: BatchingConfig | None = None,
) -> Binding:
    """``bind`` and the output plan that goes with it (the one place both are made),
    over ``io`` with each state's configured batch axis (``ModelIO.rebatched``)
    on the state and on the output that carries its next value."""
    axes: dict[str, tuple[int, str]] = {}
    for name, state in model.state.items():
        if state.batch_axis is not None:
            setting = f"model.state.{name}.batch_axis"
            axes[name] = axes[state.output] = (state.batch_axis, setting)
    io = io.rebatched(axes)
    inputs = bind(model, io, limits, batching)
    post = model.postprocess.resolved(is_classifier(inputs))
    plan = OutputPlan(io, model, post, inputs.padded_symbols)
    return Binding(inputs, plan, io, model.state_ttl_s, model.max_sequences)


def _padded(inputs: ModelInputs, returned: list[TensorDesc]) -> frozenset[str]:
    """The free dimensions rows may be padded on (see the module docstring)."""
    for symbol, names in inputs.symbols.items():
        asked = [n for n in names if isinstance(inputs.by_name[n], BoundTensor)
                 and inputs.by_name[n].pads]  # fmt: skip
        others = [n for n in names if not inputs.by_name[n].pads]
        if asked and others:
            raise ConfigError(
                f"model.inputs.{asked[0]}.pad: the dimension {symbol!r} is shared with "
                f"inputs.{others[0]}, which is not padded; set pad = true there too (with its "
                "pad_value), or leave pad off"
            )
    candidates = inputs.pad_candidates()
    if not candidates:
        return candidates
    known = inputs.symbols.keys()
    untied = [
        (desc, desc.symbol(axis))
        for desc in returned
        for axis in desc.free_axes
        if desc.symbol(axis) not in known
    ]
    if not untied:
        return candidates
    desc, symbol = untied[0]
    for padded in sorted(candidates):
        for name in inputs.symbols[padded]:
            kind = inputs.by_name[name]
            if isinstance(kind, BoundTensor):
                raise ConfigError(
                    f"model.inputs.{name}.pad: the output {desc.name!r} ({desc.shown()}) has a "
                    f"dimension {symbol!r} that no input's dimension names, so a run padded on "
                    f"{padded!r} could not be cut back to each request's length; leave pad off "
                    "(requests of equal lengths then share runs) or leave the output out "
                    "(model.outputs)"
                )
    log.warning(
        "padding_off",
        dimensions=sorted(candidates),
        output=desc.name,
        shape=desc.shown(),
        reason=f"dimension {symbol!r} of the output ties to no input: a padded run could not "
        "be cut back to each request's length",
        effect="rows run together only at equal lengths",
        fix="leave the output out (model.outputs) to pad again",
    )
    return frozenset()


# What a request's envelope adds to its tensors (keys, dtype and shape fields, id).
_ENVELOPE_BYTES: Final = 64 * 1024


def fit_limits(limits: LimitsConfig, inputs: ModelInputs) -> LimitsConfig:
    """``limits`` raised where one row of a fixed-shape model input would exceed
    them: a limit below what the model takes would answer every request
    ``too_large`` (a layout detector's float32 [3, 800, 608] is 5.8 MB, past the
    4 MiB default). Logged, so the operator sees the limit that applies."""
    row = max(
        (
            f.row_elements * f.dtype.itemsize
            for k in inputs.kinds
            if isinstance(k, BoundTensor)
            for f in k.feeds
            if f.fixed
        ),
        default=0,
    )
    if row <= limits.max_tensor_bytes:
        return limits
    record = max(limits.max_record_bytes, row + _ENVELOPE_BYTES)
    log.info(
        "limits_raised_for_the_model",
        max_tensor_bytes=row,
        max_record_bytes=record,
        reason="one row of the model's input is larger than the configured limits",
    )
    return dataclasses.replace(limits, max_tensor_bytes=row, max_record_bytes=record)


def is_classifier(inputs: ModelInputs) -> bool:
    """One request input, an image: softmax / top-k by default (``PostprocessConfig``)."""
    return len(inputs.kinds) == 1 and isinstance(inputs.kinds[0], BoundImage)


def summary(inputs: ModelInputs) -> Mapping[str, str]:
    """For the start-up log: request input -> what it feeds, and how rows batch."""
    described = {k.name: k.describe() for k in (*inputs.kinds, *inputs.constants)}
    if inputs.symbols:
        described["(batching)"] = ", ".join(
            f"{s}: {'padded' if s in inputs.padded_symbols else 'equal lengths'}"
            for s in inputs.symbols
        )
    if inputs.batch is not None:
        described["(fixed batch)"] = f"runs of {inputs.batch} rows"
    return described
