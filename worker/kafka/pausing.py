"""Which of the consumer's partitions are paused: the backpressure over the
offset tracker's in-flight counts, one decision per priority lane, or, where
several models share the consumer, per model (each input topic's rank its
model's), so one model's backlog pauses only its topics. A model the control
topic brings joins it with its topics (``admit``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition as KafkaTP

from worker.config import KafkaConfig
from worker.flow.lanes import LaneBackpressure
from worker.flow.messages import TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.lanefetch import apply_backpressure, lane_of
from worker.kafka.urgentfetch import UrgentFetcher
from worker.obs import metrics


class Pausing:
    """The backpressure and each input topic's rank in it."""

    def __init__(self, kafka: KafkaConfig, backpressure: LaneBackpressure, tracker: OffsetTracker,
                 ranks: Mapping[str, int] | None = None) -> None:  # fmt: skip
        """``ranks``: several models, each input topic's place in the
        backpressure (its model's); none: the topics' priority lanes."""
        self._kafka = kafka
        self.backpressure = backpressure
        self._tracker = tracker
        self._rank_of = dict(ranks or {})
        self.apart = bool(self._rank_of)  # several models, each paused on its own

    def rank(self, tp: KafkaTP | TopicPartition) -> int:
        """The partition's lane, or its model's place where several models are served."""
        return self._rank_of.get(tp.topic, 0) if self._rank_of else lane_of(self._kafka, tp)

    def paused(self, tp: KafkaTP) -> bool:
        return self.backpressure.is_paused(self.rank(tp))

    def admit(self, topics: Sequence[str], bounds: tuple[int, int], label: str,
              like: str | None = None, alone: tuple[str, Sequence[str]] | None = None,
              ) -> None:  # fmt: skip
        """A model's ``topics`` (one the control topic brought, or a served one
        given more) paused on the model's counts: those of its topic ``like``
        where it has one, else its own at ``bounds`` (records, bytes). ``alone``:
        the one model served until now and the topics it reads, paused on the
        worker's counts so far (as one lane), from now on on its own."""
        if like is not None:
            if self._rank_of:  # (one model, one lane: every topic's rank 0)
                self._rank_of.update(dict.fromkeys(topics, self._rank_of[like]))
            return
        if not self.apart:
            assert alone is not None and len(self.backpressure.lanes) == 1, "one model, no lanes"
            name, read = alone  # its one decision now its own: the same bounds, its state kept
            self._rank_of = dict.fromkeys(read, 0)
            self.backpressure.apart, self.backpressure.labels = True, [name]
            self.apart = True
        rank = self.backpressure.admit(bounds, label)
        self._rank_of.update(dict.fromkeys(topics, rank))

    def apply(self, client: AIOKafkaConsumer, positioning: set[KafkaTP],
              urgent: UrgentFetcher | None) -> None:  # fmt: skip
        """Pause or resume for what is in flight now (``positioning``: partitions
        kept paused until positioned; ``urgent``: the most urgent lane's fetcher)."""
        records, nbytes = self._tracker.in_flight(), self._tracker.in_flight_bytes
        metrics.INFLIGHT_RECORDS.set(records)
        metrics.INFLIGHT_BYTES.set(nbytes)
        bp = self.backpressure
        counts = (
            self._tracker.in_flight_by(self.rank, len(bp.lanes)) if bp.apart
            else [(records, nbytes)]
        )  # fmt: skip
        apply_backpressure(client, self._kafka, bp, counts, positioning, urgent, self.rank)
