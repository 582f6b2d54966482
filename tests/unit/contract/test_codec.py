"""The codec is the worker's attack surface: every record from every client goes
through decode_request. These tests pin the contract (schemas/README.md), each
rejection path with its exact exception type and field name, and the decoder's
behaviour on hostile bytes (bombs, fuzz)."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import msgpack
import msgpack.fallback
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from worker.contract import (
    DEFAULT_LIMITS,
    DTYPES,
    ERROR_CODES,
    ErrorInfo,
    Limits,
    ModelInfo,
    ModelRef,
    Request,
    Result,
    Source,
    Tensor,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
)
from worker.flow.errors import (
    EngineDead,
    InvalidRequest,
    RecordError,
    RecordTooLarge,
    TensorTooLarge,
    UndecodableRecord,
)

# --------------------------------------------------------------------------- helpers

IMAGE = np.arange(2 * 3 * 1, dtype=np.uint8).reshape(2, 3, 1)
META = {"trace": "abc", "n": 3}


def pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def tensor_wire(arr: np.ndarray[Any, Any]) -> dict[str, Any]:
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": arr.tobytes()}


def request_wire(**changes: Any) -> dict[str, Any]:
    """A valid request map; ``changes`` replace fields, ``DROP`` removes one."""
    wire: dict[str, Any] = {
        "v": 1,
        "id": "req-1",
        "inputs": {"image": tensor_wire(IMAGE)},
        "deadline_ms": 1_700_000_000_000,
        "meta": dict(META),
    }
    for key, value in changes.items():
        if value is DROP:
            wire.pop(key, None)
        else:
            wire[key] = value
    return wire


def image_wire(**changes: Any) -> dict[str, Any]:
    """A request whose one tensor has ``changes`` applied."""
    t = tensor_wire(IMAGE)
    for key, value in changes.items():
        if value is DROP:
            t.pop(key, None)
        else:
            t[key] = value
    return request_wire(inputs={"image": t})


DROP = object()


def result_ok(**changes: Any) -> Result:
    fields: dict[str, Any] = {
        "id": "req-1",
        "status": "ok",
        "source": Source("infer.requests", 3, 42),
        "model": ModelInfo("digits", "sha256:abc"),
        "outputs": {
            "topk_indices": Tensor.from_numpy(np.array([7, 1], dtype=np.int64)),
            "topk_scores": Tensor.from_numpy(np.array([0.9, 0.05], dtype=np.float32)),
        },
        "timing_us": {"queue": 10, "preprocess": 20, "infer": 300, "d2h": 5, "total": 400},
        "meta": {"trace": "abc"},
    }
    fields.update(changes)
    return Result(**fields)


def result_error(**changes: Any) -> Result:
    fields: dict[str, Any] = {
        "status": "error",
        "outputs": {},
        "error": ErrorInfo("invalid_request", "inputs.image.shape: rank must be 1 to 4, got 5"),
        "timing_us": {},
    }
    fields.update(changes)
    return result_ok(**fields)


@contextmanager
def bounded(seconds: float = 0.5, peak_bytes: int = 2 * 1024 * 1024) -> Iterator[None]:
    """Fail if the block takes long or allocates much: what a bomb would cause."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < seconds, f"took {elapsed:.3f}s"
        assert peak < peak_bytes, f"peak allocation {peak} bytes"


def reject(value: bytes | None, exc_type: type[Exception], field: str, **limits: int) -> Any:
    """decode_request raises exactly ``exc_type`` and the message names ``field``."""
    with pytest.raises(RecordError) as info:
        decode_request(value, Limits(**limits) if limits else DEFAULT_LIMITS)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    assert field in str(info.value), str(info.value)
    return info.value


# --------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_tensor_numpy_round_trip_is_zero_copy_and_read_only(dtype: str) -> None:
    arr = (np.arange(24) % 2).astype(dtype).reshape(2, 3, 4)
    t = Tensor.from_numpy(arr)
    assert (t.dtype, t.shape, t.nbytes) == (dtype, (2, 3, 4), arr.nbytes)
    back = t.to_numpy()
    np.testing.assert_array_equal(back, arr)
    assert not back.flags.writeable
    base: Any = back
    while isinstance(base, np.ndarray):
        base = base.base
    assert base is t.data, "to_numpy must view the tensor's bytes, not copy them"


def test_from_numpy_writes_little_endian_c_order() -> None:
    big = np.array([[1, 2], [3, 4]], dtype=">i4")
    t = Tensor.from_numpy(big.T)  # non-native order and not C-contiguous
    assert t.dtype == "int32"
    assert t.data == np.array([[1, 3], [2, 4]], dtype="<i4").tobytes()
    np.testing.assert_array_equal(t.to_numpy(), big.T)


@pytest.mark.parametrize("dtype", ["uint64", "complex64", "object", "datetime64[s]"])
def test_from_numpy_rejects_dtypes_outside_the_contract(dtype: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        Tensor.from_numpy(np.zeros(2, dtype=dtype))


def test_tensor_construction_checks_bytes_against_shape() -> None:
    with pytest.raises(ValueError, match="data: float32 \\[2\\] needs 8 bytes, got 7"):
        Tensor("float32", (2,), b"\0" * 7)
    with pytest.raises(ValueError, match="dtype"):
        Tensor("float8", (1,), b"\0")
    with pytest.raises(ValueError, match="shape"):
        Tensor("uint8", (True,), b"\0")
    assert Tensor("uint8", [2], b"ab") == Tensor("uint8", (2,), b"ab")  # type: ignore[arg-type]


def test_to_wire_is_the_contract_tensor() -> None:
    assert Tensor.from_numpy(IMAGE).to_wire() == tensor_wire(IMAGE)


# --------------------------------------------------------------------------- round trips


def test_decode_request_returns_typed_request() -> None:
    req = decode_request(pack(request_wire()))
    assert req == Request(
        v=1,
        id="req-1",
        inputs={"image": Tensor.from_numpy(IMAGE)},
        deadline_ms=1_700_000_000_000,
        meta=META,
    )
    np.testing.assert_array_equal(req.inputs["image"].to_numpy(), IMAGE)


def test_optional_request_fields_may_be_absent() -> None:
    req = decode_request(pack(request_wire(deadline_ms=DROP, meta=DROP)))
    assert req.deadline_ms is None
    assert req.meta is None
    assert set(msgpack.unpackb(encode_request(req))) == {"v", "id", "inputs"}


def test_zero_sized_tensors_are_valid() -> None:
    empty = np.zeros((0, 3), dtype=np.float32)
    req = decode_request(pack(request_wire(inputs={"x": tensor_wire(empty)})))
    assert req.inputs["x"].to_numpy().shape == (0, 3)


def test_request_at_every_limit_is_accepted() -> None:
    lim = DEFAULT_LIMITS
    big = np.zeros(lim.max_tensor_bytes, dtype=np.uint8).reshape(-1, 1, 1, 1)
    wire = request_wire(
        id="x" * lim.max_id_chars,
        inputs={f"in{i}": tensor_wire(big if i == 0 else IMAGE) for i in range(lim.max_inputs)},
        meta={"pad": "y" * (lim.max_meta_bytes - len(pack({"pad": "y" * 300})) + 300)},
    )
    assert len(pack(wire["meta"])) == lim.max_meta_bytes
    req = decode_request(pack(wire))
    assert len(req.inputs) == lim.max_inputs
    assert req.inputs["in0"].nbytes == lim.max_tensor_bytes


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
meta_values = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
metas = st.dictionaries(st.text(max_size=16), meta_values, max_size=6)


@st.composite
def tensors(draw: st.DrawFn, min_rank: int = 1, max_rank: int = 4, max_side: int = 4) -> Tensor:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(
        hnp.array_shapes(min_dims=min_rank, max_dims=max_rank, min_side=0, max_side=max_side)
    )
    elements = {"allow_nan": False, "allow_infinity": False} if "float" in dtype else None
    arr = draw(hnp.arrays(np.dtype(dtype), shape, elements=elements))
    return Tensor.from_numpy(arr)


requests = st.builds(
    Request,
    v=st.just(1),
    id=st.text(min_size=1, max_size=DEFAULT_LIMITS.max_id_chars),
    inputs=st.dictionaries(
        st.text(max_size=12), tensors(), min_size=1, max_size=DEFAULT_LIMITS.max_inputs
    ),
    deadline_ms=st.none() | st.integers(min_value=0, max_value=2**64 - 1),
    meta=st.none() | metas,
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_request_round_trip(req: Request) -> None:
    if req.meta is not None and len(pack(req.meta)) > DEFAULT_LIMITS.max_meta_bytes:
        return
    assert decode_request(encode_request(req)) == req


results = st.builds(
    Result,
    id=st.text(max_size=64),
    status=st.just("ok"),
    source=st.builds(
        Source,
        st.text(min_size=1, max_size=20),
        st.integers(0, 2**31 - 1),
        st.integers(0, 2**63 - 1),
    ),
    model=st.builds(ModelInfo, st.text(max_size=20), st.text(max_size=64)),
    outputs=st.dictionaries(
        st.text(max_size=12), tensors(min_rank=0, max_rank=6, max_side=3), max_size=4
    ),
    meta=st.none() | metas,
    timing_us=st.dictionaries(st.text(max_size=10), st.integers(0, 2**63 - 1), max_size=5),
) | st.builds(
    result_error,
    id=st.text(max_size=64),
    error=st.builds(ErrorInfo, st.sampled_from(sorted(ERROR_CODES)), st.text(max_size=100)),
    meta=st.none() | metas,
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(results)
def test_result_round_trip(res: Result) -> None:
    assert decode_result(encode_result(res)) == res


def test_rank_zero_outputs_round_trip() -> None:
    res = result_ok(outputs={"score": Tensor.from_numpy(np.array(0.5, dtype=np.float32))})
    assert decode_result(encode_result(res)).outputs["score"].shape == ()


# --------------------------------------------------------------------------- results


def test_encode_result_has_exactly_the_contract_fields() -> None:
    ok = msgpack.unpackb(encode_result(result_ok()))
    assert list(ok) == ["v", "id", "status", "outputs", "model", "source", "timing_us", "meta"]
    assert ok["source"] == {"topic": "infer.requests", "partition": 3, "offset": 42}
    assert ok["model"] == {"name": "digits", "version": "sha256:abc"}
    assert ok["outputs"]["topk_indices"]["shape"] == [2]
    assert type(ok["outputs"]["topk_indices"]["data"]) is bytes  # bin, not str

    err = msgpack.unpackb(encode_result(result_error(meta=None)))
    assert "meta" not in err
    assert err["error"] == {
        "code": "invalid_request",
        "message": "inputs.image.shape: rank must be 1 to 4, got 5",
    }
    assert err["outputs"] == {}


def test_encode_result_accepts_numpy_integers() -> None:
    res = result_ok(
        source=Source("t", np.int32(1), np.int64(2)),  # type: ignore[arg-type]
        timing_us={"total": np.int64(5)},
    )
    wire = msgpack.unpackb(encode_result(res))
    assert wire["source"]["offset"] == 2
    assert wire["timing_us"] == {"total": 5}


def test_result_status_and_error_must_agree() -> None:
    with pytest.raises(ValueError, match="error"):
        result_ok(error=ErrorInfo("internal", "x"))
    with pytest.raises(ValueError, match="error"):
        result_ok(status="error")
    with pytest.raises(ValueError, match="status"):
        result_ok(status="maybe")


def test_error_info_only_takes_contract_codes() -> None:
    with pytest.raises(ValueError, match=r"error\.code"):
        ErrorInfo("engine_dead", "boom")


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (InvalidRequest("id: missing"), "invalid_request", "id: missing"),
        (TensorTooLarge("inputs.x: too big"), "too_large", "inputs.x: too big"),
        (EngineDead("/dev/nvidia0 lost"), "internal", "internal error (EngineDead)"),
        (KeyError("/secret/path"), "internal", "internal error (KeyError)"),
    ],
)
def test_error_info_from_error(exc: BaseException, code: str, message: str) -> None:
    assert ErrorInfo.from_error(exc) == ErrorInfo(code, message)


def test_error_info_from_error_bounds_the_message() -> None:
    info = ErrorInfo.from_error(InvalidRequest("x" * 100_000))
    assert len(info.message) == 1024


def result_wire(**changes: Any) -> dict[str, Any]:
    wire: dict[str, Any] = msgpack.unpackb(encode_result(result_error()))
    for key, value in changes.items():
        if value is DROP:
            wire.pop(key, None)
        else:
            wire[key] = value
    return wire


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        (result_wire(extra=1), "extra: unknown field"),
        (result_wire(source=DROP), "source: missing"),
        (result_wire(v=2), "v: unsupported version"),
        (result_wire(v=True), "v: unsupported version"),
        (result_wire(id=1), "id: expected str"),
        (result_wire(status="fine"), "status"),
        (result_wire(error=DROP), "error"),
        (result_wire(error={"code": "nope", "message": ""}), "error.code"),
        (result_wire(error={"code": "internal"}), "error"),
        (result_wire(model={"name": "m"}), "model"),
        (result_wire(source={"topic": "t", "partition": True, "offset": 1}), "source.partition"),
        (result_wire(source={"topic": "t", "partition": 0, "offset": -1}), "source.offset"),
        (result_wire(timing_us={"total": 1.5}), "timing_us.total"),
        (result_wire(meta=[1]), "meta"),
        (result_wire(outputs={"o": {"dtype": "uint8", "shape": [2], "data": b"a"}}), "outputs.o"),
        (
            result_wire(outputs={"o": {"dtype": "u8", "shape": [1], "data": b"a"}}),
            "outputs.o.dtype",
        ),
        (result_wire(outputs={"o": {"dtype": "uint8", "shape": [1]}}), "outputs.o"),
    ],
)
def test_decode_result_rejects_broken_results(wire: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        decode_result(pack(wire))
    assert field in str(info.value)


@pytest.mark.parametrize(
    "value", [b"", b"\xc1", pack([1]), pack({1: 2}), pack({}) + b"\x00", b"\x81\xa1a"]
)
def test_decode_result_rejects_garbage_as_undecodable(value: bytes) -> None:
    with pytest.raises(UndecodableRecord):
        decode_result(value)


# --------------------------------------------------------------------------- DLQ paths


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (None, "empty"),
        (b"", "empty"),
        (b"\xc1", "not a msgpack record"),  # never-used byte
        (b"\x81\xa1a", "not a msgpack record"),  # truncated
        (pack(request_wire()) + b"\xc0", "not a msgpack record"),  # trailing data
        (pack([request_wire()]), "top level is array"),
        (pack(7), "top level is int"),
        (pack("hello"), "top level is str"),
        (pack(b"\x00"), "top level is bin"),
        (pack(None), "top level is nil"),
        (pack({1: "v"}), "not a msgpack record"),  # int key: strict_map_key
        (pack({(1, 2): "v"}), "not a msgpack record"),  # array key
        (pack({b"v": 1, b"id": "x"}), "top-level keys must be str"),
        (b"\x81\xa1v\xa2\xff\xfe", "not a msgpack record"),  # invalid UTF-8 in a str
        (pack(request_wire(meta={"t": msgpack.ExtType(1, b"abc")})), "ext"),
        (pack(request_wire(meta={"t": msgpack.ExtType(5, b"")})), "ext type 5"),
        (pack(request_wire(meta={"t": msgpack.Timestamp(1, 0)})), "ext"),
        (pack(image_wire(data=msgpack.ExtType(2, IMAGE.tobytes()))), "ext"),
        (pack(request_wire(id="x" * 4097)), "max_str_len"),
        (pack(image_wire(shape=[1] * 65)), "max_array_len"),
        (pack(request_wire(meta={str(i): i for i in range(65)})), "max_map_len"),
    ],
)
def test_unanswerable_records_are_undecodable(value: bytes | None, field: str) -> None:
    reject(value, UndecodableRecord, field)


def test_oversized_record_is_rejected_before_decoding() -> None:
    value = pack(request_wire())
    err = reject(value, RecordTooLarge, "limit is 100", max_record_bytes=100)
    assert err.code == "too_large"
    # Exactly at the limit decodes: the check is on the record's own length.
    decode_request(value, Limits(max_record_bytes=len(value)))


def test_oversized_record_is_not_decoded_at_all() -> None:
    garbage = b"\xc1" * (DEFAULT_LIMITS.max_record_bytes + 1)  # would be a FormatError
    reject(garbage, RecordTooLarge, "bytes")


# --------------------------------------------------------------------------- bombs


def bin32_header(n: int) -> bytes:
    return b"\xc6" + struct.pack(">I", n)


def prefix_of(wire: dict[str, Any]) -> bytes:
    """The encoding of ``wire`` up to its last value, which must be nil and is
    cut off: appending raw bytes then puts them exactly in that position, so a
    bomb can sit inside an otherwise valid request."""
    packed = pack(wire)
    assert packed.endswith(b"\xc0")
    return packed[:-1]


IN_DATA = prefix_of(
    {
        "v": 1,
        "id": "req-1",
        "inputs": {"image": {"dtype": "uint8", "shape": [2, 3, 1], "data": None}},
    }
)
IN_META = prefix_of({"v": 1, "id": "req-1", "inputs": {"image": tensor_wire(IMAGE)}, "meta": None})
DEEP = 100_000

BOMBS = {
    "map header of 2**31 entries": b"\xdf" + struct.pack(">I", 2**31) + b"\xa1a\x01",
    "array header of 2**31 items": b"\xdd" + struct.pack(">I", 2**31) + b"\x01",
    "str header of 2**31 bytes": b"\xdb" + struct.pack(">I", 2**31) + b"xx",
    "bin header of 2**31 bytes": bin32_header(2**31) + b"xx",
    "bin header of 2**31 bytes as tensor data": IN_DATA + bin32_header(2**31) + b"xx",
    "bin header of 5 MiB as tensor data": IN_DATA + bin32_header(5 << 20) + b"xx",
    "map header of 2**31 entries in meta": IN_META + b"\xdf" + struct.pack(">I", 2**31),
    "array header of 2**31 items in meta": IN_META + b"\x81\xa1k\xdd" + struct.pack(">I", 2**31),
    "100000 nested arrays": b"\x91" * DEEP + b"\xc0",
    "100000 nested maps": b"\x81\xa1k" * DEEP + b"\xc0",
    "100000 nested arrays in meta": IN_META + b"\x81\xa1k" + b"\x91" * DEEP + b"\xc0",
}


def test_bomb_envelopes_are_otherwise_valid() -> None:
    """The in-request bombs must reach msgpack's limits, not fail earlier on a
    slip in the hand-built bytes: with a small payload in place they decode."""
    req = decode_request(IN_DATA + pack(IMAGE.tobytes()))
    assert req.inputs["image"].data == IMAGE.tobytes()
    assert decode_request(IN_META + pack({"k": [None]})).meta == {"k": [None]}


@pytest.mark.parametrize("bomb", list(BOMBS.values()), ids=list(BOMBS))
def test_bombs_are_undecodable_quickly_and_cheaply(bomb: bytes) -> None:
    assert len(bomb) < DEFAULT_LIMITS.max_record_bytes
    with bounded(), pytest.raises(UndecodableRecord) as info:
        decode_request(bomb)
    assert type(info.value) is UndecodableRecord


@pytest.mark.parametrize("bomb", list(BOMBS.values()), ids=list(BOMBS))
def test_bombs_are_undecodable_results_too(bomb: bytes) -> None:
    with bounded(), pytest.raises(UndecodableRecord):
        decode_result(bomb)


@pytest.mark.parametrize(
    "bomb",
    [
        BOMBS["100000 nested arrays"],
        BOMBS["100000 nested maps"],
        BOMBS["100000 nested arrays in meta"],
        BOMBS["map header of 2**31 entries"],
    ],
)
def test_pure_python_msgpack_is_handled_too(bomb: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where msgpack's C extension is missing, its fallback recurses and raises
    RecursionError for deep nesting; that must become UndecodableRecord too."""
    monkeypatch.setattr(msgpack, "unpackb", msgpack.fallback.unpackb)
    with pytest.raises(UndecodableRecord):
        decode_request(bomb)


def test_deepest_meta_msgpack_decodes_can_be_echoed() -> None:
    """msgpack's decoder and encoder both stop at 1024 levels, so any meta that
    decodes also re-encodes: the echo in the result cannot fail."""
    depth = next(
        n for n in range(1100, 0, -1) if _decodes(IN_META + b"\x81\xa1k" + b"\x91" * n + b"\xc0")
    )
    assert depth > 1000
    req = decode_request(IN_META + b"\x81\xa1k" + b"\x91" * depth + b"\xc0")
    res = result_ok(meta=req.meta)
    echoed = decode_result(encode_result(res)).meta
    assert pack(echoed) == pack(req.meta)  # == on 1000-deep lists overflows Python's stack


def _decodes(value: bytes) -> bool:
    try:
        decode_request(value)
    except UndecodableRecord:
        return False
    return True


# --------------------------------------------------------------------------- fuzz


@settings(max_examples=1000)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_record_errors(value: bytes) -> None:
    with suppress(RecordError):
        decode_request(value)


@settings(max_examples=1000)
@given(st.data())
def test_corrupted_requests_only_raise_record_errors(data: st.DataObject) -> None:
    """Random bytes rarely get past msgpack; flipping bytes of a valid request
    reaches the validation paths behind it."""
    value = bytearray(pack(request_wire()))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(value)))
    with suppress(RecordError):
        decode_request(bytes(value[:cut]))


@settings(max_examples=500)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_value_errors_for_results(value: bytes) -> None:
    with suppress(ValueError, UndecodableRecord):
        decode_result(value)


# --------------------------------------------------------------------------- contract violations


def huge_meta() -> dict[str, Any]:
    return {"pad": "x" * DEFAULT_LIMITS.max_meta_bytes}


INVALID: list[tuple[dict[str, Any], str]] = [
    # v
    (request_wire(v=DROP), "v: missing; supported versions: 1"),
    (request_wire(v=2), "v: unsupported version 2; supported versions: 1"),
    (request_wire(v=0), "v: unsupported version 0"),
    (request_wire(v=True), "v: expected int, got bool"),
    (request_wire(v="1"), "v: expected int, got str"),
    (request_wire(v=1.0), "v: expected int, got float"),
    # unknown fields
    (request_wire(deadline=5), "deadline: unknown field"),
    # id
    (request_wire(id=DROP), "id: missing"),
    (request_wire(id=7), "id: expected str, got int"),
    (request_wire(id=b"req"), "id: expected str, got bin"),
    (request_wire(id=""), "id: length must be 1 to 256, got 0"),
    (request_wire(id="x" * 257), "id: length must be 1 to 256, got 257"),
    # deadline_ms
    (request_wire(deadline_ms=True), "deadline_ms: expected int"),
    (request_wire(deadline_ms=None), "deadline_ms: expected int (absolute epoch ms), got nil"),
    (request_wire(deadline_ms=1.5), "deadline_ms: expected int"),
    (request_wire(deadline_ms="soon"), "deadline_ms: expected int"),
    (request_wire(deadline_ms=-1), "deadline_ms: must be >= 0, got -1"),
    # meta
    (request_wire(meta=None), "meta: expected a map, got nil"),
    (request_wire(meta=[1, 2]), "meta: expected a map, got array"),
    (request_wire(meta={b"k": 1}), "meta: keys must be str, got bin"),
    (request_wire(meta=huge_meta()), "meta: 4104 bytes when encoded; the limit is 4096"),
    # inputs
    (request_wire(inputs=DROP), "inputs: missing"),
    (request_wire(inputs=[tensor_wire(IMAGE)]), "inputs: expected a map"),
    (request_wire(inputs={}), "inputs: expected 1 to 8 tensors, got 0"),
    (
        request_wire(inputs={f"i{n}": tensor_wire(IMAGE) for n in range(9)}),
        "inputs: expected 1 to 8 tensors, got 9",
    ),
    (request_wire(inputs={b"image": tensor_wire(IMAGE)}), "inputs: tensor names must be str"),
    (
        request_wire(inputs={"image": IMAGE.tobytes()}),
        "inputs.image: bin is not a JPEG, PNG or WebP file",
    ),
    # tensor fields
    (image_wire(dtype=DROP), "inputs.image.dtype: missing"),
    (image_wire(shape=DROP), "inputs.image.shape: missing"),
    (image_wire(data=DROP), "inputs.image.data: missing"),
    (image_wire(layout="HWC"), "inputs.image.layout: unknown field"),
    (image_wire(dtype=1), "inputs.image.dtype: expected str, got int"),
    (image_wire(dtype="uint64"), "inputs.image.dtype: unsupported 'uint64'"),
    (image_wire(dtype="complex64"), "inputs.image.dtype: unsupported 'complex64'"),
    (image_wire(shape="2,3,1"), "inputs.image.shape: expected a list of ints, got str"),
    (image_wire(shape=[]), "inputs.image.shape: rank must be 1 to 4, got 0"),
    (image_wire(shape=[1, 1, 2, 3, 1]), "inputs.image.shape: rank must be 1 to 4, got 5"),
    (image_wire(shape=[2, True, 3]), "inputs.image.shape[1]: expected int, got bool"),
    (image_wire(shape=[2, 3.0, 1]), "inputs.image.shape[1]: expected int, got float"),
    (image_wire(shape=[2, -3, -1]), "inputs.image.shape[1]: must be >= 0, got -3"),
    (image_wire(data=IMAGE.tobytes().decode()), "inputs.image.data: expected msgpack bin, got str"),
    (image_wire(data=[0] * 6), "inputs.image.data: expected msgpack bin, got array"),
    (
        image_wire(data=IMAGE.tobytes()[:-1]),
        "inputs.image.data: uint8 [2, 3, 1] needs 6 bytes, got 5",
    ),
    (
        image_wire(data=IMAGE.tobytes() + b"\0"),
        "inputs.image.data: uint8 [2, 3, 1] needs 6 bytes, got 7",
    ),
    (image_wire(shape=[3, 3, 1]), "inputs.image.data: uint8 [3, 3, 1] needs 9 bytes, got 6"),
    (image_wire(dtype="float32"), "inputs.image.data: float32 [2, 3, 1] needs 24 bytes, got 6"),
    (image_wire(dtype="bool"), "inputs.image.data: bool values must be 0 or 1"),
    # model
    (request_wire(model="digits"), "model: expected a map {name, version?}, got str"),
    (request_wire(model={}), "model.name: missing"),
    (request_wire(model={"version": "a"}), "model.name: missing"),
    (request_wire(model={"name": "d", "tag": 1}), "model.tag: unknown field; model has name"),
    (request_wire(model={"name": 7}), "model.name: expected str, got int"),
    (request_wire(model={"name": ""}), "model.name: length must be 1 to 256, got 0"),
    (request_wire(model={"name": "d", "version": None}), "model.version: expected str, got nil"),
    (request_wire(model={"name": "d", "version": "v" * 257}), "model.version: length must be"),
]


@pytest.mark.parametrize(("wire", "message"), INVALID, ids=[m for _, m in INVALID])
def test_contract_violations_are_invalid_requests_naming_the_field(
    wire: dict[str, Any], message: str
) -> None:
    err = reject(pack(wire), InvalidRequest, message)
    assert err.code == "invalid_request"


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_floats_are_invalid(dtype: str, bad: float) -> None:
    arr = np.ones((2, 3), dtype=dtype)
    arr[1, 2] = bad
    wire = request_wire(inputs={"ok": tensor_wire(IMAGE), "pixels": tensor_wire(arr)})
    reject(pack(wire), InvalidRequest, "inputs.pixels.data: non-finite values")


def test_float16_overflowing_to_inf_is_caught_on_its_own_width() -> None:
    """65504 is float16's max; the byte pattern 0x7c00 is +Inf in float16 but a
    perfectly finite number in any wider reading of the same bytes."""
    data = np.array([65504.0], dtype=np.float16).tobytes() + b"\x00\x7c"
    wire = request_wire(inputs={"x": {"dtype": "float16", "shape": [2], "data": data}})
    reject(pack(wire), InvalidRequest, "inputs.x.data: non-finite")


def test_invalid_request_echoes_a_valid_id_and_meta() -> None:
    err = reject(pack(image_wire(shape=[7])), InvalidRequest, "inputs.image")
    assert err.request_id == "req-1"
    assert err.meta == META


def test_invalid_request_echoes_nothing_unusable() -> None:
    err = reject(pack(request_wire(id="", meta=huge_meta())), InvalidRequest, "id:")
    assert err.request_id == ""
    assert err.meta is None


def test_invalid_request_with_unsupported_version_still_echoes_id() -> None:
    wire = {"v": 2, "id": "req-9", "inputs": "whatever v2 says", "new_field": 1}
    err = reject(pack(wire), InvalidRequest, "supported versions: 1")
    assert err.request_id == "req-9"


def test_huge_names_are_truncated_in_messages() -> None:
    name = "n" * 4000
    wire = request_wire(inputs={name: {"dtype": "uint8", "shape": [1], "data": b""}})
    err = reject(pack(wire), InvalidRequest, "inputs.nnnn")
    assert len(str(err)) < 300


def test_tensor_over_the_limit_is_too_large_with_the_id() -> None:
    big = np.zeros((64, 64), dtype=np.float32)  # 16 KiB
    wire = request_wire(inputs={"image": tensor_wire(big)})
    err = reject(
        pack(wire),
        TensorTooLarge,
        "inputs.image: float32 [64, 64] is 16384 bytes",
        max_tensor_bytes=16383,
    )
    assert err.code == "too_large"
    assert err.request_id == "req-1"
    decode_request(pack(wire), Limits(max_tensor_bytes=16384))


def test_declared_shape_over_the_limit_is_too_large_whatever_the_data() -> None:
    wire = image_wire(shape=[2**64 - 1] * 4)  # the product would overflow int64
    reject(pack(wire), TensorTooLarge, "inputs.image")


def test_other_limits_are_configurable() -> None:
    reject(
        pack(request_wire()), InvalidRequest, "inputs.image.shape: rank must be 1 to 2", max_rank=2
    )
    reject(
        pack(request_wire(id="abcd")), InvalidRequest, "id: length must be 1 to 3", max_id_chars=3
    )
    reject(
        pack(request_wire()),
        InvalidRequest,
        "meta: 14 bytes when encoded; the limit is 13",
        max_meta_bytes=13,
    )
    two = request_wire(inputs={"a": tensor_wire(IMAGE), "b": tensor_wire(IMAGE)})
    reject(pack(two), InvalidRequest, "inputs: expected 1 to 1 tensors", max_inputs=1)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"max_rank": 0}, "limits.max_rank"),
        ({"max_inputs": True}, "limits.max_inputs"),
        ({"max_map_len": 4}, "limits.max_map_len"),
        ({"max_array_len": 3}, "limits.max_array_len"),
    ],
)
def test_limits_are_validated(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Limits(**changes)


def test_exception_types_are_what_the_pipeline_routes_on() -> None:
    """consume.py sends UndecodableRecord (incl. RecordTooLarge) to the DLQ and
    answers InvalidRequest (incl. TensorTooLarge); the two must not overlap."""
    assert not issubclass(InvalidRequest, UndecodableRecord)
    assert not issubclass(UndecodableRecord, InvalidRequest)
    assert issubclass(RecordTooLarge, UndecodableRecord)
    assert issubclass(TensorTooLarge, InvalidRequest)


@pytest.mark.parametrize(("start", "end"), [(True, False), (False, True), (True, True)])
def test_sequence_flags_round_trip_in_both_encodings(start: bool, end: bool) -> None:
    from worker.contract.oip import decode_oip_request
    from worker.contract.oip_client import encode_oip_request

    t = Tensor.from_numpy(np.zeros(3, np.float32))
    request = Request(v=1, id="s", inputs={"x": t}, sequence_start=start, sequence_end=end)
    back = decode_request(encode_request(request))
    assert (back.sequence_start, back.sequence_end) == (start, end)
    oip = decode_oip_request(encode_oip_request(request)).request
    assert (oip.sequence_start, oip.sequence_end) == (start, end)
    assert oip.meta is None  # the flags are read, not echoed


def test_a_sequence_flag_that_is_not_a_boolean_is_refused() -> None:
    import msgpack

    raw = msgpack.packb({"v": 1, "id": "s", "inputs": {"x": Tensor.from_numpy(
        np.zeros(1, np.float32)).to_wire()}, "sequence_end": 1})  # fmt: skip
    with pytest.raises(InvalidRequest, match="sequence_end: expected true or false"):
        decode_request(raw)


@pytest.mark.parametrize("version", [None, "sha256:0a1b"])
def test_the_model_a_request_names_round_trips_in_both_encodings(version: str | None) -> None:
    from worker.contract.oip import decode_oip_request
    from worker.contract.oip_client import encode_oip_request

    t = Tensor.from_numpy(np.zeros(3, np.float32))
    request = Request(v=1, id="m", inputs={"x": t}, model=ModelRef("churn", version))
    assert decode_request(encode_request(request)).model == ModelRef("churn", version)
    oip = decode_oip_request(encode_oip_request(request)).request
    assert oip.model == ModelRef("churn", version) and oip.meta is None
    assert decode_request(encode_request(Request(v=1, id="m", inputs={"x": t}))).model is None


def test_an_oip_version_without_a_model_name_is_refused() -> None:
    from worker.contract.oip import decode_oip_request

    body = {"id": "m", "model_version": "1",
            "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    with pytest.raises(InvalidRequest, match="model_version: names a version of the model"):
        decode_oip_request(json.dumps(body).encode())
    with pytest.raises(InvalidRequest, match="model_name: expected str, got int"):
        decode_oip_request(json.dumps({**body, "model_name": 3}).encode())
