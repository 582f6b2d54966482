"""Three real third-party models in one worker process (issue 58), from the
suite's real-model set (``tests/real_models.py``): PaddleOCR's text-direction
classifier (an image model) as [model], openWakeWord's audio embedder (a
sequence of mel frames) and silero-vad (a stateful voice-activity detector, its
state per record key) as [models.NAME], each on a topic of its own, and the
embedder also named by requests on [model]'s topic. Every answer equals the
model file run on that request alone (silero-vad: on its stream alone, the
state threaded), names the model that gave it, and a request naming a model the
worker does not serve is answered ``unknown_model``. On both brokers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests import real_models
from tests.integration.test_stateful import assert_as_alone, audio, chunk_request
from tests.serving import wire
from worker.contract import ModelRef, Tensor
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration

STREAMS, CHUNKS = 6, 5  # silero-vad: chunks as tests/integration/test_stateful.py sends them


async def test_an_image_a_sequence_and_a_stateful_model_in_one_worker(
    broker: Broker, names: dict[str, str]
) -> None:
    paths = {m: real_models.model_path(m) for m in ("ppocr-cls", "oww-embedding", "silero-vad")}
    topic = {m: f"{names['requests']}.{m}" for m in ("cls", "embedding", "vad")}
    parts = 2
    await create_topics(broker.bootstrap, {**{t: parts for t in topic.values()},
                                           names["results"]: 1, names["dlq"]: 1})  # fmt: skip
    rng = np.random.default_rng(58)
    images = real_models.requests("ppocr-cls", rng, 12)
    frames = real_models.requests("oww-embedding", rng, 16)

    def tensors(r: dict[str, np.ndarray]) -> dict[str, Tensor]:
        return {k: Tensor.from_numpy(v) for k, v in r.items()}

    shared = [(f"i-{i}".encode(), wire(f"i-{i}", tensors(r))) for i, r in enumerate(images)]
    # Half the embedder's requests on [model]'s topic, naming it; half on its own.
    shared += [(f"e-{i}".encode(), wire(f"e-{i}", tensors(r), ModelRef("embedding")))
               for i, r in enumerate(frames[:8])]  # fmt: skip
    shared.append((b"unknown", wire("unknown", tensors(frames[0]), ModelRef("wakeword"))))
    own = [(f"e-{i}".encode(), wire(f"e-{i}", tensors(r))) for i, r in enumerate(frames)][8:]
    streams = {s: audio(s) for s in range(STREAMS)}
    chunks = [(f"stream-{s}".encode(), chunk_request(s, i, streams[s][i]))
              for i in range(CHUNKS) for s in range(STREAMS)]  # fmt: skip
    env = {
        "INFER_WORKER_MODEL__PATH": str(paths["ppocr-cls"]),
        "INFER_WORKER_MODEL__NAME": "cls",
        "INFER_WORKER_MODELS__EMBEDDING__PATH": str(paths["oww-embedding"]),
        "INFER_WORKER_MODELS__EMBEDDING__TOPICS": topic["embedding"],
        "INFER_WORKER_MODELS__VAD__PATH": str(paths["silero-vad"]),
        "INFER_WORKER_MODELS__VAD__TOPICS": topic["vad"],
        "INFER_WORKER_MODELS__VAD__INPUTS__SR__VALUE": "16000",
        "INFER_WORKER_MODELS__VAD__STATE__STATE__OUTPUT": "stateN",
    }
    w = spawn_worker(broker.bootstrap, input_topics=list(topic.values()),
                     output_topic=names["results"], dlq_topic=names["dlq"],
                     group_id=names["group"], extra_env=env)  # fmt: skip
    total = len(shared) + len(own) + len(chunks)
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 3 * parts, 90.0,
            "the assignment of the three models' partitions",
        )  # fmt: skip
        await produce_all(broker.bootstrap, topic["cls"], shared)
        await produce_all(broker.bootstrap, topic["embedding"], own)
        stream_of = {f"stream-{s}".encode(): s for s in range(STREAMS)}
        await produce_all(broker.bootstrap, topic["vad"], chunks,
                          partition_of=lambda i: stream_of[chunks[i][0]] % parts)  # fmt: skip
        await c.start()
        assert await c.collect(lambda c: c.count() >= total, 120.0), (
            f"{c.count()} of {total} answered\n{w.log_tail()}"
        )
        m = w.metrics()
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()
        await c.stop()
    assert not c.records.get(names["dlq"]), "a readable request went to the DLQ"
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    assert len(results) == total

    for i, request in enumerate(images):
        r = results[f"i-{i}"]
        assert (r.status, r.model.name) == ("ok", "cls"), r.error
        for output, want in real_models.reference("ppocr-cls", request).items():
            real_models.close_enough("ppocr-cls", r.outputs[output].to_numpy(), want)
    for i, request in enumerate(frames):
        r = results[f"e-{i}"]
        assert (r.status, r.model.name) == ("ok", "embedding"), r.error
        for output, want in real_models.reference("oww-embedding", request).items():
            real_models.close_enough("oww-embedding", r.outputs[output].to_numpy(), want)
    vad = {k: v for k, v in results.items() if k.startswith("s")}
    assert {r.model.name for r in vad.values()} == {"vad"}
    assert_as_alone(vad, streams)
    unknown = results["unknown"]
    assert unknown.error is not None and unknown.error.code == "unknown_model"
    assert unknown.error.message == (
        "model: 'wakeword' is not served here; this worker serves 'cls', 'embedding', 'vad'"
    )
    assert m["infer_live_sequences"] == 0.0  # every stream ended with sequence_end
