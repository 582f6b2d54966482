"""Reading two result topics (and, for labels, the input topic) from the
beginning without a consumer group, into a ``Comparison`` as records arrive."""

from __future__ import annotations

from worker.contract import decode_request
from worker.contract.oip import decode_oip_request
from worker.flow.errors import InvalidRequest, WorkerError
from worker.kafka.credentials import Connection
from worker.kafka.registry_results import RegistryResults
from worker.ops.compare.join import Comparison
from worker.ops.compare.results import SIDES, ResultRow, Side
from worker.ops.topics import Collected, Collector, Draining


async def read_results(
    bootstrap: Connection,
    topics: dict[Side, str],
    comparison: Comparison,
    *,
    input_topic: str | None = None,
    label_key: str | None = None,
    idle_timeout: float = 2.0,
    timeout: float = 60.0,
    isolation_level: str = "read_uncommitted",
    registry: RegistryResults | None = None,
) -> bool:
    """Read both result topics (and ``input_topic``, with each request's
    ``meta[label_key]``) from the beginning into ``comparison``; True when they
    went quiet (no new record for ``idle_timeout`` seconds, counted from the
    first completed fetch) within ``timeout``, False when the report covers only
    what was read by then. As ``verify`` does, it stops on quiet rather than
    at end offsets the embedded broker answers wrongly; records are turned into
    rows and dropped as they arrive."""
    if idle_timeout <= 0 or timeout <= 0:
        raise ValueError("idle_timeout and timeout must be > 0")
    names = [topics[side] for side in SIDES]
    if len(set(names)) < 2 or input_topic in names:
        raise ValueError("the baseline, candidate and input topics must all differ")
    feed = _Feed(topics, comparison, input_topic, label_key, idle_timeout)
    collector = Collector(
        bootstrap, [*names, *([input_topic] if input_topic else [])],
        isolation_level=isolation_level, registry=registry,
    )  # fmt: skip
    await collector.start()
    try:
        complete = await collector.collect(feed.quiet, timeout, progress=feed.drain)
    finally:
        await collector.stop()
    feed.drain(collector)  # anything fetched after the last progress call
    return complete


class _Feed(Draining):
    """Turns records into rows (and labels) and drops them."""

    def __init__(
        self,
        topics: dict[Side, str],
        comparison: Comparison,
        input_topic: str | None,
        label_key: str | None,
        idle_timeout: float,
    ) -> None:
        self._side = {topic: side for side, topic in topics.items()}
        self._comparison = comparison
        self._input = input_topic
        self._label_key = label_key
        super().__init__(idle_timeout)

    def take(self, topic: str, rec: Collected) -> None:
        if topic == self._input:
            self._comparison.label((topic, rec.partition, rec.offset), self._label(rec))
            return
        side = self._side[topic]
        try:
            result = rec.result()
        except (ValueError, WorkerError):
            self._comparison.unreadable(side)
            return
        self._comparison.add(side, ResultRow.of(result, self._label_key))

    def _label(self, rec: Collected) -> object:
        """The request's ``meta[label_key]``, also from a request the worker
        refuses (its meta is recovered), or None."""
        if self._label_key is None:
            return None
        json = rec.headers.get("content-type", b"").startswith(b"application/json")
        try:
            if rec.value[:1] == b"\x00" and rec.registry is not None:  # a registry format's
                meta = rec.registry.request(rec.value).get("meta")
            elif json:
                meta = decode_oip_request(rec.value).request.meta
            else:
                meta = decode_request(rec.value).meta
        except InvalidRequest as exc:
            meta = exc.meta
        except (ValueError, WorkerError):
            return None
        return None if meta is None else meta.get(self._label_key)
