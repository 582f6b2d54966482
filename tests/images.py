"""Image files for tests, made here (no binary fixtures in the repository)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def encode(pixels: np.ndarray, fmt: str, **options: object) -> bytes:
    """uint8 [H, W, C] (C = 1, 3 or 4) as an image file."""
    arr = pixels[:, :, 0] if pixels.ndim == 3 and pixels.shape[2] == 1 else pixels
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **options)
    return buf.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int = 40_000, height: int = 40_000, payload: int = 20_000) -> bytes:
    """A well-formed PNG header claiming ``width`` x ``height`` RGB pixels, with
    ``payload`` bytes of (compressed, far too short) image data: what a hostile
    client sends to make a decoder allocate gigabytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\x00" * (payload * 50))[:payload]
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")
    )
