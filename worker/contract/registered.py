"""What every Schema Registry format shares (docs/guides/schema-registry.md): the
wire framing (a zero magic byte, the schema's id in 4 bytes, big-endian, then the
record), a request record's fields mapped onto the answering model's inputs, and
a result as the record every format writes. The formats themselves: Avro
(``worker.contract.avro``) and JSON Schema (``worker.contract.jsonschema``).

A request record's fields, by name:

- ``id`` (string, required), ``deadline_ms`` (integer), ``model`` and
  ``model_version`` (string: the model a request names, as msgpack's
  ``model``), ``meta`` (map of strings, echoed), ``sequence_start`` and
  ``sequence_end`` (boolean): as the msgpack request's; any of them may be
  null or absent;
- every other field that names an input of the answering model is that input
  (any other field is left alone: a topic's schema evolves for every reader of
  it, and a field added for another is no error): an array of numbers or
  booleans (nested arrays give the shape; a flat one takes the shape of a field
  ``NAME_shape``, else the model input's fixed shape) becomes a tensor of the
  item type's dtype (the format says which; integers for an image input are its
  uint8 pixels); bytes an image file where the input is an image, else the
  input's raw tensor (its dtype and fixed shape); a string a text. A null
  leaves the input out.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import numpy as np

from worker.flow.errors import InvalidRequest, UndecodableRecord
from worker.flow.values import EncodedImage, ModelRef, Request, Result, Tensor, sniff_format

MAGIC: Final = b"\x00"
HEADER_BYTES: Final = 5
RESERVED: Final = (
    "id", "deadline_ms", "model", "model_version", "meta", "sequence_start", "sequence_end",
)  # fmt: skip
# The dtypes an array field's items may have, in wire form (little-endian).
WIRE: Final = {name: np.dtype(name).newbyteorder("<")
               for name in ("float32", "float64", "int32", "int64", "bool", "uint8")}  # fmt: skip
_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The registry formats the worker reads and answers in (schema_registry.formats),
# by the registry's schemaType.
Format = Literal["avro", "jsonschema", "protobuf"]
FORMATS: Final[dict[str, Format]] = {"AVRO": "avro", "JSON": "jsonschema", "PROTOBUF": "protobuf"}


@dataclass(frozen=True)
class InputsView:
    """What a request's answerer takes, by input name: which inputs are images,
    and each tensor input's dtype and row shape where every dimension is fixed."""

    names: frozenset[str]  # every input it takes
    images: frozenset[str]
    fixed: Mapping[str, tuple[str, tuple[int, ...]]]


def schema_id(value: bytes) -> int | None:
    """The schema id of a record in the registry's wire format, else None."""
    if len(value) < HEADER_BYTES or value[:1] != MAGIC:
        return None
    return int.from_bytes(value[1:HEADER_BYTES], "big")


# --- requests ------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """What a request schema says a field is."""

    kind: str  # "array", "bytes", "string" or "other"
    dtype: str = ""  # an array's items' (a key of WIRE), where the schema says
    nested: bool = False  # an array of arrays


# A field its schema does not describe (made once: a frozen dataclass per record
# cost 0.4 us).
_OTHER: Final = Field("other")


class RequestSchema(Protocol):
    """A request schema of one format, as the registry holds it, read once by id."""

    @property
    def schema_id(self) -> int: ...

    @property
    def format(self) -> Format: ...

    @property
    def fields(self) -> Mapping[str, Field]: ...

    def read(self, value: bytes) -> dict[str, Any]:
        """The record's fields; ``UndecodableRecord`` where the bytes are not one."""
        ...


def request_of(record: Mapping[str, Any], schema: RequestSchema, takes: InputsView) -> Request:
    """The request a record of ``schema`` is (see the module docstring); ``takes``:
    the answering model's inputs."""
    rid = record.get("id")
    if not isinstance(rid, str):
        raise UndecodableRecord(f"schema {schema.schema_id}: the record has no string field id")
    meta = record.get("meta")
    meta = meta if isinstance(meta, dict) else None
    inputs: dict[str, Any] = {}
    for name, value in record.items():
        # A field no input of the answerer takes is another reader's (a topic's schema
        # evolves for all of them): left alone. An input no field gives: the model's
        # check names it.
        if name in RESERVED or value is None or name not in takes.names:
            continue
        try:
            field = schema.fields.get(name, _OTHER)
            inputs[name] = _input(name, value, field, record.get(f"{name}_shape"), takes)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"inputs.{name[:64]}: {exc}", request_id=rid, meta=meta) from exc
    model = record.get("model")
    version = record.get("model_version")
    deadline = record.get("deadline_ms")
    return Request(
        v=1, id=rid, inputs=inputs, deadline_ms=deadline if isinstance(deadline, int) else None,
        meta=meta, sequence_start=bool(record.get("sequence_start")),
        sequence_end=bool(record.get("sequence_end")),
        model=ModelRef(model, version if isinstance(version, str) else None)
        if isinstance(model, str) else None,
    )  # fmt: skip


def _input(name: str, value: Any, field: Field, shape: Any, takes: InputsView) -> Any:
    if isinstance(value, str):
        return value
    fixed = takes.fixed.get(name)
    if isinstance(value, bytes):
        if name in takes.images:
            fmt = sniff_format(value)
            if fmt is None:
                raise ValueError("bytes that are not an image file the worker reads")
            return EncodedImage(fmt, value)
        if fixed is None:
            raise ValueError("bytes for an input that is no image and no tensor of a fixed "
                             "shape (send an array)")  # fmt: skip
        dtype, row = fixed
        return Tensor(dtype, row, value)  # its size is checked against the shape here
    if isinstance(value, list):
        if not field.dtype:  # an array of no numeric item type
            return Tensor.from_numpy(np.asarray(value))
        # An image's pixels (integers 0..255): uint8, as a msgpack request sends them.
        dtype = "uint8" if name in takes.images and field.dtype.startswith("int") else field.dtype
        # Straight into wire form (little-endian, C order): no dtype look-ups per record.
        arr = np.array(value, dtype=WIRE[dtype])
        if shape is not None:
            arr = arr.reshape([int(d) for d in shape])
        elif (arr.ndim == 1 and not field.nested and fixed is not None
              and len(fixed[1]) != 1 and arr.size == int(np.prod(fixed[1]))):  # fmt: skip
            arr = arr.reshape(fixed[1])
        # The array itself, as a pipeline step's are (``ModelInputs`` checks both): no
        # wire tensor made for bytes nobody reads back.
        return arr
    raise ValueError(f"a {type(value).__name__} is not a model input")


# --- results -------------------------------------------------------------------

OutputDesc = tuple[str, tuple[Any, ...]] | None  # an output's dtype and shape, if declared


@functools.lru_cache(maxsize=1024)
def field_name(output: str) -> str:
    """An output's field: its name where the formats take it (Avro's names), else
    with ``_`` for each character it does not."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", output)
    return name if _NAME.fullmatch(name) else f"_{name}"


def result_record(result: Result) -> dict[str, Any]:
    """A result's envelope as every format writes it (outputs apart: ``output_value``)."""
    return {
        "v": result.v, "id": result.id, "status": result.status,
        "model": {"name": result.model.name, "version": result.model.version},
        "error": None if result.error is None
        else {"code": result.error.code, "message": result.error.message},
        "source": {"topic": result.source.topic, "partition": result.source.partition,
                   "offset": result.source.offset},
        "timing_us": dict(result.timing_us),
        "meta": None if result.meta is None
        else {str(k): str(v) for k, v in result.meta.items()},
        "partial": None if result.partial is None
        else {"skipped": list(result.partial.get("skipped", [])),
              "failed": list(result.partial.get("failed", []))},
    }  # fmt: skip


def output_value(given: Any, typed: bool) -> dict[str, Any]:
    """An output as every format writes it: ``{shape, values}`` (typed, C order),
    or ``{shape, dtype, data}`` (its wire bytes)."""
    tensor = given if isinstance(given, Tensor) else None
    arr = tensor.to_numpy() if tensor is not None else np.asarray(given)
    value: dict[str, Any] = {"shape": list(arr.shape)}
    if typed:
        value["values"] = arr.reshape(-1).tolist()
    else:
        tensor = tensor or Tensor.from_numpy(arr)
        value["dtype"], value["data"] = tensor.dtype, tensor.data
    return value


class ResultEncoder(Protocol):
    """Results of one format, under its registered result schema."""

    def encode(self, result: Result, arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
        """``arrays``: the outputs as the stage gave them, instead of the result's."""
        ...

    def encode_ok(self, record: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
        """An ok answer (the hot path): its envelope as ``ok_record`` made it, and
        its outputs as the stage gave them."""
        ...


def ok_record(
    request_id: str, model_name: str, version: str, topic: str, partition: int, offset: int,
    timing_us: Mapping[str, int], meta: Mapping[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """An ok answer's envelope, as ``result_record`` makes it, without a ``Result``."""
    return {
        "v": 1, "id": request_id, "status": "ok",
        "model": {"name": model_name, "version": version}, "error": None,
        "source": {"topic": topic, "partition": partition, "offset": offset},
        "timing_us": timing_us,
        "meta": None if meta is None else {str(k): str(v) for k, v in meta.items()},
        "partial": None,
    }  # fmt: skip


def outputs_of(result: Result, arrays: Mapping[str, np.ndarray] | None) -> Mapping[str, Any]:
    """A result's outputs: the stage's arrays where given (no wire tensors made)."""
    return result.outputs if arrays is None else arrays
