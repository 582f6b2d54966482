"""``kind = "image"``: a uint8 ``[H, W, C]`` tensor or an image file, resized and
normalised into the model input (``[model.preprocess]``'s keys, per input).

What the configuration leaves unset comes from the model input it feeds, never
from another model: its layout (channels first or last), its channels, its fixed
height and width, its dtype. Where the model leaves one free (a detector taking
any size), the setting is required and start-up says which.

The checks are the contract's (``worker.contract.images``: header first, pixel
limit before any pixel is decoded); files are decoded on the stage's threads
(``worker.model.decode``) and the batch is preprocessed by the NumPy
reference (``worker.model.preprocess``), or on a GPU by the kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from worker.config.model import PreprocessConfig
from worker.contract import EncodedImage, InputValue, check_image_value
from worker.flow.errors import ConfigError
from worker.model.decode import decode_pending
from worker.model.inputs.base import BoundInput
from worker.model.io import Dim, TensorDesc
from worker.model.preprocess import ImagePreprocess, preprocess_into
from worker.model.rows import Row


class BoundImage(BoundInput):
    kind = "image"

    def __init__(
        self,
        name: str,
        cfg: PreprocessConfig,
        feed: TensorDesc,
        max_pixels: int,
        setting: str = "model.preprocess",
    ) -> None:
        """``setting``: the table ``cfg`` came from, for start-up messages."""
        super().__init__(name, (feed,))
        self.cfg = resolve(cfg, feed, setting)
        self.desc = feed
        self.max_pixels = max_pixels
        self.produced_shape = self.cfg.batch_shape(1)[1:]
        _check_fits(cfg, self.cfg, feed, setting)

    def row_ranks(self) -> tuple[int, ...]:
        return (2, 3) if self.cfg.channels == 1 else (3,)

    def free_symbols(self) -> tuple[str, ...]:
        return ()  # resized to a fixed size: every request's row has the same shape

    def check(self, value: InputValue | np.ndarray) -> np.ndarray | EncodedImage:
        return check_image_value(value, self.field, self.cfg.channels, self.max_pixels)

    def pending(self, answers: Sequence[Row]) -> bool:
        return any(isinstance(a.values.get(self.name), EncodedImage) for a in answers)

    def prepare(self, answers: Sequence[Row]) -> None:
        if self.pending(answers):
            decode_pending(list(answers), self.cfg.channels, self.name)

    def collate(
        self, rows: Sequence[Any], padded: Mapping[str, int], out: dict[str, np.ndarray]
    ) -> None:
        buffer = out.get(self.desc.name)
        if buffer is None:
            buffer = np.empty(self.cfg.batch_shape(len(rows)), dtype=np.dtype(self.cfg.dtype))
        out[self.desc.name] = preprocess_into(rows, self.cfg, buffer)


_CHANNELS = (1, 3, 4)


def resolve(
    cfg: PreprocessConfig, feed: TensorDesc, setting: str = "model.preprocess"
) -> ImagePreprocess:
    """``cfg`` with every unset key taken from the model input ``feed`` (see the
    module docstring); a key the model cannot give is a start-up error naming it."""
    shape = feed.shape
    if len(shape) != 3:
        raise ConfigError(
            f"{setting}: an image feeds a model input of one row [channels, height, width] "
            f"or [height, width, channels]; {feed.name!r} is {feed.shown()} (send it as a "
            "tensor: leave kind out)"
        )
    layout = cfg.layout or _layout(shape)
    c_dim, h_dim, w_dim = shape if layout == "NCHW" else (shape[2], shape[0], shape[1])
    channels = cfg.channels or (c_dim if isinstance(c_dim, int) else None)
    if channels is None:
        raise ConfigError(
            f"{setting}.channels: the model input {feed.name!r} ({feed.shown()}, {layout}) does "
            "not fix its channels; set channels (1, 3 or 4)"
        )
    size = cfg.size
    if size is None:
        if not isinstance(h_dim, int) or not isinstance(w_dim, int):
            raise ConfigError(
                f"{setting}.size: the model input {feed.name!r} ({feed.shown()}) takes images "
                "of any height and width; set size = [height, width] to resize them to"
            )
        size = (h_dim, w_dim)
    dtype = cfg.dtype or feed.dtype.name
    if dtype not in ("float32", "float16"):
        raise ConfigError(
            f"{setting}: an image is normalised into a float32 or float16 model input; "
            f"{feed.name!r} is {feed.shown()} (send its values as a tensor: leave kind out)"
        )
    return ImagePreprocess(
        size=size,
        channels=channels,
        scale=cfg.scale,
        mean=_per_channel(cfg.mean, channels, f"{setting}.mean"),
        std=_per_channel(cfg.std, channels, f"{setting}.std"),
        layout=layout,
        dtype=dtype,  # type: ignore[arg-type]
        device=cfg.device,
    )


def resolve_declared(cfg: PreprocessConfig, why: str,
                     setting: str = "model.preprocess") -> ImagePreprocess:  # fmt: skip
    """``cfg`` where no model input declares the image's shape (a TorchScript file,
    a model yet to be exported): ``size`` and ``channels`` must be set, ``why``
    says what lacks them."""
    missing = [k for k in ("size", "channels") if getattr(cfg, k) is None]
    if missing:
        raise ConfigError(f"{setting}.{missing[0]}: {why}; set {' and '.join(missing)}")
    assert cfg.size is not None and cfg.channels is not None
    h, w = cfg.size
    shape = (cfg.channels, h, w) if (cfg.layout or "NCHW") == "NCHW" else (h, w, cfg.channels)
    return resolve(cfg, TensorDesc("input", np.dtype(cfg.dtype or "float32"), shape), setting)


def _layout(shape: tuple[Dim, ...]) -> Literal["NCHW", "NHWC"]:
    """Channels first unless only the last dimension can be channels."""
    first, last = shape[0], shape[2]
    if last in _CHANNELS and first not in _CHANNELS:
        return "NHWC"
    return "NCHW"


def _per_channel(
    values: tuple[float, ...] | None, channels: int, setting: str
) -> tuple[float, ...]:
    if values is None:
        return (0.5,) * channels
    if len(values) == 1:
        return values * channels
    if len(values) != channels:
        raise ConfigError(f"{setting}: needs one value per channel ({channels}), got {len(values)}")
    return values


def _check_fits(given: PreprocessConfig, cfg: ImagePreprocess, feed: TensorDesc,
                setting: str) -> None:  # fmt: skip
    """Refuse to start when preprocessing cannot produce what the model takes
    (every request would otherwise fail at run time, after retries), naming the
    keys the configuration set (``given``): only they can disagree with the model."""
    produced = cfg.batch_shape(1)[1:]
    declared = feed.shape
    fits = len(declared) == len(produced) and all(
        not isinstance(d, int) or d == p for d, p in zip(declared, produced, strict=True)
    )
    if not fits:
        shown = ["?" if not isinstance(d, int) else d for d in declared]
        keys = [k for k in ("size", "channels", "layout") if getattr(given, k) is not None]
        named = " / ".join(f"{setting}.{k}" for k in keys) or setting
        raise ConfigError(
            f"{named}: the model's input {feed.name!r} takes "
            f"[batch, {', '.join(map(str, shown))}] but {setting} "
            f"(size {list(cfg.size)}, channels {cfg.channels}, layout {cfg.layout}) "
            f"produces [batch, {', '.join(map(str, produced))}]"
        )
    if np.dtype(cfg.dtype) != feed.dtype:
        raise ConfigError(
            f"{setting}.dtype: the model's input {feed.name!r} is {feed.dtype.name} but "
            f'{setting} produces {cfg.dtype}: set {setting}.dtype = "{feed.dtype.name}" '
            f"(the torch backend computes in model.torch.precision, casting on the device)"
        )
