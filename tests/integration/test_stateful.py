"""A stateful model per Kafka key (issue 28): silero-vad, a real voice-activity
detector from its PyPI wheel (``input [batch, samples]``, ``state [2, batch,
128]``, ``sr`` a scalar; outputs ``output`` and ``stateN``), served with
``[model.state.state] output = "stateN"`` and ``sr`` a constant. Many audio
streams, each a record key, their chunks interleaved on two partitions: every
answer equals running the model file sequentially on that stream alone, its
state threaded from chunk to chunk, though the streams share batches. On both
brokers."""

from __future__ import annotations

import numpy as np
import pytest

from tests import real_models
from worker.contract import Result

pytestmark = pytest.mark.integration

STREAMS, CHUNKS, SAMPLES = 12, 5, 512
STATEFUL = {
    "INFER_WORKER_MODEL__INPUTS__SR__VALUE": "16000",
    "INFER_WORKER_MODEL__STATE__STATE__OUTPUT": "stateN",
    "INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS": "100",
}


def audio(stream: int) -> list[np.ndarray]:
    rng = np.random.default_rng(stream)
    speech = 0.3 * np.sin(np.arange(SAMPLES * CHUNKS) * (0.02 + 0.01 * stream))
    noise = rng.normal(0, 0.05, SAMPLES * CHUNKS)
    signal = (speech * (stream % 2) + noise).astype(np.float32)
    return [signal[i * SAMPLES : (i + 1) * SAMPLES] for i in range(CHUNKS)]


def sequential_reference(chunks: list[np.ndarray]) -> list[np.ndarray]:
    """The model file on one stream, one chunk after another, its state threaded."""
    session = real_models._session(str(real_models.model_path("silero-vad")))
    state = np.zeros((2, 1, 128), np.float32)
    out = []
    for chunk in chunks:
        feeds = {"input": chunk[None], "state": state, "sr": np.array(16000, np.int64)}
        prob, state = session.run(["output", "stateN"], feeds)
        out.append(prob[0])
    return out


def fresh_state_answers(chunks: list[np.ndarray]) -> list[np.ndarray]:
    """Each chunk with the initial state: what a worker that lost the state
    (or never kept it) would answer."""
    session = real_models._session(str(real_models.model_path("silero-vad")))
    zeros, sr = np.zeros((2, 1, 128), np.float32), np.array(16000, np.int64)
    return [session.run(["output"], {"input": c[None], "state": zeros, "sr": sr})[0][0]
            for c in chunks]  # fmt: skip


def assert_as_alone(results: dict[str, Result], streams: dict[int, list[np.ndarray]]) -> None:
    """Every chunk's answer equals the model file run on its stream alone, its
    state threaded; the next state is the worker's, never returned."""
    assert_as_alone(results, streams)
