"""The worker's partitioner is aiokafka's ``DefaultPartitioner`` (murmur2 of the
key, as Kafka's Java client), for any key, whether a batch's keys are hashed
together or one by one (issue 36: hashed together, about 4x cheaper)."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner, murmur2
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.kafka.delivery import partitioning
from worker.kafka.delivery.partitioning import partitions_for

REFERENCE = DefaultPartitioner()


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_murmur2_is_kafkas(key: bytes) -> None:
    assert partitioning.murmur2(key) == murmur2(key)


@settings(max_examples=300)
@given(
    st.lists(st.one_of(st.binary(max_size=40), st.sampled_from([b"k" * 19, b"x" * 20])),
             max_size=80),
    st.integers(1, 12),
)  # fmt: skip
def test_a_batch_of_keys_lands_where_the_default_partitioner_puts_each(
    keys: list[bytes], count: int
) -> None:
    parts = list(range(count))
    assert partitions_for(keys, parts) == [REFERENCE(k, parts, parts) for k in keys]


def test_keys_of_one_length_are_hashed_together_and_equal_one_by_one() -> None:
    keys = [f"sample-{i:03d}-abcdef12".encode() for i in range(62)]  # one length: numpy
    parts = [0, 1, 2, 3, 4]
    assert partitions_for(keys, parts) == [REFERENCE(k, parts, parts) for k in keys]
    picked = partitions_for([None, None, b"a"], parts)
    assert all(p in parts for p in picked)  # no key: a random partition, as aiokafka's
