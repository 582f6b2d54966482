"""The host load of a bulk drain, without the worker doing the drain (benchmarks.lanes'
``urgent-loaded`` scenario, issue 39).

    python -m benchmarks.lanes_load BOOTSTRAP SOURCE SINK RATE

Copies SOURCE's records to SINK at RATE records/s (a token bucket), keyed
``b<n>`` like the bulk lane's results. The broker then appends, serves and
replicates a bulk lane's traffic, and benchmarks.lanes' reader reads it from the
results topic as it reads bulk results, while the worker itself serves only
the urgent lane. Urgent latency under this load, against the lanes scenario's,
separates what the host's shared cores cost the urgent lane from what the
worker's own bulk work costs it. On librdkafka (confluent-kafka, the ``bench``
extra) so that the copier's own Python is small: a few microseconds a record.
Benchmark code, not shipped.
"""

from __future__ import annotations

import sys
import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition


def main() -> int:
    bootstrap, source, sink, rate_arg = sys.argv[1:5]
    rate = float(rate_arg)
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"lanes-load-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
    })  # fmt: skip
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 2})
    parts = consumer.list_topics(source, timeout=30).topics[source].partitions
    consumer.assign([TopicPartition(source, p, OFFSET_BEGINNING) for p in sorted(parts)])
    start, sent = time.monotonic(), 0
    try:
        while True:
            for m in consumer.consume(num_messages=256, timeout=0.1):
                if m.error() is not None or m.value() is None:
                    continue
                while True:
                    try:
                        producer.produce(sink, m.value(), key=f"b{sent}".encode())
                        break
                    except BufferError:  # librdkafka's queue is full: let it send
                        producer.poll(0.01)
                sent += 1
            producer.poll(0)
            ahead = sent / rate - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)
    except KeyboardInterrupt:
        return 0
    finally:
        producer.flush(5)
        consumer.close()


if __name__ == "__main__":
    raise SystemExit(main())
