"""``ok`` answers in Avro on the hot path (issue 67): the result record written
by fastavro field by field into one buffer, the fields that repeat from one
answer to the next encoded once, by fastavro, and reused.

An ok answer of one model differs from the next in its id, its offset, its
timings, its meta and its outputs: ``v``, ``status``, the model, the null error
and partial, the source's topic and partition, and an output the answer lacks
(a null branch) repeat. An Avro record's binary is its fields' binaries in
schema order (the specification's binary encoding of records), so those pieces
joined with the varying fields, each written by fastavro with its field's type,
are byte for byte fastavro's whole record. Start-up checks that on a sample of
the schema (``OkPieces.of`` refuses otherwise, and the whole record is written
each time); a unit test checks it on varied answers
(``tests/unit/contract/test_avro_ok.py``).

Why (``benchmarks.registry_codec``, profiled with cProfile before this): of the
14.6 us an answer took, fastavro's writer was 11, about 5 of them the envelope
(three nested records, each checked against its schema's field names per write,
and three null unions, each resolved by validating the value against every
branch), 5 the two outputs' values (each float dispatched on its type alone).
The values go as ``array.array``: fastavro writes numeric items of a Python
array in one loop, where a list's are dispatched one by one (same bytes: both
iterate to the same Python numbers). After: about 8 us an answer, 5.6 of them
here, 2.5 of those fastavro writing the 64 floats (a bytes object per float: the
floor while fastavro writes the values).

fastavro's ``_write.write_data`` (the function its ``schemaless_writer`` calls
after parsing the schema and making a buffer, both per call) is its compiled
module's, without a public name: where it is missing (a pure-Python fastavro)
``OkPieces.of`` refuses and the whole record is written as before.
"""

from __future__ import annotations

import array
import importlib
import io
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple

import numpy as np

from worker.contract.registered import field_name, output_value
from worker.flow.values import Tensor

# The result envelope's fields in the order ``avro.result_schema`` declares them;
# the outputs follow.
ENVELOPE: Final = ("v", "id", "status", "model", "error", "source", "timing_us", "meta",
                   "partial")  # fmt: skip
_SOURCE: Final = ("topic", "partition", "offset")
# schemaless_writer's defaults: union branches may be named by a (name, value) tuple.
_OPTIONS: Final = {"strict": False, "strict_allow_default": False,
                   "disable_tuple_notation": False}  # fmt: skip
# A cache holds at most this many pieces, then starts again (a worker answers as
# a handful of models, from a handful of partitions: bounded all the same).
_MAX_CACHED: Final = 4096
# Numeric dtypes (native byte order) whose Python array iterates to the numbers
# ``tolist`` gives: float16 and bool have no array type and go as lists.
_ARRAY_CODES: Final[dict[np.dtype[Any], str]] = {
    np.dtype(name): code for name, code in (
        ("float32", "f"), ("float64", "d"), ("int8", "b"), ("uint8", "B"), ("int16", "h"),
        ("uint16", "H"), ("int32", "i"), ("uint32", "I"), ("int64", "q"), ("uint64", "Q"))
}  # fmt: skip

WriteData = Callable[[bytearray, Any, Any, dict[str, Any], str, dict[str, Any]], None]


def avro_value(given: Any, typed: bool) -> dict[str, Any]:
    """An output's record (``registered.output_value``), its typed values as a
    Python array where its dtype has one (fastavro's fast path for arrays)."""
    if not typed or isinstance(given, Tensor):
        return output_value(given, typed)
    arr = np.asarray(given)
    code = _ARRAY_CODES.get(arr.dtype)
    if code is None:
        return output_value(arr, typed)
    return {"shape": list(arr.shape), "values": array.array(code, arr.tobytes())}


class _Output(NamedTuple):
    """An output field of the result schema, in schema order."""

    key: str  # its field's name
    avro_type: list[Any]  # [null, its record]
    branch: str  # its record's full name
    typed: bool  # values, else dtype and data
    null: bytes  # the piece of an answer without it
    branch_index: bytes  # the union's index of its record
    fields: tuple[tuple[str, Any], ...]  # its record's fields and types, in order
    values: Any  # the values' type where its record is (shape, values), else None


class OkPieces:
    """An ok answer's Avro binary (after the framing header) from pieces, under
    one parsed result schema; made by ``of``."""

    def __init__(
        self, parsed: dict[str, Any], header: bytes, outputs: Mapping[str, tuple[str, bool]],
        write_data: WriteData,
    ) -> None:  # fmt: skip
        types = {f["name"]: f["type"] for f in parsed["fields"]}
        source = {f["name"]: f["type"] for f in types["source"]["fields"]}
        self._write_data = write_data
        # The named types, as fastavro's schemaless_writer collects them per call.
        self._named: dict[str, Any] = {}
        _fastavro().parse_schema(parsed, self._named)
        self._types = types
        self._source = source
        self._header_bytes = len(header)
        self._head = bytes(header) + self._piece(1, types["v"])
        self._no_meta = self._piece(None, types["meta"])
        self._no_partial = self._piece(None, types["partial"])
        self._outputs = [
            self._output(f["name"], f["type"], *outputs[f["name"]])
            for f in parsed["fields"][len(ENVELOPE) :]
        ]
        self._models: dict[tuple[str, str], bytes] = {}
        self._sources: dict[tuple[str, int], bytes] = {}
        self._shapes: dict[tuple[str, tuple[int, ...]], bytes] = {}

    @classmethod
    def of(
        cls, parsed: dict[str, Any], header: bytes, outputs: Mapping[str, tuple[str, bool]]
    ) -> OkPieces | None:
        """Pieces for ``parsed`` (the result schema, ``outputs`` its output fields:
        branch and typed), or None where they cannot be proven to write what
        fastavro writes for the whole record (then it is written whole)."""
        write_data = getattr(importlib.import_module("fastavro._write"), "write_data", None)
        fields = [f["name"] for f in parsed["fields"]]
        source = parsed["fields"][ENVELOPE.index("source")]["type"] if len(fields) > 5 else None
        if (write_data is None or tuple(fields[: len(ENVELOPE)]) != ENVELOPE
                or set(fields[len(ENVELOPE):]) != set(outputs)
                or not isinstance(source, dict)
                or tuple(f["name"] for f in source.get("fields", ())) != _SOURCE):  # fmt: skip
            return None
        pieces = cls(parsed, header, outputs, write_data)
        return pieces if pieces._agrees(parsed) else None

    def encode(self, record: Mapping[str, Any], arrays: Mapping[str, Any]) -> bytes:
        """``record``: an ok answer's envelope as ``registered.ok_record`` makes it
        (v 1, status ok, no error, no partial); ``arrays``: its outputs by name
        (an output the schema has no field for is not sent, as in the whole
        record)."""
        write, named = self._write_data, self._named
        model, source = record["model"], record["source"]
        out = bytearray(self._head)
        write(out, record["id"], self._types["id"], named, "id", _OPTIONS)
        out += self._model(model["name"], model["version"])
        out += self._source_prefix(source["topic"], source["partition"])
        write(out, source["offset"], self._source["offset"], named, "offset", _OPTIONS)
        write(out, record["timing_us"], self._types["timing_us"], named, "timing_us", _OPTIONS)
        meta = record["meta"]
        if meta is None:
            out += self._no_meta
        else:
            write(out, meta, self._types["meta"], named, "meta", _OPTIONS)
        out += self._no_partial
        given = {field_name(name): value for name, value in arrays.items()}
        for o in self._outputs:
            value = given.get(o.key)
            if value is None:
                out += o.null
                continue
            # The union's branch, then the output record's fields (fastavro's
            # union and record writers checked the value against the schema per
            # answer: 0.6 us an output).
            out += o.branch_index
            typed_array = o.values is not None and isinstance(value, np.ndarray)
            code = _ARRAY_CODES.get(value.dtype) if typed_array else None
            if code is not None:
                # The common case: typed values of a dtype with an array type, the
                # shape's piece reused (a model's output shapes repeat).
                out += self._shape(o, value.shape)
                write(out, array.array(code, value.tobytes()), o.values, named, "values", _OPTIONS)
                continue
            fields = avro_value(value, o.typed)
            for name, avro_type in o.fields:
                write(out, fields[name], avro_type, named, name, _OPTIONS)
        return bytes(out)

    def _shape(self, output: _Output, shape: tuple[int, ...]) -> bytes:
        """An output's shape field: one piece by output and shape."""
        piece = self._shapes.get((output.key, shape))
        if piece is None:
            if len(self._shapes) >= _MAX_CACHED:
                self._shapes.clear()
            piece = self._shapes[(output.key, shape)] = self._piece(
                list(shape), output.fields[0][1]
            )
        return piece

    def _output(self, key: str, avro_type: list[Any], branch: str, typed: bool) -> _Output:
        names = [b.get("name") if isinstance(b, dict) else b for b in avro_type]
        index = names.index(branch)
        record = avro_type[index]
        record = record if isinstance(record, dict) else self._named[record]
        fields = tuple((f["name"], f["type"]) for f in record["fields"])
        plain = typed and tuple(name for name, _ in fields) == ("shape", "values")
        return _Output(
            key, avro_type, branch, typed, self._piece(None, avro_type), self._piece(index, "long"),
            fields, fields[1][1] if plain else None,
        )  # fmt: skip

    def _piece(self, value: Any, avro_type: Any) -> bytes:
        out = bytearray()
        self._write_data(out, value, avro_type, self._named, "", dict(_OPTIONS))
        return bytes(out)

    def _model(self, name: str, version: str) -> bytes:
        """status ``ok``, the model, no error: one piece by model."""
        piece = self._models.get((name, version))
        if piece is None:
            if len(self._models) >= _MAX_CACHED:
                self._models.clear()
            piece = self._models[(name, version)] = (
                self._piece("ok", self._types["status"])
                + self._piece({"name": name, "version": version}, self._types["model"])
                + self._piece(None, self._types["error"])
            )  # fmt: skip
        return piece

    def _source_prefix(self, topic: str, partition: int) -> bytes:
        """The source's topic and partition: one piece by partition."""
        piece = self._sources.get((topic, partition))
        if piece is None:
            if len(self._sources) >= _MAX_CACHED:
                self._sources.clear()
            piece = self._sources[(topic, partition)] = (
                self._piece(topic, self._source["topic"])
                + self._piece(partition, self._source["partition"])
            )  # fmt: skip
        return piece

    def _agrees(self, parsed: dict[str, Any]) -> bool:
        """Whether the pieces write fastavro's whole record for a sample answer
        with every output and a meta, and for one with neither."""
        sample = {o.key: _sample(o.avro_type) for o in self._outputs}
        for arrays, meta in ((sample, {"k": "v"}), ({}, None)):
            record = {"v": 1, "id": "r", "status": "ok", "model": {"name": "m", "version": "1"},
                      "error": None, "source": {"topic": "t", "partition": 2, "offset": 300},
                      "timing_us": {"total": 5}, "meta": meta, "partial": None}  # fmt: skip
            whole = dict(record)
            for o in self._outputs:
                if o.key in arrays:
                    whole[o.key] = (o.branch, output_value(arrays[o.key], o.typed))
            out = io.BytesIO()
            try:
                _fastavro().schemaless_writer(out, parsed, whole)
                mine = self.encode(record, arrays)[self._header_bytes :]
            except (TypeError, ValueError, KeyError):  # boundary: fastavro's, a layout not foreseen
                return False
            if mine != out.getvalue():
                return False
        return True


# A typed output's values' dtype by the Avro item type (``avro._AVRO_OF``'s inverse).
_SAMPLE_DTYPES: Final = {"float": "float32", "double": "float64", "int": "int32", "long": "int64",
                         "boolean": "bool"}  # fmt: skip


def _sample(avro_type: Any) -> np.ndarray:
    """Values an output field takes (``[null, Output_x]``): its item type's, else bytes'."""
    fields = {f["name"]: f["type"] for f in avro_type[1]["fields"]}
    items = fields["values"]["items"] if "values" in fields else None
    dtype = _SAMPLE_DTYPES.get(items, "uint8") if isinstance(items, str) else "uint8"
    return np.arange(6).astype(dtype).reshape(2, 3)


def _fastavro() -> Any:
    return importlib.import_module("fastavro")
