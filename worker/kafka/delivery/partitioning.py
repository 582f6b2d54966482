"""Which partition a keyed record goes to: Kafka's default partitioner
(murmur2 of the key, as the Java client and aiokafka's ``DefaultPartitioner``
compute it), for a whole batch of keys at once.

aiokafka computes murmur2 byte by byte in Python, about 4-5 us for a 19-byte
key: some 5% of the worker's CPU per record in a backlog drain (issue 36).
Here the keys of one length are hashed together, one numpy operation per
4-byte word column over all of them; a length shared by few keys is hashed
one key at a time with the same arithmetic. A property test holds both equal
to aiokafka's partitioner for any key.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

_SEED: Final = 0x9747B28C
_M: Final = 0x5BD1E995
_MASK: Final = 0xFFFFFFFF
_WORDS: Final = [struct.Struct(f"<{n}I") for n in range(65)]
# Fewer keys of one length than this are hashed one by one (numpy's per-call
# cost is larger than the work for a handful).
_VECTOR_FROM: Final = 8


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 of ``data`` (a 32-bit unsigned value)."""
    length = len(data)
    h = _SEED ^ length
    words = length >> 2
    packed = _WORDS[words] if words < len(_WORDS) else struct.Struct(f"<{words}I")
    for word in packed.unpack_from(data):
        k = (word * _M) & _MASK
        h = ((h * _M) ^ (((k ^ (k >> 24)) * _M) & _MASK)) & _MASK
    tail = length & 3
    if tail:
        base = words << 2
        if tail == 3:
            h ^= data[base + 2] << 16
        if tail >= 2:
            h ^= data[base + 1] << 8
        h = ((h ^ data[base]) * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    return h ^ (h >> 15)


def _murmur2_many(keys: Sequence[bytes]) -> npt.NDArray[Any]:
    """murmur2 of each of ``keys``, all of one length, as uint64 (products of two
    32-bit values fit, the mask keeps 32 bits)."""
    n = len(keys[0])
    rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), n)
    h: npt.NDArray[Any] = np.full(len(keys), _SEED ^ n, dtype=np.uint64)
    words = n >> 2
    if words:
        columns = np.ascontiguousarray(rows[:, : words * 4]).view("<u4").astype(np.uint64)
        for j in range(words):
            k = (columns[:, j] * _M) & _MASK
            k = ((k ^ (k >> 24)) * _M) & _MASK
            h = ((h * _M) & _MASK) ^ k
    tail, base = n & 3, words * 4
    if tail == 3:
        h ^= rows[:, base + 2].astype(np.uint64) << 16
    if tail >= 2:
        h ^= rows[:, base + 1].astype(np.uint64) << 8
    if tail:
        h = ((h ^ rows[:, base].astype(np.uint64)) * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    return h ^ (h >> 15)


def partitions_for(keys: Sequence[bytes | None], partitions: Sequence[int]) -> list[int]:
    """The partition of each key among ``partitions`` (sorted), as aiokafka's
    ``DefaultPartitioner`` picks it: ``(murmur2(key) & 0x7fffffff) % count``; a
    record without a key goes to a random one, as there."""
    count = len(partitions)
    out = [0] * len(keys)
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        if key is None:
            out[i] = random.choice(partitions)
        else:
            by_length.setdefault(len(key), []).append(i)
    for indices in by_length.values():
        if len(indices) >= _VECTOR_FROM:
            hashes = _murmur2_many([keys[i] for i in indices])  # type: ignore[misc]
            picked = ((hashes & 0x7FFFFFFF) % count).tolist()
            for i, p in zip(indices, picked, strict=True):
                out[i] = partitions[p]
        else:
            for i in indices:
                out[i] = partitions[(murmur2(keys[i]) & 0x7FFFFFFF) % count]  # type: ignore[arg-type]
    return out
