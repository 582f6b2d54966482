"""Image files to pixels: the CPU decoder, run on the inference stage's threads.

Requests may carry a JPEG, PNG or WebP file instead of a tensor (the contract
checked its header at intake). Here it becomes the uint8 ``[H, W, C]`` array a
tensor would have been, in the model's channel count (grey to RGB and back as
Pillow converts), so a lossless PNG of an image gets exactly the answer of the
raw tensor. A file that fails to decode (corrupt, truncated) is answered
``invalid_request`` with the decoder's complaint; the rest of the batch runs.

Pillow was chosen over OpenCV by measurement and by what it can do first: OpenCV
decodes JPEG about 18% faster on one core (benchmarks/decode.py, BENCHMARKS.md), but
cannot read an image's dimensions without decoding it, and the pixel limit must
be enforced before any pixel is allocated. EXIF orientation is not applied: the
pixels are used as stored, as a tensor's would be.
"""

from __future__ import annotations

import io
import time
from typing import Final

import numpy as np
from PIL import Image

from worker.contract import EncodedImage, ErrorInfo
from worker.flow.codes import ErrorCode
from worker.model.rows import Row
from worker.obs import metrics

_MODES: Final = {1: "L", 3: "RGB", 4: "RGBA"}


class DecodeFailed(ValueError):
    """The file's header was fine but its data is not."""


def decode_image(image: EncodedImage, channels: int) -> np.ndarray:
    """The file's pixels as uint8 [H, W, channels]; raises ``DecodeFailed``."""
    mode = _MODES[channels]
    try:
        with Image.open(io.BytesIO(image.data)) as im:
            pixels = np.asarray(im if im.mode == mode else im.convert(mode))
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise DecodeFailed(f"{image.format} cannot be decoded: {exc}") from exc
    if pixels.dtype != np.uint8:  # e.g. 16-bit PNG kept wide by a mode Pillow keeps
        raise DecodeFailed(f"{image.format} decodes to {pixels.dtype}, not 8-bit")
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


def decode_pending(answers: list[Row], channels: int, input_name: str) -> list[Row]:
    """Decode the files of input ``input_name`` among ``answers`` (a worker thread);
    returns the answers that can run. A failure is that request's
    ``invalid_request`` answer; the decoded pixels replace the file."""
    runnable: list[Row] = []
    decoded = invalid = 0
    for answer in answers:
        encoded = answer.values.get(input_name)
        if not isinstance(encoded, EncodedImage):
            runnable.append(answer)
            continue
        started = time.monotonic()
        try:
            answer.values[input_name] = decode_image(encoded, channels)
        except DecodeFailed as exc:
            answer.error = ErrorInfo(ErrorCode.INVALID_REQUEST, f"inputs.{input_name}: {exc}")
            invalid += 1
            continue
        finally:
            answer.timing_us["decode"] = round((time.monotonic() - started) * 1e6)
        decoded += 1
        runnable.append(answer)
    # Counted once per call, not per image (metrics cost showed in issue 11's profile).
    if decoded:
        metrics.IMAGES_DECODED.labels(decoder="host", outcome="ok").inc(decoded)
    if invalid:
        metrics.IMAGES_DECODED.labels(decoder="host", outcome="invalid").inc(invalid)
    return runnable
