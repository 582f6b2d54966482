"""The model's image input, as the contract allows it: a uint8 ``[H, W, C]``
tensor, or an image file (JPEG, PNG, WebP) as a msgpack bin.

Checked once per request at intake, before any engine work, against the model's
channel count and the pixel limit, so a bad image is answered with an error
result naming the field instead of failing a whole batch later. For a file only
the header is read here (dimensions first: a 20 KB PNG that claims 40000x40000
is refused without allocating its pixels); decoding happens later, off the
event loop (``worker.model.decode``).
"""

from __future__ import annotations

import io
from typing import Final

import numpy as np
from PIL import Image, UnidentifiedImageError

from worker.contract.jpeg import read_frame
from worker.flow.errors import InvalidRequest, TensorTooLarge
from worker.flow.values import EncodedImage, InputValue, Request

_UINT8: Final = np.dtype(np.uint8)


def check_image(
    request: Request, input_name: str, channels: int, max_pixels: int
) -> np.ndarray | EncodedImage:
    """Validate the model input of one request; returns a tensor as a read-only
    uint8 [H, W, C] view (no copy), or a file whose header passed the checks."""
    value = request.inputs.get(input_name)
    try:
        if value is None:
            names = ", ".join(sorted(request.inputs)) or "none"
            raise InvalidRequest(f"inputs.{input_name}: missing (got {names})")
        return check_image_value(value, f"inputs.{input_name}", channels, max_pixels)
    except InvalidRequest as exc:
        exc.request_id, exc.meta = request.id, request.meta
        raise


def check_image_value(
    value: InputValue | np.ndarray, field: str, channels: int, max_pixels: int
) -> np.ndarray | EncodedImage:
    """``check_image`` for one input's value (or a pipeline step's uint8 pixels);
    messages name ``field``."""
    if isinstance(value, str):
        raise InvalidRequest(
            f"{field}: expected an image (a uint8 [H, W, {channels}] tensor or a JPEG, PNG "
            "or WebP file as msgpack bin), got a string"
        )
    if isinstance(value, EncodedImage):
        problem = header_problem(value, max_pixels)
        if problem is not None:
            message, too_large = problem
            cls = TensorTooLarge if too_large else InvalidRequest
            raise cls(f"{field}: {message}")
        return value
    if value.dtype != "uint8":
        raise InvalidRequest(f"{field}.dtype: expected uint8, got {value.dtype}")
    shape = value.shape
    if len(shape) == 2 and channels == 1:
        shape = (*shape, 1)
    if len(shape) != 3 or shape[2] != channels:
        raise InvalidRequest(f"{field}.shape: expected [H, W, {channels}], got {list(value.shape)}")
    h, w, _ = shape
    if h < 1 or w < 1:
        raise InvalidRequest(f"{field}.shape: height and width must be >= 1")
    if h * w > max_pixels:
        raise TensorTooLarge(f"{field}: {h}x{w} exceeds {max_pixels} pixels")
    if isinstance(value, np.ndarray):  # a step's pixels: as they are, [H, W, C]
        return value.reshape(shape)
    # A read-only view of the request's bytes, made in one call (half the cost
    # of frombuffer and reshape, per record on the event loop); the tensor's
    # rules already held its data to exactly h * w * channels bytes.
    return np.ndarray(shape, _UINT8, value.data)


def header_problem(image: EncodedImage, max_pixels: int) -> tuple[str, bool] | None:
    """What is wrong with the file's header (message, whether it is too large), or
    None. Reads the header only: no pixel is decoded.

    A complete JPEG's size comes from its frame header, read without Pillow (6x
    cheaper, and this runs on the event loop for every record); anything else,
    or a JPEG whose markers do not parse, goes through ``Image.open``, whose
    complaint then names the problem. What Pillow would only notice when
    decoding is answered by the decoder, as for other formats."""
    frame = read_frame(image.data) if image.format == "jpeg" else None
    if frame is not None and frame.complete and frame.height >= 1 and frame.width >= 1:
        return _size_problem(image, frame.height, frame.width, max_pixels)
    try:
        with Image.open(io.BytesIO(image.data)) as im:
            w, h = im.size
    except Image.DecompressionBombError as exc:
        return f"{image.format} exceeds {max_pixels} pixels ({exc})", True
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return f"{image.format} header cannot be read: {exc}", False
    if h < 1 or w < 1:
        return f"{image.format} of {w}x{h} pixels", False
    return _size_problem(image, h, w, max_pixels)


def _size_problem(image: EncodedImage, h: int, w: int, max_pixels: int) -> tuple[str, bool] | None:
    if h * w > max_pixels:
        return f"{image.format} of {h}x{w} exceeds {max_pixels} pixels", True
    return None
