"""What the GPU stage does around the engine, decided once at start-up.

Pure functions of the engine's tensors, the model's bound inputs and the config:
which image input (at most one) is preprocessed on the device by the kernels,
and which inputs are collated on the host and copied in; every shape the slots
run (batch buckets x length buckets of each padded dimension: ``SlotShapes``);
and where postprocessing runs (the kernels on device when they compute exactly
what ``worker.model.postprocess`` does on an output of fixed shape, else the
raw output comes back and the NumPy reference runs on the host).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from worker.compute.engines.base import GpuEngine
from worker.compute.gpu import nvjpeg
from worker.config import GpuConfig, PostprocessConfig
from worker.flow.errors import ConfigError
from worker.model.inputs import ModelInputs
from worker.model.inputs.base import BoundInput
from worker.model.inputs.image import BoundImage
from worker.model.io import TensorDesc
from worker.model.outputs import OutputPlan
from worker.model.shapes import SlotShapes, bucket_sizes, slot_buckets


@dataclass(frozen=True)
class PostprocessPlan:
    """What the device does after the engine, fixed at start-up."""

    raw: TensorDesc  # the engine output that is postprocessed
    topk: int  # columns of the top-k results (0: none)
    gpu_softmax_rows: bool  # probabilities computed on device
    host_postprocess: bool  # raw output comes back and the host reference runs on it
    copy_back: tuple[str, ...]
    post: PostprocessConfig  # the resolved settings

    @property
    def result_shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: t.fixed_shape for t in self.result_specs}

    @property
    def forms(self) -> tuple[str, ...]:
        """What comes back computed on the device (the raw output too with
        ``include_raw``); empty when postprocessing runs on the host."""
        if self.host_postprocess:
            return ()
        names = [self.raw.name] if self.post.include_raw else []
        return (*names, *(t.name for t in self.result_specs))

    @property
    def result_specs(self) -> tuple[TensorDesc, ...]:
        """Device buffers the postprocess kernels write (beside the engine's own)."""
        if self.topk:
            return (
                TensorDesc("topk_indices", np.dtype(np.int64), (self.topk,)),
                TensorDesc("topk_scores", np.dtype(np.float32), (self.topk,)),
            )
        if self.gpu_softmax_rows:
            return (TensorDesc("probabilities", np.dtype(np.float32), self.raw.shape),)
        return ()


def postprocess_plan(engine: GpuEngine, outputs: OutputPlan) -> PostprocessPlan:
    """Decide where postprocessing runs (see the module docstring) for the
    outputs a result carries (``OutputPlan``: its raw output, resolved settings,
    the outputs passed as computed, and those cut back per request on the host,
    which are postprocessed there too)."""
    pp = outputs.post
    raw_name = outputs.raw_name
    passed = outputs.passed
    varying = frozenset(outputs.cuts)
    specs = {t.name: t for t in engine.outputs}
    if raw_name not in specs:
        raise ConfigError(f"model.output: {raw_name!r} not in engine outputs {list(specs)}")
    raw = specs[raw_name]
    assert pp.top_k is not None and pp.softmax is not None
    # The kernels reduce over a whole row; the reference's softmax runs over the
    # last axis. They agree when the row is one softmax segment.
    kernel_fits = (
        raw.dtype in (np.float32, np.float16)
        and raw_name not in varying
        and (math.prod(raw.fixed_shape[:-1]) == 1 or not pp.softmax)
    )
    wants_device_work = pp.top_k > 0 or pp.softmax
    if not wants_device_work:
        back = passed or tuple(t.name for t in engine.outputs)
        return PostprocessPlan(raw, 0, False, True, tuple(dict.fromkeys(back)), pp)
    if not kernel_fits:
        back = (raw_name, *passed)
        return PostprocessPlan(raw, 0, False, True, tuple(dict.fromkeys(back)), pp)
    names: list[str] = [raw_name] if pp.include_raw else []
    topk = min(pp.top_k, raw.row_elements) if pp.top_k > 0 else 0
    if topk:
        names += ["topk_indices", "topk_scores"]
    softmax_rows = not topk and pp.softmax
    if softmax_rows:
        names.append("probabilities")
    return PostprocessPlan(
        raw, topk, softmax_rows, False, tuple(dict.fromkeys((*names, *passed))), pp
    )


def check_gpu_inputs(inputs: ModelInputs, gpu: GpuConfig, slots: int) -> BoundImage | None:
    """What the GPU stage can serve, checked at start-up (a refusal names the
    setting); returns the image input the kernels preprocess, if any. Inputs
    without a batch dimension, or batched on another axis, have never run on a
    GPU: refused there, not guessed (the CPU path serves them)."""
    if slots < 1:
        raise ConfigError("gpu.num_slots: must be >= 1")
    if inputs.states:
        raise ConfigError(
            f"model.state.{inputs.states[0].name}: stateful models run on the CPU path in this "
            "version (backend onnxruntime); the GPU stage keeps no sequence states"
        )
    for kind in (*inputs.kinds, *inputs.constants):
        for feed in kind.feeds:
            if feed.batch_axis != 0:
                where = ("no batch dimension" if feed.batch_axis is None
                         else f"its batch dimension at axis {feed.batch_axis}")  # fmt: skip
                raise ConfigError(
                    f"model.inputs.{kind.name}: the model input {feed.name!r} has {where}; the "
                    "GPU stage serves inputs batched on their first axis (use backend "
                    "onnxruntime for this model)"
                )
    image = device_image(inputs)
    if gpu.decode == "nvjpeg" and image is None:
        raise ConfigError(
            "gpu.decode: 'nvjpeg' decodes into the image input the kernels preprocess; "
            "set device = 'gpu' on it ([model.preprocess] or [model.inputs.NAME])"
        )
    if image is not None:
        nvjpeg.check_config(gpu.decode, image.cfg)
    return image


def device_image(inputs: ModelInputs) -> BoundImage | None:
    """The image input the kernels preprocess on the device (``device = "gpu"``):
    at most one (one packed staging buffer per slot)."""
    on_device = [k for k in inputs.kinds if isinstance(k, BoundImage) and k.cfg.device == "gpu"]
    if len(on_device) > 1:
        names = ", ".join(k.name for k in on_device)
        raise ConfigError(
            f"model.inputs: {names} all preprocess on the GPU; one image input can "
            '(set device = "cpu" for the others)'
        )
    return on_device[0] if on_device else None


def host_kinds(inputs: ModelInputs, on_device: BoundImage | None) -> tuple[BoundInput, ...]:
    """The inputs collated on the host into the slot's pinned twins."""
    return tuple(k for k in inputs.kinds if k is not on_device)


def slot_shapes(
    inputs: ModelInputs,
    max_batch_size: int,
    preferred: tuple[int, ...] = (),
    length_buckets: tuple[int, ...] = (),
    min_batch_size: int = 1,
) -> SlotShapes:
    """Every shape the slots run: batch buckets (``worker.model.shapes``) x,
    per padded dimension, its length buckets up to the input's bound
    (``batching.length_buckets`` below it, else powers of two) and the bound
    itself. A padded dimension without a bound cannot have buffers: refused."""
    lengths: list[tuple[str, tuple[int, ...]]] = []
    bounds = inputs.max_lengths()
    for symbol in inputs.symbols:
        bound = bounds.get(symbol, 0)
        if bound <= 0:
            names = ", ".join(inputs.symbols[symbol])
            raise ConfigError(
                f"model.inputs.{inputs.symbols[symbol][0]}.max_length: the GPU sizes its "
                f"buffers for the longest {symbol!r} ({names}); set a bound"
            )
        lengths.append((symbol, length_buckets_to(bound, length_buckets)))
    rows = max(max_batch_size, min_batch_size)
    return SlotShapes(slot_buckets(bucket_sizes(rows, preferred), rows, min_batch_size),
                      tuple(lengths))  # fmt: skip


def length_buckets_to(bound: int, configured: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Ascending lengths up to ``bound`` (included): the configured ones below it,
    else the powers of two."""
    below = (
        [b for b in configured if b < bound]
        if configured
        else [1 << i for i in range(bound.bit_length()) if 1 << i < bound]
    )
    return (*below, bound)
