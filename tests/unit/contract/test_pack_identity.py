"""The wire's encoder (msgspec, issue 36) writes byte for byte what the reference
encoder, ``msgpack.packb(obj, use_bin_type=True)``, writes: for any value a
message can hold, and for results made from a corpus of engine outputs, ok and
error, with and without meta (the reference is the contract's map, spelled out
here)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.contract.ok_results import encode_ok_result
from worker.contract.results import encode_result
from worker.contract.wire import pack
from worker.flow.values import ErrorInfo, ModelInfo, Result, Source, Tensor

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
    # Any meta a request can carry, bytes keys included (msgpack writes those).
    st.one_of(st.none(), values.filter(lambda v: isinstance(v, dict))),
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
    wire: dict[str, Any] = {
        "v": 1, "id": request_id, "status": "ok",
        "outputs": {n: {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}
                    for n, a in arrays.items()},
        "model": {"name": "m", "version": "v1"},
        "source": {"topic": "in", "partition": 3, "offset": 2**40},
        "timing_us": timing,
    }  # fmt: skip
    if meta is not None:
        wire["meta"] = meta
    want = msgpack.packb(wire, use_bin_type=True)
    assert encode_ok_result(request_id, arrays, model, source, timing, meta) == want
    tensors = {n: Tensor.from_numpy(a) for n, a in arrays.items()}
    result = Result(id=request_id, status="ok", source=source, model=model,
                    outputs=tensors, meta=meta, timing_us=timing)  # fmt: skip
    assert encode_result(result) == want


def test_ok_results_of_foreign_byte_order_and_numpy_integers_are_the_reference_bytes() -> None:
    """Big-endian rows are written little-endian, numpy integers as ints: what the
    reference encoder writes for the converted values."""
    rows = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    timing = {"queue": np.int64(12), "total": np.uint32(40)}
    source = Source("in", np.int64(2), np.int64(9))  # type: ignore[arg-type]
    got = encode_ok_result("r", {"y": rows.astype(">f4")}, ModelInfo("m", "v1"), source,
                           timing, None)  # type: ignore[arg-type]  # fmt: skip
    want = msgpack.packb({
        "v": 1, "id": "r", "status": "ok",
        "outputs": {"y": {"dtype": "float32", "shape": [2, 3], "data": rows.tobytes()}},
        "model": {"name": "m", "version": "v1"},
        "source": {"topic": "in", "partition": 2, "offset": 9},
        "timing_us": {"queue": 12, "total": 40},
    }, use_bin_type=True)  # fmt: skip
    assert got == want


@settings(max_examples=200)
@given(
    st.text(max_size=64),
    st.text(max_size=300),
    st.one_of(st.none(), values.filter(lambda v: isinstance(v, dict))),
)
def test_error_results_are_the_reference_encoders_bytes(
    request_id: str, message: str, meta: dict[Any, Any] | None
) -> None:
    """Error results, and metas only msgpack writes (bytes keys: the fallback)."""
    error = ErrorInfo("invalid_request", message)
    result = Result(id=request_id, status="error", source=Source("in", 0, 7),
                    model=ModelInfo("m", "v1"), error=error, meta=meta,
                    timing_us={"total": 5})  # fmt: skip
    wire: dict[str, Any] = {
        "v": 1, "id": request_id, "status": "error", "outputs": {},
        "error": {"code": "invalid_request", "message": message},
        "model": {"name": "m", "version": "v1"},
        "source": {"topic": "in", "partition": 0, "offset": 7},
        "timing_us": {"total": 5},
    }  # fmt: skip
    if meta is not None:
        wire["meta"] = meta
    assert encode_result(result) == msgpack.packb(wire, use_bin_type=True)
