"""The values the wire contract carries, which every stage passes on: a tensor, an
image file, a request, a result and its parts (error, source, model).

They are the core's (``worker.flow``): a decoded request crosses from the
intake to the inference stage inside a ``Job``, an ``ErrorInfo`` inside an
``Answer``. How they travel (msgpack v1, Open Inference Protocol JSON, the
limits a record is decoded under) is ``worker.contract``'s, which re-exports
them for clients. Plain data with the checks that keep every instance valid;
no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from worker.flow.codes import MAX_ERROR_MESSAGE_CHARS, ErrorCode
from worker.flow.errors import WorkerError

SUPPORTED_VERSIONS: Final = (1,)

DTYPES: Final = frozenset(
    {
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "bool",
    }
)

#: Every code a result's ``error.code`` or a DLQ record's ``error.code`` header may
#: carry. One vocabulary for both, so clients and operators read the same words.
ERROR_CODES: Final = frozenset(ErrorCode)

# The wire is little-endian whatever the host is; pinning the byte order here
# means to_numpy/from_numpy are correct on big-endian hosts too.
WIRE_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    name: np.dtype(name).newbyteorder("<") for name in DTYPES
}
FLOAT_DTYPES: Final = frozenset({"float16", "float32", "float64"})
DTYPE_LIST: Final = ", ".join(sorted(DTYPES))


def is_int(x: object) -> bool:
    """True for ints that are not bools: ``True`` is an ``int`` in Python, and
    ``{"v": true}`` must not pass as version 1."""
    return isinstance(x, int) and not isinstance(x, bool)


# --- image files ------------------------------------------------------------------

ImageFormat = Literal["jpeg", "png", "webp"]

FORMATS: Final[tuple[ImageFormat, ...]] = ("jpeg", "png", "webp")


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image file as sent: decoded later, off the event loop, into the model's
    channel count (see ``worker.model.decode``)."""

    format: ImageFormat
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def sniff_format(data: bytes) -> ImageFormat | None:
    """The format named by the file's magic bytes, or None if it is none we take."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


# --- tensors, requests, results -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor as it travels: dtype name, shape, little-endian C-order bytes.

    Construction checks that the bytes fit the shape, so every ``Tensor`` in the
    process can be viewed with ``to_numpy`` without further checks.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        # A list shape would make the tensor unhashable and unequal to its own
        # decoded copy; tuple() of a tuple is the same object, so this is free.
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unsupported {self.dtype!r}; supported: {DTYPE_LIST}")
        if not all(is_int(d) and d >= 0 for d in self.shape):
            raise ValueError(f"shape: expected non-negative ints, got {self.shape!r}")
        expected = math.prod(self.shape) * WIRE_DTYPES[self.dtype].itemsize
        if len(self.data) != expected:
            raise ValueError(
                f"data: {self.dtype} {list(self.shape)} needs {expected} bytes, "
                f"got {len(self.data)}"
            )

    @classmethod
    def from_numpy(cls, arr: npt.NDArray[Any]) -> Tensor:
        """Copy ``arr`` once into wire form (C order, little-endian)."""
        a = np.asarray(arr)
        name = a.dtype.name
        if name not in DTYPES:
            raise ValueError(f"dtype: unsupported {name!r}; supported: {DTYPE_LIST}")
        data = a.astype(WIRE_DTYPES[name], copy=False).tobytes(order="C")
        return cls(name, tuple(int(d) for d in a.shape), data)

    def to_numpy(self) -> npt.NDArray[Any]:
        """A read-only view over ``data``: no copy, so decoding a 4 MiB image
        costs nothing more than msgpack's own copy out of the record."""
        return np.frombuffer(self.data, dtype=WIRE_DTYPES[self.dtype]).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}


InputValue = Tensor | EncodedImage | str
"""One request input as it travels: a tensor, an image file (msgpack bin), or a
UTF-8 string (a text input, tokenized by the worker)."""


class ModelRef(msgspec.Struct, frozen=True):
    """The model a request names, and the version it pins (None: whichever serves)."""

    name: str
    version: str | None = None


class Request(msgspec.Struct, frozen=True):
    """A validated request. ``inputs`` are checked against the limits it was
    decoded with; ``meta`` is echoed back untouched. A msgspec Struct: made per
    record (1.8 us as a frozen dataclass, 0.18 us as a Struct)."""

    v: int
    id: str
    inputs: Mapping[str, InputValue]
    deadline_ms: int | None = None
    meta: Mapping[str, Any] | None = None
    # Stateful models (the record key is the sequence): reset the sequence's
    # state before answering, and drop it after. Ignored by stateless models.
    sequence_start: bool = False
    sequence_end: bool = False
    # The model the request names (several models in one worker); None: its
    # topic's model, whichever version serves.
    model: ModelRef | None = None


@dataclass(frozen=True)
class ErrorInfo:
    """The ``error`` field of a result; ``code`` is one of ``ERROR_CODES``; the
    message is capped at ``MAX_ERROR_MESSAGE_CHARS`` here, the one place (a
    client-chosen name or an exception's text must not make it unbounded)."""

    code: str
    message: str

    def __post_init__(self) -> None:
        if self.code not in ERROR_CODES:
            raise ValueError(
                f"error.code: {self.code!r} is not in the contract; "
                f"expected one of {', '.join(sorted(ERROR_CODES))}"
            )
        if len(self.message) > MAX_ERROR_MESSAGE_CHARS:
            object.__setattr__(self, "message", self.message[:MAX_ERROR_MESSAGE_CHARS])

    @classmethod
    def from_error(cls, err: BaseException) -> ErrorInfo:
        """Map any exception onto the contract's vocabulary.

        Worker errors whose code the contract knows keep it and their message;
        anything else becomes ``internal`` and names only the exception type,
        so internal details (paths, device state) do not leak to clients.
        """
        if isinstance(err, WorkerError) and err.code in ERROR_CODES:
            return cls(err.code, str(err) or type(err).__name__)
        return cls(ErrorCode.INTERNAL, f"internal error ({type(err).__name__})")


class Source(msgspec.Struct, frozen=True):
    """Where the request came from: the idempotency key of its result. A
    msgspec Struct: one is made per answer (``Job.source``), 0.18 us against a
    frozen dataclass's 1.54 (issue 36, BENCHMARKS "A batch's size from its rows")."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class ModelInfo:
    """``version`` is the content hash of the model file, so results from
    different builds of the same model are distinguishable."""

    name: str
    version: str


@dataclass(frozen=True)
class Result:
    """One answer per request. ``error`` is set exactly when status is "error"."""

    id: str
    status: Literal["ok", "error"]
    source: Source
    model: ModelInfo
    outputs: Mapping[str, Tensor] = field(default_factory=dict)
    error: ErrorInfo | None = None
    meta: Mapping[str, Any] | None = None
    timing_us: Mapping[str, int] = field(default_factory=dict)
    v: int = 1
    # A pipeline's answer without every step (an optional extension of v1): the steps
    # that did not run for the request ("skipped": a branch not taken, or an input from
    # a step that did not run) and the optional steps that failed it ("failed": step,
    # code, message); their outputs are not in ``outputs``. None: every step ran.
    partial: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.partial is not None and self.status != "ok":
            raise ValueError("partial: only an ok answer is partial")
        if self.status not in ("ok", "error"):
            raise ValueError(f"status: expected 'ok' or 'error', got {self.status!r}")
        if (self.status == "error") != (self.error is not None):
            raise ValueError(
                f"error: must be set exactly when status is 'error' "
                f"(status={self.status!r}, error={self.error!r})"
            )

    def regions(self, name: str) -> list[npt.NDArray[Any]]:
        """A pipeline's per-region output as one array a region: read from the
        ragged layout (an optional extension of v1: ``NAME`` every region's
        values, flat, one region after another, and ``NAME.shapes``, int64
        ``[regions, rank]``, each region's shape), or from a stacked output
        (``[regions, ...]``) where there is no ``NAME.shapes``. Zero-copy views."""
        values = self.outputs[name].to_numpy()
        shapes = self.outputs.get(name + ".shapes")
        if shapes is None:
            return list(values)
        out, at = [], 0
        for shape in shapes.to_numpy().tolist():
            n = math.prod(shape)
            if at + n > values.size:
                raise ValueError(f"{name}.shapes: {shapes.shape} shapes need more than the "
                                 f"{values.size} values of {name!r}")  # fmt: skip
            out.append(values[at : at + n].reshape(shape))
            at += n
        if at != values.size:
            raise ValueError(f"{name}: {values.size} values, its shapes account for {at}")
        return out
