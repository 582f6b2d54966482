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
