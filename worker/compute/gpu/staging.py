"""The GPU stage's staging budget and JPEG routing: pure, so unit-tested without a GPU.

A slot's packed image staging holds ``gpu.max_input_bytes`` of the device
image's uint8 pixels: a batch whose images exceed it runs in several chunks, and
one image larger than it is answered ``too_large``. A JPEG that nvJPEG decodes
is counted by its decoded size, read from its header before it is decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from worker.compute.gpu import nvjpeg
from worker.compute.gpu.slots import DeviceImage
from worker.contract import EncodedImage, ErrorInfo
from worker.flow.codes import ErrorCode
from worker.model.decode import decode_pending
from worker.model.inputs.base import BoundInput
from worker.model.inputs.image import BoundImage
from worker.model.rows import Row

OnDevice = Mapping[int, DeviceImage]
"""The answers (by ``id``) whose JPEG nvJPEG decodes, with its image."""


def no_bytes(answer: Row) -> int:
    """The staging a batch without a device image takes per answer."""
    return 0


def staged_bytes(answer: Row, on_device: OnDevice, name: str = "image") -> int:
    """Bytes the answer's image (request input ``name``) takes in the packed
    staging: a JPEG for nvJPEG by the size its header gives, before it is decoded."""
    image = on_device.get(id(answer))
    if image is not None:
        return image.nbytes
    pixels = answer.values[name]
    assert isinstance(pixels, np.ndarray)
    return int(pixels.nbytes)


def reject_oversized(
    answers: list[Row], size: Callable[[Row], int], limit: int | None
) -> list[Row]:
    """Row ``too_large`` each image that alone exceeds the slot's staging."""
    if limit is None:
        return answers
    kept = []
    for answer in answers:
        nbytes = size(answer)
        if nbytes > limit:
            answer.error = ErrorInfo(
                ErrorCode.TOO_LARGE,
                f"image of {nbytes} bytes exceeds gpu.max_input_bytes {limit}",
            )
        else:
            kept.append(answer)
    return kept


def split_chunks(
    answers: Sequence[Row], size: Callable[[Row], int], max_rows: int, limit: int | None
) -> list[list[Row]]:
    """Consecutive chunks of at most ``max_rows`` answers and ``limit`` staged bytes."""
    chunks: list[list[Row]] = []
    current: list[Row] = []
    used = 0
    for answer in answers:
        nbytes = size(answer)
        full = len(current) == max_rows or (limit is not None and used + nbytes > limit)
        if current and full:
            chunks.append(current)
            current, used = [], 0
        current.append(answer)
        used += nbytes
    if current:
        chunks.append(current)
    return chunks


def route_encoded(
    answers: list[Row], channels: int, use_nvjpeg: bool, name: str = "image"
) -> tuple[list[Row], dict[int, DeviceImage]]:
    """Split the answers whose image (request input ``name``) is a file: those for
    the host decoder, and the JPEGs nvJPEG takes (by ``id``, with their header's
    size)."""
    to_host: list[Row] = []
    on_device: dict[int, DeviceImage] = {}
    for answer in answers:
        encoded = answer.values.get(name)
        if not isinstance(encoded, EncodedImage):
            continue
        image = nvjpeg.device_image(encoded, channels) if use_nvjpeg else None
        if image is None:
            to_host.append(answer)
        else:
            on_device[id(answer)] = image
    return to_host, on_device


def needs_host_work(
    answers: list[Row], host: Sequence[BoundInput], image: BoundImage | None
) -> bool:
    """Whether a batch has host work before it can be staged."""
    if image is not None and image.pending(answers):
        return True
    return any(k.pending(answers) for k in host)


def prepare_on_host(
    answers: list[Row], host: Sequence[BoundInput], image: BoundImage | None, use_nvjpeg: bool
) -> tuple[list[Row], dict[int, DeviceImage]]:
    """On a stage thread: the host inputs' batch work (tokenize, decode files of
    images preprocessed on the CPU) and the device image's files nvJPEG does not
    take; returns the answers that can run and the JPEGs left for nvJPEG."""
    for kind in host:
        if kind.pending(answers):
            kind.prepare(answers)
            answers = [a for a in answers if a.error is None]
    on_device: dict[int, DeviceImage] = {}
    if image is not None and image.pending(answers):
        channels = image.cfg.channels
        to_host, on_device = route_encoded(answers, channels, use_nvjpeg, image.name)
        if to_host:
            decode_pending(to_host, channels, image.name)  # failures: answered
    return [a for a in answers if a.error is None], on_device
