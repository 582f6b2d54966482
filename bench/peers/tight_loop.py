"""Peer: the tight aiokafka loop a competent engineer writes in an afternoon.

    getmany -> decode -> one batched ONNX Runtime run -> produce all -> await acks
    -> commit -> repeat

Same model, same preprocessing code (the worker's NumPy reference), same wire
contract for requests and results (error handling reduced to what the benchmark
payloads need: every record here is valid). No pipelining between stages, no
deadline batching, no backpressure, no DLQ: that is what it saves, and what it
gives up. Settings come from ``INFER_WORKER_*`` like the worker's, so the
benchmark starts it the same way. Benchmark code, not shipped.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import onnxruntime as ort
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from worker.config import load_settings
from worker.engines.base import resolve_model_path
from worker.inference.postprocess import postprocess
from worker.inference.preprocess import preprocess


async def main() -> None:
    s = load_settings()
    k, m = s.kafka, s.model
    session = ort.InferenceSession(
        str(resolve_model_path(m.path)), providers=["CPUExecutionProvider"]
    )
    in_name = session.get_inputs()[0].name
    out_name = m.output or session.get_outputs()[0].name
    consumer = AIOKafkaConsumer(
        *k.input_topics,
        bootstrap_servers=k.bootstrap_servers,
        group_id=k.group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=k.fetch_max_wait_ms,
        max_partition_fetch_bytes=k.max_partition_fetch_bytes,
    )
    producer = AIOKafkaProducer(bootstrap_servers=k.bootstrap_servers, acks="all", linger_ms=2)
    await consumer.start()
    await producer.start()
    try:
        while True:
            fetched = await consumer.getmany(timeout_ms=100, max_records=s.batching.max_batch_size)
            records = [r for batch in fetched.values() for r in batch]
            if not records:
                continue
            started = time.monotonic()
            requests = [msgpack.unpackb(r.value, raw=False) for r in records]
            images = []
            for req in requests:
                t = req["inputs"]["image"]
                images.append(np.frombuffer(t["data"], np.uint8).reshape(t["shape"]))
            batch = preprocess(images, m.preprocess)
            raw = session.run([out_name], {in_name: batch})[0]
            out = postprocess(raw, m.postprocess, out_name)
            total = round((time.monotonic() - started) * 1e6)
            acks = []
            for i, (record, req) in enumerate(zip(records, requests, strict=True)):
                result = {
                    "v": 1,
                    "id": req["id"],
                    "status": "ok",
                    "outputs": {
                        name: {"dtype": arr.dtype.name, "shape": list(arr.shape[1:]),
                               "data": arr[i].tobytes()}
                        for name, arr in out.items()
                    },
                    "model": {"name": m.name, "version": "peer"},
                    "source": {"topic": record.topic, "partition": record.partition,
                               "offset": record.offset},
                    "timing_us": {"total": total},
                }  # fmt: skip
                acks.append(
                    await producer.send(
                        k.output_topic, msgpack.packb(result), key=record.key,
                        headers=[("id", req["id"].encode())],
                    )
                )  # fmt: skip
            await asyncio.gather(*acks)
            offsets = {}
            for tp, batch_records in fetched.items():
                offsets[TopicPartition(tp.topic, tp.partition)] = batch_records[-1].offset + 1
            await consumer.commit(offsets)
    finally:
        await consumer.stop()
        await producer.stop()


if __name__ == "__main__":
    asyncio.run(main())
