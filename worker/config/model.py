"""``[model]``: which model runs where, and how its inputs and outputs are treated.

A model's inputs are read from the model file; ``[model.inputs.NAME]`` says how
the request input NAME becomes model inputs, by kind: ``tensor`` (passed through;
padded on free dimensions only where ``pad`` says that is harmless), ``image``
(resized and normalised: the ``[model.preprocess]`` keys), ``text`` (tokenized)
or ``constant`` (``value``: the same every run, not sent by requests). Model
inputs no entry claims are tensors of their own name; ``model.input`` +
``[model.preprocess]`` stay the shorthand for the one image input of a
classifier (see ``worker.model.inputs.binding`` for how the two meet). Defaults come
from the model file, never from the bundled model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from worker.config.checks import check, derive
from worker.config.loading import TomlValue


@dataclass(frozen=True)
class PreprocessConfig:
    """How an image becomes the model input. A key left unset comes from the
    model input it feeds (``worker.model.inputs.image``): its channels, its fixed
    height and width, its layout and dtype; mean and std default to 0.5 per
    channel (pixels scaled to [-1, 1])."""

    size: tuple[int, int] | None = None  # model input (height, width)
    # Channels the model input takes (1 grey, 3 colour); unset = the model input's.
    channels: int | None = None
    scale: float = 1.0 / 255.0  # applied to uint8 before mean/std
    # Per-channel mean subtracted after scaling; unset = 0.5 per channel.
    mean: tuple[float, ...] | None = None
    # Per-channel standard deviation divided by after the mean; unset = 0.5 per channel.
    std: tuple[float, ...] | None = None
    # Channels first (NCHW) or last (NHWC); unset = the model input's.
    layout: Literal["NCHW", "NHWC"] | None = None
    # The model input's float type; unset = the model input's.
    dtype: Literal["float32", "float16"] | None = None
    # Where images are resized and normalised: NumPy on the host, or the CUDA kernels of
    # kernels/ (a GPU backend).
    device: Literal["cpu", "gpu"] = "cpu"

    def __post_init__(self) -> None:
        p = self.where()
        if self.size is not None:
            check(len(self.size) == 2 and min(self.size) >= 1, f"{p}.size",
                  "must be [height, width]")  # fmt: skip
        check(self.channels in (None, 1, 3, 4), f"{p}.channels", "must be 1, 3 or 4")
        for key, values in (("mean", self.mean), ("std", self.std)):
            check(
                values is None or self.channels is None or len(values) in (1, self.channels),
                f"{p}.{key}",
                "needs one value per channel",
            )
        check(self.std is None or all(s > 0 for s in self.std), f"{p}.std", "values must be > 0")
        check(math.isfinite(self.scale) and self.scale > 0, f"{p}.scale", "must be > 0")

    def where(self) -> str:
        """The settings table these keys are read from, for messages."""
        return "model.preprocess"

    @property
    def given(self) -> bool:
        """Whether any key was set (``[model.preprocess]`` asks for the classifier
        shorthand only then)."""
        return self != PreprocessConfig()


@dataclass(frozen=True)
class TensorInput:
    """``kind = "tensor"``: the request carries a tensor of the model input's
    dtype; fixed dimensions must match. Requests are batched together only when
    their free dimensions are equal, unless ``pad`` says padding is harmless for
    this input: then rows are padded with ``pad_value`` to the longest of their
    run, and every output that follows a padded dimension is cut back to each
    request's length (start-up refuses a model whose outputs cannot be)."""

    # What the request input is: "tensor", passed through as sent.
    kind: Literal["tensor"] = "tensor"
    feed: str = ""  # the model input it feeds; "" = the one of the request input's name
    # None: derived (true when pad_value is set, as before padding had to be asked for).
    pad: bool | None = None
    pad_value: float | None = None  # None: 0
    # A free dimension longer than this is answered too_large; 0 = bounded only by
    # limits.max_tensor_bytes (a GPU engine takes its own maximum).
    max_length: int = 0

    def __post_init__(self) -> None:
        check(self.max_length >= 0, "model.inputs.*.max_length", "must be >= 0 (0: no limit)")
        check(
            self.pad_value is None or math.isfinite(self.pad_value),
            "model.inputs.*.pad_value",
            "must be finite",
        )
        if self.pad is None:
            derive(self, "pad", self.pad_value is not None)
        if self.pad_value is None:
            derive(self, "pad_value", 0.0)


@dataclass(frozen=True)
class ConstantInput:
    """``kind = "constant"`` (implied by ``value``): the same value fed to a model
    input every run, never sent by a request: a sample rate, a flag, a threshold.
    The only way to serve an input the whole batch shares (one without a batch
    dimension, such as a scalar); for a batched input, ``value`` is one row,
    repeated for every row of the batch."""

    # "constant": the same value every run, set here, never sent.
    kind: Literal["constant"] = "constant"
    # The constant's value (a number, a list, nested lists).
    value: TomlValue | None = None
    feed: str = ""  # the model input it feeds; "" = the one of its own name

    def __post_init__(self) -> None:
        check(self.value is not None, "model.inputs.*.value", "a constant input needs a value")


@dataclass(frozen=True)
class ImageInput(PreprocessConfig):
    """``kind = "image"``: a uint8 ``[H, W, C]`` tensor or an image file, resized
    and normalised as ``[model.preprocess]`` describes (same keys; what is left
    unset comes from the model input it feeds)."""

    # "image": pixels or an image file, resized and normalised (the keys of
    # [model.preprocess]).
    kind: Literal["image"] = "image"
    feed: str = ""  # the model input it feeds; "" = the one of the request input's name

    def where(self) -> str:
        return "model.inputs.*"


@dataclass(frozen=True)
class TextInput:
    """``kind = "text"``: a UTF-8 string, tokenized per batch (Hugging Face
    ``tokenizers``, one call per batch) into the model inputs ``ids``, ``mask`` and,
    when the model has it, ``type_ids``; padded per batch."""

    # "text": a string, tokenized per batch.
    kind: Literal["text"] = "text"
    # A tokenizer.json file (Hugging Face tokenizers), or builtin:NAME.
    tokenizer: str = ""
    max_length: int = 128  # tokens, special ones included; longer texts are truncated
    # The model input fed the token ids.
    ids: str = "input_ids"
    # The model input fed the attention mask.
    mask: str = "attention_mask"
    type_ids: str = "token_type_ids"  # fed only when the model has this input

    def __post_init__(self) -> None:
        check(bool(self.tokenizer), "model.inputs.*.tokenizer", "a text input needs a tokenizer")
        check(self.max_length >= 1, "model.inputs.*.max_length", "must be >= 1")
        names = [self.ids, self.mask, self.type_ids]
        check(all(names), "model.inputs.*.ids", "ids, mask and type_ids must be named")
        check(len(set(names)) == 3, "model.inputs.*.ids", "ids, mask and type_ids must differ")


InputConfig = TensorInput | ImageInput | TextInput | ConstantInput


@dataclass(frozen=True)
class PostprocessConfig:
    """What is computed from ``model.output`` before it is returned.

    ``softmax`` and ``top_k`` default by model: on (top 3) for a model whose only
    request input is an image (the classifier, as before inputs had kinds), off
    for every other model, which then returns its outputs as computed."""

    softmax: bool | None = None  # None: derived (see above)
    top_k: int | None = None  # 0 disables top-k outputs; None: derived (3 or 0)
    include_raw: bool = False  # also return the engine's raw output tensor
    normalize: bool = False  # L2-normalise model.output along its last axis (embeddings)

    def __post_init__(self) -> None:
        check(self.top_k is None or self.top_k >= 0, "model.postprocess.top_k", "must be >= 0")
        check(
            not (self.normalize and (self.softmax or self.top_k)),
            "model.postprocess.normalize",
            "cannot be combined with softmax or top_k (set them to false / 0)",
        )

    def resolved(self, classifier: bool) -> PostprocessConfig:
        """The settings with derived defaults filled in: ``classifier`` says the
        model's only request input is an image."""
        softmax = (classifier and not self.normalize) if self.softmax is None else self.softmax
        derived_k = 3 if classifier and not self.normalize else 0
        top_k = derived_k if self.top_k is None else self.top_k
        return PostprocessConfig(softmax, top_k, self.include_raw, self.normalize)

    @property
    def active(self) -> bool:
        """Whether ``model.output`` is replaced by computed forms (resolved settings)."""
        return bool(self.softmax or self.top_k)


@dataclass(frozen=True)
class TorchConfig:
    """How the torch backend runs its model (``[model.torch]``).

    Batches are padded up to a bucket (``batching.preferred_batch_sizes``, else
    powers of two up to ``batching.max_batch_size``), and every bucket is run
    (compiled, and captured as a CUDA graph per slot) before the worker joins
    its consumer group, so no request waits on compilation or a new shape.
    """

    # torch.compile mode for exported programs (.pt2); TorchScript files run as
    # they are. "off" runs the module eagerly. CUDA graphs are captured by the
    # engine itself (cuda_graphs), which is why the "reduce-overhead" mode (its
    # own graphs, per thread) is not offered.
    compile: Literal["off", "default", "max-autotune-no-cudagraphs"] = "default"
    # The dtype the model computes in; "auto" = model.preprocess.dtype. bf16 casts
    # the preprocessed input on the device, inside the captured graph.
    precision: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    channels_last: bool = True  # 4-D inputs and weights in NHWC memory order
    # One CUDA graph per (slot, bucket), replayed on the slot's stream. A model
    # that cannot be captured stops start-up (exit 2) naming this key: set false.
    cuda_graphs: bool = True


@dataclass(frozen=True)
class StateConfig:
    """A model input that carries state from one request of a sequence to the
    next (``[model.state.NAME]``; the record key is the sequence): the worker
    feeds it, requests never carry it."""

    output: str = ""  # the model output that carries the next state
    # Where the state's batch dimension is ([layers, batch, hidden]: 1); None:
    # where the model file says (its batch symbol), else 0.
    batch_axis: int | None = None
    initial: float = 0.0  # every element of a new sequence's state

    def __post_init__(self) -> None:
        check(bool(self.output), "model.state.*.output", "names the output carrying the next state")
        check(self.batch_axis is None or self.batch_axis >= 0, "model.state.*.batch_axis",
              "must be >= 0")  # fmt: skip


# The backends the GPU stage serves ("gpu-twin": on its CPU twin, worker.compute.gpu.twin).
GPU_BACKENDS = ("tensorrt", "torch", "gpu-twin")


def is_gpu_backend(backend: str) -> bool:
    return backend in GPU_BACKENDS


@dataclass(frozen=True)
class ModelConfig:
    # Results' model.name and metric labels; "" = derived from path (builtin:NAME
    # gives NAME, a file its stem).
    name: str = ""
    # The model: builtin:digits, builtin:sentiment, an .onnx file, a TensorRT .plan, or for
    # torch a TorchScript file or an exported .pt2 program.
    path: str = "builtin:digits"
    # The input topics this model answers when a worker serves several models ([models.NAME],
    # docs/guides/models.md); () in [model] = every input topic no [models.NAME] or pipeline
    # names, and in the one [models.NAME] of a worker = every input topic.
    topics: tuple[str, ...] = ()
    # The engine: ONNX Runtime on the CPU (the default), TensorRT or torch on a GPU; or
    # "gpu-twin": an ONNX file through the GPU stage's code on the CPU (NumPy for CuPy,
    # ONNX Runtime for the engine), to test a GPU configuration without a device. Never fast.
    backend: Literal["onnxruntime", "tensorrt", "torch", "gpu-twin"] = "onnxruntime"
    # The shorthand for a classifier's one image input: the request input's name
    # (fed to the model's only image-shaped input) and its [model.preprocess].
    # "" = "image", and the shorthand applies only where this or [model.preprocess]
    # is set (or to the bundled digits model): a model input is a tensor unless
    # the configuration says otherwise.
    input: str = ""
    output: str | None = None  # engine output to postprocess; None = the first one
    # The outputs a result carries; () = every model output (postprocessed forms
    # replace model.output when softmax / top_k are on, and then only they come
    # back unless this names others).
    outputs: tuple[str, ...] = ()
    # Where an output's rows are when the model file's declaration of it does not
    # hold (the start-up probe or a run says so): NAME = the axis holding one row
    # per request, or "none" (a model of fixed batch 1 whose output has no batch
    # axis: the whole output is the row). The file's shape for it is then not
    # held against what the engine returns; the rows on that axis still are.
    output_axes: dict[str, str | int | float | bool] = field(default_factory=dict)
    # ONNX Runtime's threads inside one engine run (batches already run side by side,
    # batching.max_inflight_batches).
    intra_op_threads: int = 1
    # The model file has no batch axis at all (a recurrent model of input
    # [seq_len, 576] and state [1, 1, 128]): each engine run is one request,
    # whose inputs are the model's inputs whole. onnxruntime only.
    unbatched: bool = False
    # Request inputs by name, each with its kind (tensor, image, text).
    inputs: dict[str, InputConfig] = field(default_factory=dict)
    # Stateful models: the inputs that carry a sequence's state (docs/guides/stateful.md); a
    # sequence idle this long is dropped, and at most max_sequences are kept (a new one beyond is
    # answered with an error, never by evicting one).
    state: dict[str, StateConfig] = field(default_factory=dict)
    # Stateful models: a sequence idle this long is dropped.
    state_ttl_s: float = 3600.0
    # Stateful models: the most sequences kept; a new one beyond is answered with an error.
    max_sequences: int = 100_000
    # A stateful model's state changelog (compacted; as many partitions as the model's one
    # input topic: docs/guides/stateful.md), where a worker serves several models; a worker of
    # one model may say it here or as kafka.state_topic. "" = states in memory only.
    state_topic: str = ""
    # How often to look for a new version of the model file (its content hash) and swap it in
    # between batches, checked first (docs/guides/rollout.md); 0 = never. CPU path only.
    reload_interval_s: float = 0.0
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    postprocess: PostprocessConfig = field(default_factory=PostprocessConfig)
    torch: TorchConfig = field(default_factory=TorchConfig)

    def __post_init__(self) -> None:
        check(bool(self.path), "model.path", "must not be empty")
        if not self.name:
            derive(self, "name", name_of(self.path))
        check(bool(self.name), "model.name", "must not be empty")
        for name, cfg in [("model.preprocess", self.preprocess)] + [
            (f"model.inputs.{n}", i) for n, i in self.inputs.items() if isinstance(i, ImageInput)
        ]:
            check(
                not (self.backend == "onnxruntime" and cfg.device == "gpu"),
                f"{name}.device",
                "'gpu' needs backend tensorrt, torch or gpu-twin (onnxruntime preprocesses on "
                "the CPU)",
            )
        check(len(set(self.outputs)) == len(self.outputs), "model.outputs", "names repeat")
        for name, axis in self.output_axes.items():
            check(
                axis == "none" or (isinstance(axis, int) and not isinstance(axis, bool)
                                   and axis >= 0),
                f"model.output_axes.{name}", f'{axis!r}: an axis (0, 1, ...) or "none"',
            )  # fmt: skip
        check(self.intra_op_threads >= 0, "model.intra_op_threads", "must be >= 0")
        check(not self.unbatched or self.backend == "onnxruntime", "model.unbatched",
              "onnxruntime only (the GPU engines batch on the first axis)")  # fmt: skip
        clash = sorted(set(self.state) & set(self.inputs))
        check(not clash, "model.state", f"{clash} also in [model.inputs]: a state is fed by the "
              "worker, never by requests")  # fmt: skip
        check(self.state_ttl_s > 0, "model.state_ttl_s", "must be > 0")
        check(self.max_sequences >= 1, "model.max_sequences", "must be >= 1")
        check(self.reload_interval_s >= 0, "model.reload_interval_s", "must be >= 0")


def name_of(path: str) -> str:
    """A model's name when model.name is not set: builtin:NAME gives NAME, a file its stem."""
    stem = path.removeprefix("builtin:").replace("\\", "/").rsplit("/", 1)[-1]
    return stem.rsplit(".", 1)[0] if "." in stem else stem


class BundledModel(ModelConfig):
    """``[model]`` as the defaults left it: neither a ``[model]`` section nor an
    ``INFER_WORKER_MODEL__*`` variable was given. The bundled model is served only
    where the configuration names no model at all (``worker.config.models``); a
    type of its own, so the answer survives copies (``dataclasses.replace``) and
    pickling to the members of ``run --procs N``."""
