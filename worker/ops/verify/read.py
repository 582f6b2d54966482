"""Reading the topics: every record of the input, output and DLQ topics from the
beginning, without a consumer group (a verifier must not move anybody's
committed offsets), boiled down to the core's inputs as they arrive."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from worker.contract.dlq import DlqHeader
from worker.flow.errors import WorkerError
from worker.kafka.credentials import Connection
from worker.kafka.registry_results import RegistryResults
from worker.ops.topics import Collected, Collector, Draining
from worker.ops.verify.report import InputRecord, Kind, Reply, Unparseable


@dataclass(frozen=True, slots=True)
class Observed:
    """What ``read_topics`` found besides the inputs. ``complete`` is false when
    ``timeout`` passed before the topics went quiet: the answers may then lag
    the inputs, and a verdict from them is not to be trusted."""

    answers: tuple[Reply, ...]
    unparseable: tuple[Unparseable, ...]
    complete: bool


_DECIMAL: Final = re.compile(rb"[0-9]+")
_SOURCE_HEADERS: Final = (DlqHeader.SOURCE_TOPIC, DlqHeader.SOURCE_PARTITION,
                          DlqHeader.SOURCE_OFFSET)  # fmt: skip


def _dlq_source(headers: Mapping[str, bytes]) -> InputRecord | str:
    """The source named by a DLQ record's headers, or why there is none.

    The numbers must be plain ASCII decimals: ``int()`` would also take
    ``" 7"``, ``"+7"`` or ``"7_0"``, which no worker writes.
    """
    missing = [h for h in _SOURCE_HEADERS if h not in headers]
    if missing:
        return f"DLQ record without header(s) {', '.join(missing)}"
    try:
        topic = headers[DlqHeader.SOURCE_TOPIC].decode("ascii")
    except UnicodeDecodeError:
        return "DLQ header source.topic is not ASCII"
    numbers = []
    for name in (DlqHeader.SOURCE_PARTITION, DlqHeader.SOURCE_OFFSET):
        raw = headers[name]
        if not _DECIMAL.fullmatch(raw):
            return f"DLQ header {name} is not a decimal number: {raw[:32]!r}"
        numbers.append(int(raw))
    if not topic:
        return "DLQ header source.topic is empty"
    return InputRecord(topic, numbers[0], numbers[1])


def _result_source(rec: Collected) -> InputRecord | str:
    """A result's source, in either format (msgpack, or Open Inference Protocol
    JSON by its content-type header: ``Collected.result``)."""
    try:
        s = rec.result().source
    except (ValueError, WorkerError) as exc:
        return f"not a result: {exc}"[:300]
    return InputRecord(s.topic, s.partition, s.offset)


async def read_topics(
    bootstrap: Connection,
    input_topics: Sequence[str],
    output_topic: str,
    dlq_topic: str,
    *,
    idle_timeout: float = 2.0,
    timeout: float = 60.0,
    isolation_level: str = "read_uncommitted",
    registry: RegistryResults | None = None,
) -> tuple[dict[str, dict[int, list[int]]], Observed]:
    """Read every record of the input, output and DLQ topics from the beginning.

    No consumer group is joined, so nothing is committed and no running
    worker's group is rebalanced. The read stops once no new record has
    arrived for ``idle_timeout`` seconds, counted from the first completed
    fetch (connecting is not idleness). It does not ask the broker where the
    topics end: the embedded Tansu broker answers ``end_offsets``,
    ``seek_to_end`` and ``offsets_for_times`` wrongly, and a verifier that
    trusted them would report phantom losses. The price is that answers still
    being produced after the quiet period are missed; give ``idle_timeout``
    more than the worker's longest pause. ``registry``: reads answers in a Schema
    Registry format. With ``isolation_level``
    "read_committed" only committed transactions' records are read (the
    answers of a worker running exactly-once).

    Records are boiled down to positions as they arrive and the collector's
    buffers emptied, so memory grows with the number of records, not their
    size. Returns every partition of each input topic (empty ones included)
    with the offsets found, and the answers; an output record that does not
    decode, or a DLQ record without valid source headers, becomes an
    ``Unparseable`` entry instead of an error. The output and DLQ topic may be
    the same topic: records are then tried as results first.
    """
    if idle_timeout <= 0 or timeout <= 0:
        raise ValueError("idle_timeout and timeout must be > 0")
    inputs_unique = list(dict.fromkeys(input_topics))
    answer_topics = [t for t in dict.fromkeys((output_topic, dlq_topic)) if t not in inputs_unique]
    if len(answer_topics) < len({output_topic, dlq_topic}):
        raise ValueError("the output and DLQ topics must not be input topics")

    sorter = _Sorter(inputs_unique, output_topic, dlq_topic, idle_timeout)
    collector = Collector(
        bootstrap, [*inputs_unique, *answer_topics], isolation_level=isolation_level,
        registry=registry,
    )  # fmt: skip
    await collector.start()
    try:
        # The collector reads every partition the metadata lists: record them
        # all, so an empty input partition still shows up in the report.
        for tp in collector.partitions:
            if tp.topic in sorter.inputs:
                sorter.inputs[tp.topic].setdefault(tp.partition, [])
        complete = await collector.collect(sorter.quiet, timeout, progress=sorter.drain)
    finally:
        await collector.stop()
    sorter.drain(collector)  # anything fetched after the last progress call
    return sorter.result(complete)


class _Sorter(Draining):
    """Boils records down to request positions and answers as they arrive."""

    def __init__(
        self, input_topics: list[str], output_topic: str, dlq_topic: str, idle_timeout: float
    ) -> None:
        self.inputs: dict[str, dict[int, list[int]]] = {t: {} for t in input_topics}
        super().__init__(idle_timeout)
        self._output, self._dlq = output_topic, dlq_topic
        self._answers: list[Reply] = []
        self._unparseable: list[Unparseable] = []

    def take(self, topic: str, rec: Collected) -> None:
        if topic in self.inputs:
            self.inputs[topic].setdefault(rec.partition, []).append(rec.offset)
            return
        # A record of a topic that is both the output and the DLQ is read as either.
        reasons = []
        sides: tuple[tuple[Kind, InputRecord | str | None], ...] = (
            ("result", _result_source(rec) if topic == self._output else None),
            ("dlq", _dlq_source(rec.headers) if topic == self._dlq else None),
        )
        for kind, source in sides:
            if isinstance(source, InputRecord):
                self._answers.append(Reply(source, rec.partition, rec.offset, kind))
                return
            if source is not None:
                reasons.append(source)
        self._unparseable.append(Unparseable(topic, rec.partition, rec.offset, "; ".join(reasons)))

    def result(self, complete: bool) -> tuple[dict[str, dict[int, list[int]]], Observed]:
        for partitions in self.inputs.values():
            for offsets in partitions.values():
                offsets.sort()
        inputs = {t: dict(sorted(p.items())) for t, p in self.inputs.items()}
        return inputs, Observed(tuple(self._answers), tuple(self._unparseable), complete)
