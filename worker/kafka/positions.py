"""Where a newly assigned partition is read from: the group's committed offset,
or the beginning where there is none; decided explicitly by the consumer
(``worker.kafka.consumer.Consumer.start_at_committed``), then claimed by the
crash guard where one protects the partitions."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition as KafkaTP

from worker.flow.messages import TopicPartition
from worker.kafka.guarded import Protection


async def position_at_committed(
    client: AIOKafkaConsumer,
    tps: list[KafkaTP],
    committed_at: dict[TopicPartition, int],
    protection: Protection | None,
) -> None:
    """Seek each of ``tps`` to its committed offset (noted in ``committed_at``:
    its lag's base until this member commits it), the others to the
    beginning; then the crash guard's claim of their heads."""
    fresh = []
    for tp in tps:
        committed = await client.committed(tp)
        if committed is None:
            fresh.append(tp)
        else:
            client.seek(tp, committed)
            committed_at[TopicPartition(tp.topic, tp.partition)] = committed
    if fresh:
        await client.seek_to_beginning(*fresh)
    if protection is not None and tps:
        heads = {TopicPartition(t.topic, t.partition): await client.position(t) for t in tps}
        await protection.claim(heads)
