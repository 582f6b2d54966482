"""Which partitions are paused (``worker.kafka.pausing``) as a model comes: a
worker of one model pauses on the worker's counts (as one lane); the first
model the control topic brings with topics of its own makes each model paused
on its own counts, the first keeping its bounds and its state (paused stays
paused), the new one at its own bounds."""

from __future__ import annotations

from worker.config import KafkaConfig
from worker.flow.lanes import LaneBackpressure
from worker.flow.messages import TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.pausing import Pausing


def test_the_first_model_that_comes_makes_each_model_paused_on_its_own() -> None:
    k = KafkaConfig(input_topics=("a1", "a2"))
    tracker = OffsetTracker()
    pausing = Pausing(k, LaneBackpressure(4, 1 << 30), tracker)
    assert not pausing.apart
    pausing.backpressure.update(4, 0)  # the one model's bound reached: paused
    assert pausing.paused(TopicPartition("a1", 0))
    pausing.admit(["b"], (2, 1 << 30), "b", alone=("a", ["a1", "a2"]))
    assert pausing.apart and pausing.backpressure.labels == ["a", "b"]
    assert [pausing.rank(TopicPartition(t, 0)) for t in ("a1", "a2", "b")] == [0, 0, 1]
    assert pausing.paused(TopicPartition("a2", 0))  # its state kept
    assert not pausing.paused(TopicPartition("b", 0))
    for offset in range(2):  # b's own counts reach b's bound; a's are a's
        tracker.track(TopicPartition("b", 0), offset)
    counts = tracker.in_flight_by(pausing.rank, len(pausing.backpressure.lanes))
    assert counts == [(0, 0), (2, 0)]
    pausing.backpressure.update_each(counts)
    assert pausing.paused(TopicPartition("b", 0))
    assert not pausing.paused(TopicPartition("a1", 0))  # a resumed: nothing of its in flight
    pausing.admit(["b2"], (9, 9), "b", like="b")  # more topics for b: b's rank
    assert pausing.rank(TopicPartition("b2", 0)) == 1 and len(pausing.backpressure.lanes) == 2
