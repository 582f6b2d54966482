"""Functions the pipeline tests name as steps (``function = "tests.pipeline_functions:..."``):
what a user writes between two models, numpy in, numpy out."""

from __future__ import annotations

import numpy as np

WINDOW = 76  # mel frames openWakeWord's embedding model takes


def mel_window(mel: np.ndarray) -> dict[str, np.ndarray]:
    """openWakeWord's step between its melspectrogram and embedding models: the
    spectrogram scaled as it scales it (x / 10 + 2) and its last 76 frames, with
    the channel axis the embedding model takes."""
    frames = mel[0] / 10.0 + 2.0
    if frames.shape[0] < WINDOW:
        raise ValueError(f"{frames.shape[0]} mel frames; the embedding takes {WINDOW}")
    return {"frames": np.ascontiguousarray(frames[-WINDOW:, :, None], dtype=np.float32)}


def doubled(x: np.ndarray) -> dict[str, np.ndarray]:
    """The smallest function step: its input, doubled (a pipeline over the bundled
    digits model in the fault tests)."""
    return {"y": x * 2}


def tiles(image: np.ndarray) -> dict[str, np.ndarray]:
    """A fan-out step: 0, 1 or 2 regions of an image (as its first pixel says),
    each the image shifted along its width."""
    n = int(image[0, 0, 0]) % 3
    shifted = [np.roll(image, k + 1, axis=1) for k in range(n)]
    return {"tile": np.stack(shifted) if shifted else np.zeros((0, *image.shape), image.dtype)}


def corner_boxes(image: np.ndarray) -> dict[str, np.ndarray]:
    """A stand-in detector's boxes (x0, y0, x1, y1): the whole image and its
    top-left quarter."""
    h, w = image.shape[:2]
    return {"boxes": np.array([[0, 0, w, h], [0, 0, w / 2, h / 2]], np.float32)}
