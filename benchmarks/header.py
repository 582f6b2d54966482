"""Intake's header check for JPEG files: Pillow's ``Image.open`` (what it did
before) against ``header_problem`` (frame header read without Pillow), per file;
and, for scale, the whole host decode (``decode_image``) of the same files.

    .venv/bin/python -m benchmarks.header

Best of 7 passes over 200 digit JPEGs (8x8) and, where scikit-image is
installed, its photographs at 256x256. Benchmark code: not shipped.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable, Sequence

from PIL import Image

from worker.bench.payloads import encode_image, payload_images
from worker.contract import EncodedImage
from worker.contract.images import header_problem
from worker.model.decode import decode_image


def _pil(image: EncodedImage) -> None:
    with Image.open(io.BytesIO(image.data)) as im:
        _ = im.size


def _decode(image: EncodedImage, channels: int) -> None:
    decode_image(image, channels)


def per_file_us(fn: Callable[[EncodedImage], object], files: Sequence[EncodedImage]) -> float:
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for f in files:
            fn(f)
        best = min(best, time.perf_counter() - t0)
    return best / len(files) * 1e6


def main() -> None:
    sets = {"digits 8x8": payload_images("digits")[:200]}
    try:
        sets["photos 256x256"] = payload_images("resnet50")
    except Exception as exc:  # scikit-image missing
        print(f"photos skipped: {exc}")
    for name, images in sets.items():
        encoded = (encode_image(i, "jpeg") for i in images)
        files = [f for f in encoded if isinstance(f, EncodedImage)]
        before = per_file_us(_pil, files)
        now = per_file_us(lambda f: header_problem(f, 1 << 30), files)
        ratio = before / now
        channels = images[0].shape[2]
        decode = per_file_us(functools.partial(_decode, channels=channels), files)
        print(
            f"{name}: Image.open {before:.1f} us, header_problem {now:.1f} us, {ratio:.1f}x; "
            f"decode_image {decode:.1f} us"
        )


if __name__ == "__main__":
    main()
