"""The shapes a run has: its batch bucket and its length per free dimension.

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
at ``log2(max) + 1``. ``SlotShapes`` is every (batch, lengths) a GPU slot runs.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ShapeKey = tuple[int, tuple[tuple[str, int], ...]]
"""A run's shape: its batch bucket and its length per padded symbol."""


def shape_key(batch: int, lengths: Mapping[str, int]) -> ShapeKey:
    """The one key an engine files a shape's graph, context state and output
    shapes under, and finds them by (lengths in symbol order)."""
    return batch, tuple(sorted(lengths.items()))


@dataclass(frozen=True)
class SlotShapes:
    """Every shape a slot's engine runs: the batch buckets, and for each padded
    free dimension (by its symbol, ``worker.model.io``) its length buckets. Every
    combination is run (and compiled, and captured) at start-up, before the
    worker joins its group, so no request waits on a new shape; buffers are
    sized for the largest."""

    batches: tuple[int, ...]
    lengths: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (symbol, ascending buckets)

    @property
    def max_lengths(self) -> dict[str, int]:
        return {symbol: buckets[-1] for symbol, buckets in self.lengths}

    def combos(self) -> list[tuple[int, dict[str, int]]]:
        """Every (batch, lengths) a run may have, largest first (it sizes pools)."""
        lengths: list[dict[str, int]] = [{}]
        for symbol, buckets in self.lengths:
            lengths = [{**known, symbol: b} for known in lengths for b in buckets]
        out = [(batch, known) for batch in self.batches for known in lengths]
        return sorted(out, key=lambda c: (c[0], sorted(c[1].values())), reverse=True)


def dense(buffer: Any, n: int, row: tuple[int, ...]) -> Any:
    """``[n, *row]`` over the start of a buffer allocated for the largest batch and
    lengths: the layout engines read and write (CuPy, NumPy or torch arrays)."""
    return buffer.reshape(-1)[: n * math.prod(row)].reshape((n, *row))


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
