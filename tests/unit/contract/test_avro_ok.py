"""Avro's hot paths (issue 67) write and read what fastavro's public functions do:
an ok answer from pieces (``worker.contract.avro_ok``) byte for byte fastavro's
whole result record, for outputs of every dtype, shapes, meta, models and
partitions; a request read with the reader made once as ``schemaless_reader``
reads it."""

from __future__ import annotations

import io
import json
from typing import Any

import fastavro
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.contract.avro import AvroResults, WriterSchema, result_schema
from worker.contract.avro_ok import OkPieces
from worker.contract.registered import HEADER_BYTES, field_name, ok_record, output_value

OUTPUTS: dict[str, Any] = {
    "score": ("float32", (1,)), "logits": ("float64", ("n",)), "ids": ("int64", ("n",)),
    "small": ("int16", (2,)), "pixels": ("uint8", ("h", "w")), "mask": ("bool", ("n",)),
    "half": ("float16", ("n",)), "odd-name": None, "u32": ("uint32", ("n",)),
}  # fmt: skip
SCHEMA = result_schema("InferenceResult", "infer_worker", OUTPUTS)
RESULTS = AvroResults(SCHEMA, 9)
PARSED = fastavro.parse_schema(SCHEMA)


def _whole(record: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """The reference: fastavro's whole record, outputs as lists, each union branch
    left for fastavro to find."""
    full = dict(record)
    for name, arr in arrays.items():
        full[field_name(name)] = output_value(arr, OUTPUTS[name] is not None)
    out = io.BytesIO()
    out.write(b"\x00" + (9).to_bytes(4, "big"))
    fastavro.schemaless_writer(out, PARSED, full)
    return out.getvalue()


def _array(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    dtype = (OUTPUTS[name] or ("uint8",))[0]
    if name == "pixels":
        return rng.integers(0, 256, (n % 3 + 1, n)).astype(np.uint8)
    if dtype.startswith("float"):
        return rng.normal(size=1 if name == "score" else n).astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(info.min, int(info.max) + 1, 2 if name == "small" else n).astype(dtype)


answers = st.fixed_dictionaries({
    "outputs": st.sets(st.sampled_from(sorted(OUTPUTS))),
    "n": st.integers(0, 130), "seed": st.integers(0, 2**32 - 1),
    "id": st.text(max_size=40), "model": st.sampled_from([("m", "1"), ("ranker", "2026-11")]),
    "topic": st.sampled_from(["in", "requests-é"]), "partition": st.integers(0, 2**31 - 1),
    "offset": st.integers(0, 2**63 - 1),
    "timing": st.dictionaries(st.text(max_size=10), st.integers(0, 2**40), max_size=6),
    "meta": st.none() | st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=4),
})  # fmt: skip


@settings(max_examples=400)
@given(answers)
def test_an_ok_answer_from_pieces_is_fastavros_whole_record(a: dict[str, Any]) -> None:
    assert RESULTS._ok is not None  # the pieces in use (start-up's check passed)
    rng = np.random.default_rng(a["seed"])
    arrays = {name: _array(name, a["n"], rng) for name in sorted(a["outputs"])}
    record = ok_record(a["id"], *a["model"], a["topic"], a["partition"], a["offset"], a["timing"],
                       a["meta"])  # fmt: skip
    assert RESULTS.encode_ok(dict(record), arrays) == _whole(record, arrays)


def test_odd_arrays_and_an_output_the_schema_lacks() -> None:
    """Big-endian and strided arrays (written as lists) and an output without a
    field (not sent) write what the whole record does."""
    arrays = {"logits": np.arange(6, dtype=">f8")[::2], "ids": np.arange(8).reshape(2, 4).T,
              "extra": np.ones(3, np.float32)}  # fmt: skip
    record = ok_record("r", "m", "1", "in", 0, 1, {"total": 1}, {"k": "v"})
    expected = _whole(record, {k: v for k, v in arrays.items() if k != "extra"})
    assert RESULTS.encode_ok(dict(record), arrays) == expected


def test_a_schema_laid_out_otherwise_is_written_whole() -> None:
    """Pieces only where they are proven to write the whole record: another field
    order is refused (and the answer written whole, still the same bytes)."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["fields"][1], schema["fields"][2] = schema["fields"][2], schema["fields"][1]
    parsed = fastavro.parse_schema(schema)
    assert OkPieces.of(parsed, b"\x00\x00\x00\x00\x09", {}) is None
    results = AvroResults(schema, 9)
    assert results._ok is None
    record = ok_record("r", "m", "1", "in", 0, 1, {"total": 1}, None)
    arrays = {"score": np.array([0.5], np.float32)}
    back = fastavro.schemaless_reader(
        io.BytesIO(results.encode_ok(dict(record), arrays)[HEADER_BYTES:]), parsed, None
    )
    assert back["score"] == {"shape": [1], "values": [0.5]}
    assert (back["id"], back["status"]) == ("r", "ok")


def test_a_request_is_read_as_schemaless_reader_reads_it() -> None:
    schema = {"type": "record", "name": "Req", "namespace": "n", "fields": [
        {"name": "id", "type": "string"},
        {"name": "x", "type": {"type": "array", "items": "float"}},
        {"name": "grid", "type": {"type": "array", "items": {"type": "array", "items": "long"}}},
        {"name": "meta", "type": ["null", {"type": "map", "values": "string"}], "default": None},
        {"name": "inner", "type": ["null", {"type": "record", "name": "In", "fields": [
            {"name": "a", "type": "int"}]}], "default": None},
        {"name": "again", "type": ["null", "n.In"], "default": None},
    ]}  # fmt: skip
    parsed = fastavro.parse_schema(schema)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, parsed, {
        "id": "r1", "x": [0.5, -1.25], "grid": [[1, 2], [3, 4]], "meta": {"k": "v"},
        "inner": {"a": 3}, "again": {"a": -4}})  # fmt: skip
    reader = WriterSchema.of(3, json.dumps(schema))
    value = b"\x00\x00\x00\x00\x03" + body.getvalue()
    expected = fastavro.schemaless_reader(io.BytesIO(body.getvalue()), parsed, None)
    assert reader.read(value) == expected
    assert expected["again"] == {"a": -4}
