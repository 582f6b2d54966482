"""Peer: the same tight loop on confluent-kafka (librdkafka), as its users write it.

    consume(batch) -> decode -> one batched ONNX Runtime run -> produce all -> flush
    -> commit -> repeat

librdkafka fetches, batches and decodes the protocol in C on its own threads, so
what Python spends per record is the decode, the model and the encode: the
strongest peer a Python team would pick (issue 36). Same model, preprocessing
and wire contract as the worker (``benchmarks.peers.common``); no pipelining, no
deadline batching, no backpressure, no DLQ. Benchmark code, not shipped.
"""

from __future__ import annotations

from confluent_kafka import Consumer, Producer, TopicPartition

from benchmarks.peers.common import Model


def main() -> None:
    model = Model()
    s = model.settings
    k = s.kafka
    bootstrap = k.bootstrap_servers
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": k.group_id,
        "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": k.fetch_max_wait_ms,
    })  # fmt: skip
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 2})
    consumer.subscribe(list(k.input_topics))
    try:
        while True:
            records = consumer.consume(num_messages=s.batching.max_batch_size, timeout=0.1)
            records = [r for r in records if r.error() is None]
            if not records:
                continue
            answers = model.answer(
                [r.value() for r in records],
                [(r.topic(), r.partition(), r.offset()) for r in records],
            )
            for record, (rid, value) in zip(records, answers, strict=True):
                producer.produce(
                    k.output_topic, value, key=record.key(), headers=[("id", rid.encode())]
                )
            producer.flush()
            offsets: dict[tuple[str, int], int] = {}
            for r in records:
                offsets[(r.topic(), r.partition())] = r.offset() + 1
            consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                asynchronous=False,
            )
    finally:
        consumer.close()


if __name__ == "__main__":
    main()
