"""Batch buckets: which padded sizes a compiled GPU engine is warmed and captured for."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from worker.model.shapes import bucket_for, bucket_sizes, slot_buckets


def test_powers_of_two_up_to_the_maximum() -> None:
    assert bucket_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert bucket_sizes(1) == (1,)
    # A maximum that is no power of two is a bucket of its own.
    assert bucket_sizes(48) == (1, 2, 4, 8, 16, 32, 48)


def test_preferred_sizes_replace_the_powers_and_the_maximum_is_kept() -> None:
    assert bucket_sizes(64, (16, 8, 16)) == (8, 16, 64)
    assert bucket_sizes(64, (64,)) == (64,)
    with pytest.raises(ValueError, match=r"1\.\.64"):
        bucket_sizes(64, (0,))
    with pytest.raises(ValueError, match=r"1\.\.64"):
        bucket_sizes(64, (65,))
    with pytest.raises(ValueError, match=">= 1"):
        bucket_sizes(0)


def test_a_batch_goes_to_the_smallest_bucket_that_holds_it() -> None:
    buckets = bucket_sizes(64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert bucket_for(9, (8, 16, 64)) == 16
    assert bucket_for(1, (8, 16, 64)) == 8
    with pytest.raises(ValueError, match="exceed"):
        bucket_for(65, buckets)
    with pytest.raises(ValueError, match="at least one"):
        bucket_for(0, buckets)


@given(
    max_batch=st.integers(1, 512),
    preferred=st.lists(st.integers(1, 512), max_size=6),
    data=st.data(),
)
def test_every_batch_fits_with_bounded_padding(
    max_batch: int, preferred: list[int], data: st.DataObject
) -> None:
    preferred = [p for p in preferred if p <= max_batch]
    buckets = bucket_sizes(max_batch, preferred)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == max_batch
    rows = data.draw(st.integers(1, max_batch))
    bucket = bucket_for(rows, buckets)
    assert bucket >= rows and bucket in buckets
    if not preferred:  # powers of two: never more than half the bucket is padding
        assert bucket < 2 * rows or bucket == 1


def test_a_slot_runs_the_buckets_that_fit_it_and_its_own_size() -> None:
    assert slot_buckets((1, 2, 4, 8, 16, 32, 64), 64) == (1, 2, 4, 8, 16, 32, 64)
    # A slot smaller than the largest bucket gets its own size as the last bucket.
    assert slot_buckets((1, 2, 4, 8, 16, 32, 64), 24) == (1, 2, 4, 8, 16, 24)
    # An engine whose smallest batch is 4 (a TensorRT profile): smaller buckets rise to it.
    assert slot_buckets((1, 2, 4, 8, 64), 64, min_rows=4) == (4, 8, 64)
    # A static engine: one bucket.
    assert slot_buckets((1, 2, 4, 8), 8, min_rows=8) == (8,)
    with pytest.raises(ValueError, match="cannot run"):
        slot_buckets((1, 2), 4, min_rows=5)


@given(
    st.lists(st.integers(1, 256), max_size=8),
    st.integers(1, 256),
    st.integers(1, 256),
)
def test_every_batch_a_slot_holds_has_a_bucket_within_it(
    preferred: list[int], rows: int, min_rows: int
) -> None:
    assume(min_rows <= rows)
    buckets = slot_buckets(preferred, rows, min_rows)
    assert buckets[-1] == rows and buckets[0] >= min_rows
    for n in range(min_rows, rows + 1):
        assert n <= bucket_for(n, buckets) <= rows
