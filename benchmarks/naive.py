"""The naive baseline the benchmarks compare against: one request at a time.

Read one record, decode, preprocess, infer, produce, wait for the ack, commit
its offset, repeat. Same decode/validate, preprocessing, engine and result
encoding as the worker, so the difference measured is batching and pipelining.
"""

from __future__ import annotations

import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from worker.compute.engines import load_engine
from worker.config import Settings
from worker.contract import ErrorInfo, ModelInfo, encode_result
from worker.flow.errors import InferenceFailed, UndecodableRecord
from worker.kafka.clients import client_kwargs, group_consumer_kwargs
from worker.kafka.delivery.outgoing import build_result, dlq_headers
from worker.kafka.intake import JobFactory
from worker.model.inputs import bind
from worker.model.postprocess import postprocess
from worker.model.rows import Row


async def serve_naive(settings: Settings, expect: int) -> int:
    k, m = settings.kafka, settings.model
    engine = load_engine(m)
    model = ModelInfo(engine.info.name, engine.info.version)
    raw_name = m.output or engine.info.output_names[0]
    inputs = bind(m, engine.info.io, settings.limits)
    make_job = JobFactory(inputs, settings.limits)
    consumer = AIOKafkaConsumer(*k.input_topics, **group_consumer_kwargs(k))
    producer = AIOKafkaProducer(acks="all", max_request_size=k.max_request_size, **client_kwargs(k))
    await producer.start()
    await consumer.start()
    try:
        for _ in range(expect):
            record = await consumer.getone()
            job = make_job(record.topic, record.partition, record.offset, record.key, record.value)
            answer = Row.of(job)
            if isinstance(job.failure, UndecodableRecord):
                await producer.send_and_wait(
                    k.dlq_topic,
                    job.raw_value or b"",  # a record needs a key or a value
                    key=job.key,
                    headers=dlq_headers(job, job.failure.code, str(job.failure), "decode"),
                )
            else:
                if job.failure is None:
                    t0 = time.monotonic()
                    try:
                        # Decode a file or tokenize a text, one request at a time.
                        if inputs.prepare([answer]):  # else: answered invalid_request
                            raw = engine.run(inputs.collate([answer]).feeds)[raw_name]
                            out = postprocess(raw, m.postprocess, raw_name)
                            answer.outputs = {name: arr[0] for name, arr in out.items()}
                    except InferenceFailed as exc:
                        answer.error = ErrorInfo(exc.code, str(exc))
                    answer.timing_us["infer"] = round((time.monotonic() - t0) * 1e6)
                result = build_result(answer.answer(), model, time.monotonic())
                await producer.send_and_wait(
                    k.output_topic,
                    encode_result(result),
                    key=job.key,
                    headers=[("id", result.id.encode())],
                )
            from aiokafka.structs import TopicPartition

            await consumer.commit(
                {TopicPartition(record.topic, record.partition): record.offset + 1}
            )
    finally:
        await consumer.stop()
        await producer.stop()
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/naive.py --expect N``: settings from ``INFER_WORKER_*``,
    like the worker (``infer-worker bench`` starts it that way)."""
    import argparse
    import asyncio

    from worker.config import load_settings
    from worker.obs import logs

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="TOML file (environment INFER_WORKER_* overrides it)")
    parser.add_argument("--expect", type=int, required=True, help="records to answer, then exit")
    args = parser.parse_args(argv)
    settings = load_settings(args.config)
    logs.configure(settings.logging)
    return asyncio.run(serve_naive(settings, args.expect))


if __name__ == "__main__":
    raise SystemExit(main())
