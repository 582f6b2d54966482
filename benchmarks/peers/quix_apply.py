"""Peer: Quix Streams with a per-message ``apply``, as its documentation shows:
a StreamingDataFrame over the input topic applies the model to each message
and writes the result to the output topic; Quix commits on its own schedule.
Benchmark code, not shipped."""

from __future__ import annotations

import tempfile

from quixstreams import Application, message_context

from benchmarks.peers.common import Model

model = Model()
k = model.settings.kafka
app = Application(
    broker_address=k.bootstrap_servers,
    consumer_group=k.group_id,
    auto_offset_reset="earliest",
    auto_create_topics=False,
    state_dir=tempfile.mkdtemp(prefix="quix-"),  # not ./state in the checkout
)
requests = app.topic(k.input_topics[0], value_deserializer="bytes", key_deserializer="bytes")
results = app.topic(k.output_topic, value_serializer="bytes", key_serializer="bytes")


def infer(value: bytes) -> bytes:
    ctx = message_context()  # the record's topic, partition and offset
    ((_, result),) = model.answer([value], [(ctx.topic, ctx.partition, ctx.offset)])
    return result


sdf = app.dataframe(requests)
sdf = sdf.apply(infer)
sdf.to_topic(results)

if __name__ == "__main__":
    app.run()
