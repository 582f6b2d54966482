"""The wire's encoder (msgspec, issue 36) writes byte for byte what the reference
encoder, ``msgpack.packb(obj, use_bin_type=True)``, writes: for any value a
message can hold, and for results made from a corpus of engine outputs."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.contract.results import _result_wire, _row_wire, encode_ok_result
from worker.contract.wire import pack
from worker.flow.values import ModelInfo, Source

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False), st.text(max_size=300), st.binary(max_size=300),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20),
        st.dictionaries(st.text(max_size=40), inner, max_size=20),
        st.dictionaries(st.binary(max_size=4), inner, max_size=3),  # bytes keys: the fallback
    ),
    max_leaves=60,
)


@settings(max_examples=1000)
@given(values)
def test_pack_writes_what_msgpack_writes(obj: Any) -> None:
    assert pack(obj) == msgpack.packb(obj, use_bin_type=True)


output = st.tuples(
    st.sampled_from(["float32", "float16", "int64", "uint8", "bool"]),
    st.lists(st.integers(0, 5), max_size=3),
    st.integers(0, 2**32 - 1),
)


@settings(max_examples=300)
@given(
    st.dictionaries(st.text(min_size=1, max_size=12), output, min_size=1, max_size=4),
    st.text(min_size=1, max_size=64),
    st.one_of(st.none(), st.dictionaries(st.text(max_size=8), scalars, max_size=4)),
    st.dictionaries(st.sampled_from(["queue", "infer", "total"]), st.integers(0, 10**9)),
)
def test_results_are_the_reference_encoders_bytes(
    outs: dict[str, tuple[str, list[int], int]],
    request_id: str,
    meta: dict[str, Any] | None,
    timing: dict[str, int],
) -> None:
    arrays = {
        name: np.random.default_rng(seed).integers(0, 2, shape).astype(dtype)
        for name, (dtype, shape, seed) in outs.items()
    }
    model, source = ModelInfo("m", "v1"), Source("in", 3, 2**40)
    wire = _result_wire(1, request_id, "ok", {n: _row_wire(a) for n, a in arrays.items()},
                        None, model, source, timing, meta)  # fmt: skip
    want = msgpack.packb(wire, use_bin_type=True)
    assert encode_ok_result(request_id, arrays, model, source, timing, meta) == want
