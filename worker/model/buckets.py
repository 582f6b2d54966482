"""Batch buckets: the few batch sizes a GPU engine is compiled, warmed and captured for.

A compiled engine (and each CUDA graph) is specialised to a shape. Running a
batch of a size it has not seen makes torch re-specialise or recompile on the
hot path (TorchScript's first call at a new batch size took 58 ms median, up to
168 ms, against 4.4 ms warm on an H100), so a request would wait on it. Instead
every batch is padded up to the next bucket, and every bucket is run before the
worker joins its consumer group. The padded rows hold whatever the slot's input
buffer held; rows are independent in inference, and only the first ``n`` rows
of the outputs are read.

Buckets are ``batching.preferred_batch_sizes`` when given (the sizes the
operator tuned for), else the powers of two below ``max_batch_size``; the
maximum itself is always one. Powers of two waste at most half a batch of
compute on padding, and keep the count (and so start-up time and graph memory)
at ``log2(max) + 1``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def bucket_sizes(max_batch_size: int, preferred: Sequence[int] = ()) -> tuple[int, ...]:
    """Ascending bucket sizes for a stage whose batches hold at most ``max_batch_size``."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if any(not 1 <= p <= max_batch_size for p in preferred):
        raise ValueError(f"preferred sizes {list(preferred)} must lie in 1..{max_batch_size}")
    if preferred:
        sizes = set(preferred)
    else:
        sizes = {1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size}
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``rows`` (``buckets`` ascending)."""
    if rows < 1:
        raise ValueError(f"a batch has at least one row, got {rows}")
    i = bisect.bisect_left(buckets, rows)
    if i == len(buckets):
        raise ValueError(f"{rows} rows exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def slot_buckets(buckets: Sequence[int], rows: int, min_rows: int = 1) -> tuple[int, ...]:
    """The buckets one slot runs: those of ``buckets`` that fit its ``rows`` (the
    slot's buffer), raised to ``min_rows`` (an engine's smallest batch), and
    ``rows`` itself, so every batch the slot can hold has a bucket."""
    if not 1 <= min_rows <= rows:
        raise ValueError(f"a slot of {rows} rows cannot run batches of at least {min_rows}")
    return tuple(sorted({max(b, min_rows) for b in buckets if b < rows} | {rows}))
