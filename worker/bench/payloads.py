"""What the benchmark's requests carry: bundled data only, nothing downloaded.

``digits``: the bundled held-out digits at 8x8, 16x16 and 24x24 (the worker
resizes). ``resnet50``: scikit-image's bundled colour photographs at 256x256.
Payloads: ``jpeg`` (quality 90) and ``png`` files sent as they are, ``raw`` as
uint8 HWC tensors. ``sentiment``: the bundled held-out reviews as ``text``
(7-40 tokens; the worker tokenizes them).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Final

import numpy as np

from worker.contract import EncodedImage, Request, Tensor, encode_request
from worker.flow.errors import ConfigError
from worker.ops.samples import labelled_samples, sentiment_samples

PHOTOS: Final = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "ihc")
PHOTO_SIZE: Final = 256
JPEG_QUALITY: Final = 90

Records = list[tuple[bytes | None, bytes]]
Value = Tensor | EncodedImage | str


def photos(size: int = PHOTO_SIZE) -> list[np.ndarray]:
    """scikit-image's bundled photographs as uint8 [size, size, 3]."""
    try:
        import skimage.data
    except ImportError as exc:
        raise ConfigError(
            "--model resnet50 sends scikit-image's bundled photographs and needs "
            "scikit-image: pip install scikit-image (or this checkout's bench extra: "
            "pip install -e '.[bench]')"
        ) from exc
    from PIL import Image

    loaders = {"ihc": "immunohistochemistry"}
    out = []
    for name in PHOTOS:
        pixels = getattr(skimage.data, loaders.get(name, name))()
        image = Image.fromarray(np.ascontiguousarray(pixels[..., :3])).convert("RGB")
        resized = image.resize((size, size), Image.Resampling.BILINEAR)
        out.append(np.asarray(resized, dtype=np.uint8))
    return out


def payload_images(model: str) -> list[np.ndarray]:
    """The pixels a model's requests carry, uint8 HWC."""
    if model == "digits":
        return [s.image for s in labelled_samples(3)]  # 8x8, 16x16 and 24x24
    return photos()


def payload_inputs(model: str, payload: str) -> tuple[str, list[Value]]:
    """The request input's name and the values the requests cycle through.
    Images are read first, so a missing library exits 2 before anything starts."""
    if payload == "text":
        return "text", [s.text for s in sentiment_samples()]
    return "image", [encode_image(img, payload) for img in payload_images(model)]


def encode_image(pixels: np.ndarray, payload: str) -> Tensor | EncodedImage:
    """One request's ``inputs.image``: the tensor, or the image as a file."""
    if payload == "raw":
        return Tensor.from_numpy(pixels)
    from PIL import Image

    grey = pixels.ndim == 3 and pixels.shape[2] == 1
    image = Image.fromarray(pixels[:, :, 0] if grey else pixels)
    buf = io.BytesIO()
    if payload == "jpeg":
        image.save(buf, format="JPEG", quality=JPEG_QUALITY)
        return EncodedImage("jpeg", buf.getvalue())
    image.save(buf, format="PNG")
    return EncodedImage("png", buf.getvalue())


def requests(name: str, values: Sequence[Value], tag: str, n: int) -> list[Request]:
    """``n`` requests cycling through ``values`` as input ``name``; id ``TAG-i``."""
    return [Request(v=1, id=f"{tag}-{i}", inputs={name: values[i % len(values)]})
            for i in range(n)]  # fmt: skip


def request_records(name: str, values: Sequence[Value], tag: str, n: int) -> Records:
    """``n`` request records cycling through ``values``; id and key ``TAG-i``
    (unique keys: answers are matched to requests by key)."""
    return [(r.id.encode(), encode_request(r)) for r in requests(name, values, tag, n)]
