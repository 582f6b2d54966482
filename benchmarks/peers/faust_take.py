"""Peer: Faust (faust-streaming) with ``stream.take_events(max, within=...)``
(``take`` that keeps each event's message) batching,
as its documentation shows: an agent takes up to ``max_batch_size`` events or
waits ``max_queue_delay_ms``, runs them through the model as one batch, and
sends the results; Faust commits offsets as the agent acknowledges events.
Benchmark code, not shipped."""

from __future__ import annotations

import tempfile

import faust

from benchmarks.peers.common import Model

model = Model()
s = model.settings
k = s.kafka
app = faust.App(
    "peer-faust",
    broker=f"kafka://{k.bootstrap_servers}",
    web_enabled=False,
    datadir=tempfile.mkdtemp(prefix="faust-"),
    consumer_auto_offset_reset="earliest",
    broker_session_timeout=k.session_timeout_ms / 1000,
    topic_allow_declare=False,
    topic_disable_leader=True,
)
app.conf.id = k.group_id  # the consumer group, as the benchmark names it
requests = app.topic(*k.input_topics, key_type=bytes, value_type=bytes, value_serializer="raw")
results = app.topic(k.output_topic, key_type=bytes, value_type=bytes, value_serializer="raw")


@app.agent(requests)
async def infer(stream: faust.StreamT) -> None:
    # take_events: take() with each event's message (topic/partition/offset, key).
    async for events in stream.take_events(
        s.batching.max_batch_size, within=s.batching.max_queue_delay_ms / 1000
    ):
        sources = [(e.message.topic, e.message.partition, e.message.offset) for e in events]
        answers = model.answer([e.value for e in events], sources)
        for event, (rid, value) in zip(events, answers, strict=True):
            await results.send(key=event.key, value=value, headers={"id": rid.encode()})


if __name__ == "__main__":
    app.main()
