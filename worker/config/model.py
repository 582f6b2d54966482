"""``[model]``: which model runs where, and how its inputs and outputs are treated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from worker.config.checks import check


@dataclass(frozen=True)
class PreprocessConfig:
    size: tuple[int, int] = (8, 8)  # model input (height, width)
    channels: int = 1
    scale: float = 1.0 / 255.0  # applied to uint8 before mean/std
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    dtype: Literal["float32", "float16"] = "float32"
    device: Literal["cpu", "gpu"] = "cpu"

    def __post_init__(self) -> None:
        p = "model.preprocess"
        check(len(self.size) == 2 and min(self.size) >= 1, f"{p}.size", "must be [height, width]")
        check(self.channels in (1, 3, 4), f"{p}.channels", "must be 1, 3 or 4")
        check(len(self.mean) == self.channels, f"{p}.mean", "needs one value per channel")
        check(len(self.std) == self.channels, f"{p}.std", "needs one value per channel")
        check(all(s > 0 for s in self.std), f"{p}.std", "values must be > 0")
        check(math.isfinite(self.scale) and self.scale > 0, f"{p}.scale", "must be > 0")


@dataclass(frozen=True)
class PostprocessConfig:
    softmax: bool = True
    top_k: int = 3  # 0 disables top-k outputs
    include_raw: bool = False  # also return the engine's raw output tensor

    def __post_init__(self) -> None:
        check(self.top_k >= 0, "model.postprocess.top_k", "must be >= 0")


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
class ModelConfig:
    name: str = "digits"
    path: str = "builtin:digits"
    backend: Literal["onnxruntime", "tensorrt", "torch"] = "onnxruntime"
    input: str = "image"  # the request input fed to the model
    output: str | None = None  # engine output to postprocess; None = the first one
    intra_op_threads: int = 1
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    postprocess: PostprocessConfig = field(default_factory=PostprocessConfig)
    torch: TorchConfig = field(default_factory=TorchConfig)

    def __post_init__(self) -> None:
        check(bool(self.name), "model.name", "must not be empty")
        check(
            not (self.backend == "onnxruntime" and self.preprocess.device == "gpu"),
            "model.preprocess.device",
            "'gpu' needs backend tensorrt or torch (onnxruntime preprocesses on the CPU)",
        )
        check(bool(self.path), "model.path", "must not be empty")
        check(self.intra_op_threads >= 0, "model.intra_op_threads", "must be >= 0")
