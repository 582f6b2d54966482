"""The state changelog of a stateful model (``kafka.state_topic``).

After a request of a sequence is answered, the sequence's next state is written
to a compacted topic, keyed by the sequence (the request's record key), on the
partition whose number is the request's input partition (the topics are
co-partitioned), with the input offset it reflects. A sequence that ended
(``sequence_end``) is a tombstone. Under exactly-once the records go in the
transaction that carries the answers and the input offsets; under at-least-once
an offset counts as done only once its answer and its state are acknowledged.

When a partition is assigned, ``restore`` reads its changelog partition from the
beginning to its end (committed transactions only, under exactly-once), the last
record per key winning, and the stage takes the states over before any record
of the partition is processed. A state older than ``model.state_ttl_s`` (by the
record's timestamp) is not restored: the sequence had expired.

Value: msgpack ``{"v": 1, "topic": str, "offset": int, "states": {name: tensor}}``
(tensors as in the wire contract).
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition as KafkaTP

from worker.config import KafkaConfig
from worker.contract.limits import DEFAULT_LIMITS
from worker.contract.tensors import decode_tensor
from worker.flow.deadline import Deadline
from worker.flow.errors import BrokerUnavailable, WorkerError
from worker.flow.messages import Job, StateChange
from worker.flow.values import Tensor
from worker.kafka.credentials import connection

log = structlog.get_logger(__name__)

States = dict[bytes, dict[str, np.ndarray]]


def encode_state(job: Job, change: StateChange) -> bytes | None:
    """The changelog value for ``job``'s sequence after it (None: a tombstone)."""
    if change.values is None:
        return None
    states = {name: Tensor.from_numpy(np.ascontiguousarray(v)).to_wire()
              for name, v in change.values.items()}  # fmt: skip
    value: bytes = msgpack.packb(
        {"v": 1, "topic": job.tp.topic, "offset": job.offset, "states": states}
    )
    return value


def decode_state(value: bytes) -> dict[str, np.ndarray]:
    """A changelog value's states by input name; raises ``ValueError``."""
    obj = msgpack.unpackb(value, raw=False)
    if not isinstance(obj, dict) or obj.get("v") != 1 or not isinstance(obj.get("states"), dict):
        raise ValueError("not a state changelog record (v1)")
    limits = DEFAULT_LIMITS
    return {
        str(name): decode_tensor(raw, f"states.{name}", limits).to_numpy().copy()
        for name, raw in obj["states"].items()
    }


async def restore(
    k: KafkaConfig, partitions: list[int], ttl_s: float, read_committed: bool
) -> dict[int, States]:
    """Every live state of the changelog's ``partitions``, by partition."""
    if not partitions:
        return {}
    topic = k.state_topic
    consumer = AIOKafkaConsumer(
        **connection(k),
        enable_auto_commit=False,
        isolation_level="read_committed" if read_committed else "read_uncommitted",
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    await consumer.start()
    out: dict[int, States] = {p: {} for p in partitions}
    oldest_ms = (time.time() - ttl_s) * 1000.0
    skipped = 0
    try:
        tps = [KafkaTP(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        pending = set(tps)
        limit_s = max(60.0, k.request_timeout_s)
        budget = Deadline(limit_s)
        while pending:
            batch = await consumer.getmany(*pending, timeout_ms=200)
            for tp, records in batch.items():
                for r in records:
                    skipped += _apply(out[tp.partition], r, oldest_ms)
            for tp in list(pending):
                # The end, as the last fetch answered it (end_offsets is not
                # reliable on every broker: the embedded one answers it wrongly).
                end = consumer.last_stable_offset(tp) if read_committed else None
                end = consumer.highwater(tp) if end is None or end < 0 else end
                if end is not None and await consumer.position(tp) >= end:
                    pending.discard(tp)
            if pending and not batch and budget.expired:
                raise BrokerUnavailable(
                    f"kafka.state_topic: {topic} could not be read to its end within "
                    f"{limit_s:.0f} s (partitions {sorted(tp.partition for tp in pending)})"
                )
    finally:
        await consumer.stop()
    if skipped:
        log.warning("state_records_skipped", records=skipped, topic=topic,
                    reason="not a state changelog record")  # fmt: skip
    return out


def _apply(states: States, record: Any, oldest_ms: float) -> int:
    """One changelog record into ``states``; 1 when it could not be read."""
    key = record.key
    if key is None:
        return 1
    if record.value is None or record.timestamp < oldest_ms:
        states.pop(key, None)  # ended, or idle past the TTL
        return 0
    try:
        states[key] = decode_state(record.value)
    except (ValueError, TypeError, WorkerError, msgpack.UnpackException):
        return 1
    return 0
