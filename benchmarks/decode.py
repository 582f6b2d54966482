"""Which CPU decoder the worker uses for encoded images: Pillow vs OpenCV.

    .venv/bin/python benchmarks/decode.py [--size 256] [--n 200]

Real photographs from scikit-image's bundled data (no download), resized to
``--size`` square, encoded as JPEG q90 and PNG; each decoder turns the bytes
into a uint8 RGB array, single-threaded, best of 5 rounds. Needs the ``bench``
extra (opencv-python-headless, scikit-image). Benchmark code, not shipped.
"""

from __future__ import annotations

import argparse
import io
import json
import time

import cv2
import numpy as np
from PIL import Image
from skimage import data


def photos(size: int) -> list[np.ndarray]:
    out = []
    for name in ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry"):
        img = Image.fromarray(getattr(data, name)()).convert("RGB").resize((size, size))
        out.append(np.asarray(img))
    return out


def encode(images: list[np.ndarray], fmt: str) -> list[bytes]:
    blobs = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        blobs.append(buf.getvalue())
    return blobs


def pil(blob: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(blob)) as im:
        return np.asarray(im.convert("RGB"))


def opencv(blob: bytes) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR)
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def rate(fn: object, blobs: list[bytes], n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            fn(blobs[i % len(blobs)])  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return n / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    cv2.setNumThreads(1)
    images = photos(args.size)
    out: dict[str, object] = {"size": args.size}
    for fmt in ("JPEG", "PNG"):
        blobs = encode(images, fmt)
        out[f"{fmt.lower()}_bytes_mean"] = round(sum(map(len, blobs)) / len(blobs))
        for name, fn in (("pillow", pil), ("opencv", opencv)):
            out[f"{fmt.lower()}_{name}_img_s"] = round(rate(fn, blobs, args.n))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
