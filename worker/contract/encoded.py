"""Encoded images on the wire: an input may be a msgpack bin holding a JPEG, PNG
or WebP file instead of a tensor (contract v1, additive). The format is read
from the file's magic bytes, never from a client-supplied name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

ImageFormat = Literal["jpeg", "png", "webp"]

FORMATS: Final[tuple[ImageFormat, ...]] = ("jpeg", "png", "webp")


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image file as sent: decoded later, off the event loop, into the model's
    channel count (see ``worker.model.decode``)."""

    format: ImageFormat
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def sniff_format(data: bytes) -> ImageFormat | None:
    """The format named by the file's magic bytes, or None if it is none we take."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None
