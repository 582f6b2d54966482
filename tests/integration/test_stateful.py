"""A stateful model per Kafka key (issue 28): silero-vad, a real voice-activity
detector from its PyPI wheel (``input [batch, samples]``, ``state [2, batch,
128]``, ``sr`` a scalar; outputs ``output`` and ``stateN``), served with
``[model.state.state] output = "stateN"`` and ``sr`` a constant. Many audio
streams, each a record key, their chunks interleaved on two partitions: every
answer equals running the model file sequentially on that stream alone, its
state threaded from chunk to chunk, though the streams share batches. On both
brokers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests import real_models
from tests.serving import wire
from worker.contract import Request, Result, Tensor, encode_request
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, produce_all

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


def sequential_reference(chunks: list[np.ndarray], model: str = "silero-vad") -> list[np.ndarray]:
    """The model file on one stream, one chunk after another, its state threaded."""
    session = real_models._session(str(real_models.model_path(model)))
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


def assert_as_alone(
    results: dict[str, Result], streams: dict[int, list[np.ndarray]], model: str = "silero-vad"
) -> None:
    """Every chunk's answer equals the model file run on its stream alone, its
    state threaded; the next state is the worker's, never returned."""
    for s, chunks in streams.items():
        for i, want in enumerate(sequential_reference(chunks, model)):
            got = results[f"s{s}-c{i}"]
            assert got.status == "ok", got.error
            assert set(got.outputs) == {"output"}, "the next state is the worker's, not returned"
            np.testing.assert_allclose(
                got.outputs["output"].to_numpy(), want, rtol=1e-4, atol=1e-5,
                err_msg=f"stream {s} chunk {i}",
            )  # fmt: skip


def chunk_request(stream: int, i: int, chunk: np.ndarray, chunks: int = CHUNKS) -> bytes:
    """Chunk ``i`` of a stream of ``chunks``: the first starts its sequence, the
    last ends it."""
    return encode_request(Request(
        v=1, id=f"s{stream}-c{i}", inputs={"input": Tensor.from_numpy(chunk)},
        sequence_start=i == 0, sequence_end=i == chunks - 1,
    ))  # fmt: skip


# The suite's silero-vad file names the state's batch ([2, batch, 128]); the
# same wheel's silero_vad.onnx leaves it unnamed ([2, ?, 128], every output
# dimension unnamed too): served with the axis configured (issue 37).
VARIANTS = {
    "batch-named": ("silero-vad", {}),
    "batch-unnamed": ("silero-vad-unnamed-batch",
                      {"INFER_WORKER_MODEL__STATE__STATE__BATCH_AXIS": "1"}),
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_interleaved_streams_answer_as_each_stream_run_alone_in_order(
    broker: Broker, names: dict[str, str], variant: str
) -> None:
    model, configured = VARIANTS[variant]
    path = real_models.model_path(model)
    parts = 2
    await create_topics(broker.bootstrap, {names["requests"]: parts, names["results"]: 1,
                                           names["dlq"]: 1})  # fmt: skip
    streams = {s: audio(s) for s in range(STREAMS)}
    # Chunk i of every stream before chunk i + 1 of any: streams share batches,
    # and a batch holds several chunks of one stream (they must run in turn).
    records = [
        (f"stream-{s}".encode(), chunk_request(s, i, streams[s][i]))
        for i in range(CHUNKS) for s in range(STREAMS)
    ]  # fmt: skip
    extra = [
        (None, wire("no-key", {"input": Tensor.from_numpy(streams[0][0])})),
        (b"stream-x", wire("sends-state", {
            "input": Tensor.from_numpy(streams[0][0]),
            "state": Tensor.from_numpy(np.zeros((2, 128), np.float32)),
        })),
    ]  # fmt: skip
    w = spawn_worker(
        broker.bootstrap, input_topics=[names["requests"]], output_topic=names["results"],
        dlq_topic=names["dlq"], group_id=names["group"],
        extra_env={"INFER_WORKER_MODEL__PATH": str(path), **STATEFUL, **configured},
    )  # fmt: skip
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= parts, 60.0,
            "partition assignment",
        )  # fmt: skip
        stream_of = {f"stream-{s}".encode(): s for s in range(STREAMS)}
        all_records = records + extra
        await produce_all(
            broker.bootstrap, names["requests"], all_records,
            partition_of=lambda i: stream_of.get(all_records[i][0] or b"", 0) % parts,
        )  # fmt: skip
        await c.start()
        n = len(all_records)
        assert await c.collect(lambda c: c.count() >= n, 90.0), (
            f"{c.count()} of {n}\n{w.log_tail()}"
        )
        m = w.metrics()
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()
        await c.stop()
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    batches = sum(v for k, v in m.items() if k.startswith("infer_batches_total"))
    assert batches < len(records), "the streams never shared a batch"
    assert m.get("infer_live_sequences") == 0.0  # every stream ended with sequence_end
    # The check can fail: answers without the threaded state differ beyond the
    # tolerance on most chunks after the first.
    differs = sum(
        not np.allclose(a, b, rtol=1e-4, atol=1e-5)
        for chunks in streams.values()
        for a, b in zip(sequential_reference(chunks, model)[1:], fresh_state_answers(chunks)[1:],
                        strict=True)
    )  # fmt: skip
    assert differs >= STREAMS * (CHUNKS - 1) // 2, differs
    assert_as_alone(results, streams, model)
    no_key, sends_state = results["no-key"], results["sends-state"]
    assert no_key.error is not None and no_key.error.code == "invalid_request"
    assert "record key" in no_key.error.message
    assert sends_state.error is not None and "inputs.state" in sends_state.error.message


async def test_a_restarted_worker_continues_each_stream_from_the_state_changelog(
    broker: Broker, names: dict[str, str]
) -> None:
    """kafka.state_topic, at-least-once: the first worker answers half of every
    stream and stops; a new process restores the streams' states from the
    changelog and answers the rest, each answer equal to the stream run alone."""
    parts, states = 2, f"{names['requests']}.states"
    await create_topics(broker.bootstrap, {names["requests"]: parts, names["results"]: 1,
                                           names["dlq"]: 1, states: parts})  # fmt: skip
    streams = {s: audio(s) for s in range(STREAMS)}
    records = [
        (f"stream-{s}".encode(), chunk_request(s, i, streams[s][i]))
        for i in range(CHUNKS) for s in range(STREAMS)
    ]  # fmt: skip
    part_of = {f"stream-{s}".encode(): s % parts for s in range(STREAMS)}
    env = {
        "INFER_WORKER_MODEL__PATH": str(real_models.model_path("silero-vad")),
        "INFER_WORKER_KAFKA__STATE_TOPIC": states,
        **STATEFUL,
    }

    def worker() -> WorkerProcess:
        return spawn_worker(
            broker.bootstrap, input_topics=[names["requests"]], output_topic=names["results"],
            dlq_topic=names["dlq"], group_id=names["group"], extra_env=env,
        )  # fmt: skip

    async def serve(w: WorkerProcess, batch: list[tuple[bytes, bytes]], total: int) -> None:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= parts, 60.0,
            "partition assignment",
        )  # fmt: skip
        await produce_all(broker.bootstrap, names["requests"], batch,
                          partition_of=lambda i: part_of[batch[i][0]])  # fmt: skip
        assert await c.collect(lambda c: c.count() >= total, 90.0), w.log_tail()

    c = Collector(broker.bootstrap, [names["results"]])
    await c.start()
    half = (CHUNKS // 2) * STREAMS  # every stream's first chunks; none ended
    first = second = None
    try:
        first = worker()
        await serve(first, records[:half], half)
        assert first.terminate() == 0, first.log_tail()
        second = worker()
        await serve(second, records[half:], len(records))
        restored = second.metrics().get("infer_restored_sequences_total", 0)
        assert second.terminate() == 0, second.log_tail()
    finally:
        for w in (first, second):
            if w is not None:
                w.kill()
        await c.stop()
    assert restored == STREAMS, f"{restored} of {STREAMS} streams restored"
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    assert_as_alone(results, streams)


@pytest.mark.parametrize("broker_kind", ["embedded"])
async def test_a_model_without_a_batch_axis_keeps_each_stream_s_state_one_run_each(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    """``model.unbatched`` with a state (issue 37): a recurrent model of input
    ``[seq, 4]`` and state ``[1, 1, 3]``, no batch axis, served per key; one
    sequence per engine run, every answer equal to the stream run alone."""
    from tests.onnx_models import unbatched_recurrent

    path = unbatched_recurrent(tmp_path / "ur.onnx")
    streams = {s: [np.random.default_rng(10 * s + i).normal(size=(3 + i, 4)).astype(np.float32)
                   for i in range(4)] for s in range(5)}  # fmt: skip
    await create_topics(broker.bootstrap, {names["requests"]: 2, names["results"]: 1,
                                           names["dlq"]: 1})  # fmt: skip
    records = [
        (f"stream-{s}".encode(), encode_request(Request(
            v=1, id=f"s{s}-c{i}", inputs={"x": Tensor.from_numpy(chunks[i])},
            sequence_start=i == 0, sequence_end=i == len(chunks) - 1)))
        for i in range(4) for s, chunks in streams.items()
    ]  # fmt: skip
    w = spawn_worker(
        broker.bootstrap, input_topics=[names["requests"]], output_topic=names["results"],
        dlq_topic=names["dlq"], group_id=names["group"],
        extra_env={"INFER_WORKER_MODEL__PATH": str(path), "INFER_WORKER_MODEL__UNBATCHED": "true",
                   "INFER_WORKER_MODEL__STATE__H__OUTPUT": "hN"},
    )  # fmt: skip
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    try:
        await produce_all(broker.bootstrap, names["requests"], records,
                          partition_of=lambda i: int(records[i][0][7:]) % 2)  # type: ignore[index]  # fmt: skip
        await c.start()
        assert await c.collect(lambda c: c.count() >= len(records), 60.0), w.log_tail()
    finally:
        w.kill()
        await c.stop()
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    session = real_models._session(str(path))
    for s, chunks in streams.items():
        state = np.zeros((1, 1, 3), np.float32)
        for i, chunk in enumerate(chunks):
            y, state = session.run(["y", "hN"], {"x": chunk, "h": state})
            got = results[f"s{s}-c{i}"]
            assert got.status == "ok", got.error
            np.testing.assert_allclose(got.outputs["y"].to_numpy(), y, rtol=1e-6,
                                       err_msg=f"stream {s} chunk {i}")  # fmt: skip
