"""What both writers are made of, and what the worker asks of either.

A writer turns completed batches into records, hands them to its producer and
settles the offsets they answer. The two writers differ in what makes an
offset committable: ``at_least_once`` marks it done once the broker
acknowledged its record, and the committer commits it later; ``exactly_once``
commits the records and their offsets together in one transaction. They are
composed of the same parts, not derived from a common class: ``Completions``
(the completed batches, in dispatch order), ``answers.Answers`` (answers turned
into records and acknowledged ones settled: encoding, refusals, the failure
budget, what to send after a failed send) and ``producing.Producing`` (the
producer). ``ResultWriter`` is what the worker calls on either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer

from worker.config import KafkaConfig
from worker.contract import ModelInfo
from worker.contract.registered import Format, ResultEncoder
from worker.flow.budget import FailureBudget
from worker.flow.messages import Completed, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.flow.streams import Woken, next_or_woken
from worker.kafka.commit import Committer
from worker.obs import metrics
from worker.obs.tracing import Tracer


class ResultWriter(Protocol):
    """What the worker asks of a writer, whichever the guarantee."""

    @property
    def producer(self) -> AIOKafkaProducer | None: ...

    async def start(self) -> None: ...

    async def existing_topics(self) -> set[str]: ...

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> Any: ...

    async def run(self) -> None: ...

    async def fence(self, revoked: set[TopicPartition]) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class WriterParts:
    """What every writer is given: the completed batches it reads, where answers
    go and for which model, the offsets it settles and who commits them."""

    completed_in: asyncio.Queue[asyncio.Future[Completed] | None]
    kafka: KafkaConfig
    # Every model and pipeline the worker answers with, by name (``Job.model``,
    # decided by the intake): what results and metrics name.
    models: Mapping[str, ModelInfo]
    tracker: OffsetTracker
    committer: Committer
    budget: FailureBudget | None = None
    tracer: Tracer | None = None
    # Each stateful model's state changelog, by name (a model not here keeps its
    # states in memory): where its answers' state records go.
    state_topics: Mapping[str, str] = field(default_factory=dict)
    # The output topic's registered result schemas by format (schema_registry): a
    # request in a registry format is answered in it.
    registered: Mapping[Format, ResultEncoder] = field(default_factory=dict)


class Completions:
    """The completed batches' futures, in dispatch order (None: the end)."""

    def __init__(self, queue: asyncio.Queue[asyncio.Future[Completed] | None]) -> None:
        self.queue = queue

    async def next_or_woken(self, wake: asyncio.Event) -> asyncio.Future[Completed] | Woken | None:
        """The next item of the queue (a batch's future, or None at the end), or
        ``WOKEN`` as soon as ``wake`` is set (records wait to be sent again)."""
        item = await next_or_woken(self.queue, wake.wait)
        if item is Woken.WOKEN:
            wake.clear()
        return item

    async def completed(self, fut: asyncio.Future[Completed]) -> Completed:
        """A batch the inference stage dispatched, once it completed: no longer in
        flight (the stage counted it in). ``EngineDead`` propagates: the worker
        stops, uncommitted."""
        completed = await fut
        metrics.INFLIGHT_BATCHES.dec()
        return completed
