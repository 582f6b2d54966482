"""``kind = "image"``: a uint8 ``[H, W, C]`` tensor or an image file, resized and
normalised into the model input (``[model.preprocess]``'s keys, per input).

The checks are the contract's (``worker.contract.images``: header first, pixel
limit before any pixel is decoded); files are decoded on the stage's threads
(``worker.inference.decode``) and the batch is preprocessed by the NumPy
reference (``worker.inference.preprocess``), or on a GPU by the kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worker.config.model import PreprocessConfig
from worker.contract import EncodedImage, InputValue, check_image_value
from worker.errors import ConfigError
from worker.inference.decode import decode_pending
from worker.inference.preprocess import batch_shape, preprocess_into
from worker.inputs.base import InputKind
from worker.model import TensorDesc
from worker.records import Answer


class ImageKind(InputKind):
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
        self.cfg = cfg
        self.desc = feed
        self.max_pixels = max_pixels
        self.produced_shape = batch_shape(cfg, 1)[1:]
        _check_fits(cfg, feed, setting)

    def row_ranks(self) -> tuple[int, ...]:
        return (2, 3) if self.cfg.channels == 1 else (3,)

    def padded_symbols(self) -> tuple[str, ...]:
        return ()  # resized to a fixed size: nothing is padded

    def check(self, value: InputValue) -> np.ndarray | EncodedImage:
        return check_image_value(value, self.field, self.cfg.channels, self.max_pixels)

    def pending(self, answers: Sequence[Answer]) -> bool:
        return any(isinstance(a.job.inputs.get(self.name), EncodedImage) for a in answers)

    def prepare(self, answers: Sequence[Answer]) -> None:
        if self.pending(answers):
            decode_pending(list(answers), self.cfg.channels, self.name)

    def collate(
        self, rows: Sequence[Any], padded: Mapping[str, int], out: dict[str, np.ndarray]
    ) -> None:
        buffer = out.get(self.desc.name)
        if buffer is None:
            buffer = np.empty(batch_shape(self.cfg, len(rows)), dtype=np.dtype(self.cfg.dtype))
        out[self.desc.name] = preprocess_into(rows, self.cfg, buffer)


def _check_fits(cfg: PreprocessConfig, feed: TensorDesc, setting: str) -> None:
    """Refuse to start when preprocessing cannot produce what the model takes
    (every request would otherwise fail at run time, after retries)."""
    produced = batch_shape(cfg, 1)[1:]
    declared = feed.shape
    fits = len(declared) == len(produced) and all(
        not isinstance(d, int) or d == p for d, p in zip(declared, produced, strict=True)
    )
    if not fits:
        shown = ["?" if not isinstance(d, int) else d for d in declared]
        raise ConfigError(
            f"{setting}.size: the model's input {feed.name!r} takes "
            f"[batch, {', '.join(map(str, shown))}] ({cfg.layout}) but {setting} "
            f"(size {list(cfg.size)}, channels {cfg.channels}, layout {cfg.layout}) produces "
            f"[batch, {', '.join(map(str, produced))}]"
        )
    if np.dtype(cfg.dtype) != feed.dtype:
        raise ConfigError(
            f"{setting}.dtype: the model's input {feed.name!r} is {feed.dtype.name} but "
            f"{setting} produces {cfg.dtype}"
        )
