"""The JSON Schemas in schemas/ are the contract other languages read; these
tests keep them and worker/codec.py saying the same thing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import msgpack
import msgspec
import numpy as np
import pytest

from worker.contract import (
    DTYPES,
    ERROR_CODES,
    EncodedImage,
    ErrorInfo,
    ModelInfo,
    ModelRef,
    Request,
    Result,
    Source,
    Tensor,
    encode_request,
    encode_result,
)

SCHEMAS = Path(__file__).resolve().parents[3] / "schemas"


def load(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS / name).read_text())
    return schema


REQUEST_SCHEMA = load("request.v1.json")
RESULT_SCHEMA = load("result.v1.json")


def jsonable(obj: Any) -> Any:
    """Decoded msgpack as JSON would see it: bin has no JSON type, so bytes
    become a string (the schemas mark those fields x-msgpack-type: bin)."""
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, dict):
        return {jsonable(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [jsonable(v) for v in obj]
    return obj


def wire(value: bytes) -> Any:
    return jsonable(msgpack.unpackb(value, raw=False))


def errors(schema: dict[str, Any], instance: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [e.message for e in validator.iter_errors(instance)]


def tensor(arr: np.ndarray[Any, Any]) -> Tensor:
    return Tensor.from_numpy(arr)


REQUESTS = {
    "minimal": Request(v=1, id="r", inputs={"image": tensor(np.zeros((28, 28, 1), np.uint8))}),
    "full": Request(
        v=1,
        id="req-1",
        inputs={
            "image": tensor(np.zeros((2, 2, 3), np.float16)),
            "mask": tensor(np.ones(4, dtype=bool)),
        },
        deadline_ms=1_700_000_000_000,
        meta={"trace": "abc", "blob": b"\x00\x01", "nested": {"k": [1, 2.5, None]}},
    ),
    "image file": Request(
        v=1, id="f", inputs={"image": EncodedImage("jpeg", b"\xff\xd8\xff\xe0 a jpeg file")}
    ),
    "text": Request(v=1, id="t", inputs={"text": "How do I reset my password?"}),
    "naming a model": Request(
        v=1, id="n", inputs={"text": "a review"}, model=ModelRef("sentiment", "sha256:0a1b")
    ),
    "naming a model, any version": Request(
        v=1, id="n", inputs={"text": "a review"}, model=ModelRef("sentiment")
    ),
    "several inputs": Request(
        v=1,
        id="m",
        inputs={
            "features": tensor(np.ones(4, np.float32)),
            "ids": tensor(np.arange(12, dtype=np.int64)),
            "query": "a text beside tensors",
        },
    ),
}

SOURCE = Source("infer.requests", 0, 17)
MODEL = ModelInfo("digits", "sha256:0123")
RESULTS = {
    "ok": Result(
        id="req-1",
        status="ok",
        source=SOURCE,
        model=MODEL,
        outputs={
            "topk_indices": tensor(np.array([3, 8], dtype=np.int64)),
            "topk_scores": tensor(np.array([0.7, 0.2], dtype=np.float32)),
        },
        timing_us={"queue": 1, "preprocess": 2, "infer": 3, "d2h": 4, "total": 10},
        meta={"trace": "abc"},
    ),
    "ok without meta": Result(id="r", status="ok", source=SOURCE, model=MODEL),
    **{
        f"error {code}": Result(
            id="",
            status="error",
            source=SOURCE,
            model=MODEL,
            error=ErrorInfo(code, "inputs.image.shape: rank must be 1 to 4, got 5"),
        )
        for code in sorted(ERROR_CODES)
    },
}


@pytest.mark.parametrize("schema", [REQUEST_SCHEMA, RESULT_SCHEMA], ids=["request", "result"])
def test_schemas_are_valid_draft_2020_12(schema: dict[str, Any]) -> None:
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("req", list(REQUESTS.values()), ids=list(REQUESTS))
def test_encoded_requests_validate(req: Request) -> None:
    assert errors(REQUEST_SCHEMA, wire(encode_request(req))) == []


def test_an_input_that_is_neither_tensor_file_nor_text_fails_validation() -> None:
    instance = wire(encode_request(REQUESTS["text"]))
    instance["inputs"]["text"] = 42
    assert errors(REQUEST_SCHEMA, instance)


@pytest.mark.parametrize("res", list(RESULTS.values()), ids=list(RESULTS))
def test_encoded_results_validate(res: Result) -> None:
    assert errors(RESULT_SCHEMA, wire(encode_result(res))) == []


def test_error_code_outside_the_enum_fails_validation() -> None:
    instance = wire(encode_result(RESULTS["error invalid_request"]))
    instance["error"]["code"] = "engine_dead"
    assert errors(RESULT_SCHEMA, instance)


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.pop("error"),  # status error without error
        lambda r: r.update(status="ok"),  # error present with status ok
        lambda r: r.update(status="maybe"),
        lambda r: r.update(extra=1),
        lambda r: r["source"].update(partition=-1),
        lambda r: r["timing_us"].update(total=1.5),
        lambda r: r.update(v=2),
    ],
    ids=["missing error", "error with ok", "status", "extra", "partition", "timing", "v"],
)
def test_broken_results_fail_validation(change: Any) -> None:
    instance = wire(encode_result(RESULTS["error internal"]))
    change(instance)
    assert errors(RESULT_SCHEMA, instance)


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.pop("id"),
        lambda r: r.update(v=2),
        lambda r: r.update(v=True),
        lambda r: r.update(id=""),
        lambda r: r.update(inputs={}),
        lambda r: r.update(deadline_ms=-1),
        lambda r: r.update(deadline_ms=None),
        lambda r: r.update(deadline=5),
        lambda r: r.update(meta=[1]),
        lambda r: r["inputs"]["image"].update(dtype="uint64"),
        lambda r: r["inputs"]["image"].update(shape=[]),
        lambda r: r["inputs"]["image"].update(shape=[2, -1]),
        lambda r: r["inputs"]["image"].update(layout="HWC"),
        lambda r: r["inputs"]["image"].pop("data"),
        lambda r: r.update(model="digits"),
        lambda r: r.update(model={"version": "sha256:0a"}),
        lambda r: r.update(model={"name": "digits", "tag": "x"}),
        lambda r: r.update(model={"name": ""}),
    ],
)
def test_broken_requests_fail_validation(change: Any) -> None:
    instance = wire(encode_request(REQUESTS["full"]))
    change(instance)
    assert errors(REQUEST_SCHEMA, instance)


@pytest.mark.parametrize(
    ("schema", "cls"),
    [(REQUEST_SCHEMA, Request), (RESULT_SCHEMA, Result)],
    ids=["request", "result"],
)
def test_required_fields_match_the_dataclasses(schema: dict[str, Any], cls: type) -> None:
    """A field whose default is None is left off the wire when None, a flag whose
    default is false when false (optional); every other field is always written
    (required)."""
    # Request is a msgspec Struct (made per record), Result a dataclass.
    fields = (
        msgspec.structs.fields(cls) if issubclass(cls, msgspec.Struct) else dataclasses.fields(cls)
    )
    optional = {f.name for f in fields if f.default is None or f.default is False}
    always = {f.name for f in fields} - optional
    assert set(schema["required"]) == always
    assert set(schema["properties"]) == always | optional


def test_encoders_write_exactly_the_required_fields_when_optionals_are_unset() -> None:
    request = msgpack.unpackb(encode_request(REQUESTS["minimal"]))
    assert set(request) == set(REQUEST_SCHEMA["required"])
    result = msgpack.unpackb(encode_result(RESULTS["ok without meta"]))
    assert set(result) == set(RESULT_SCHEMA["required"])


@pytest.mark.parametrize("schema", [REQUEST_SCHEMA, RESULT_SCHEMA], ids=["request", "result"])
def test_tensor_definitions_match_the_codec(schema: dict[str, Any]) -> None:
    t = schema["$defs"]["tensor"]
    assert set(t["properties"]["dtype"]["enum"]) == DTYPES
    assert t["required"] == ["dtype", "shape", "data"]
    assert t["properties"]["data"]["x-msgpack-type"] == "bin"


def test_error_code_enum_matches_the_codec() -> None:
    assert set(RESULT_SCHEMA["properties"]["error"]["properties"]["code"]["enum"]) == ERROR_CODES


def test_readme_names_every_error_code_and_dlq_header() -> None:
    readme = (SCHEMAS / "README.md").read_text()
    for code in ERROR_CODES:
        assert f"`{code}`" in readme
    for header in (
        "error.code",
        "error.message",
        "source.topic",
        "source.partition",
        "source.offset",
        "stage",
        "worker.version",
    ):
        assert f"`{header}`" in readme


def test_a_partial_answer_is_in_the_schema_and_reads_back_in_both_formats() -> None:
    """``partial`` (an optional extension of v1): a pipeline's ok answer without
    every step; only when set, and only on an ok answer."""
    from worker.contract import decode_result
    from worker.contract.oip import encode_oip_result
    from worker.contract.oip_client import decode_oip_result

    partial = {"skipped": ["rank"], "failed": [
        {"step": "check", "code": "inference_failed", "message": "ValueError: no"}]}
    res = Result(id="g-1", status="ok", source=Source("t", 0, 7), model=ModelInfo("gated", "v"),
                 outputs={"go": Tensor.from_numpy(np.array([0], np.uint8))}, partial=partial)
    value = encode_result(res)
    assert errors(RESULT_SCHEMA, wire(value)) == []
    assert decode_result(value) == res
    plain = dataclasses.replace(res, partial=None)
    assert "partial" not in wire(encode_result(plain))  # only when set
    oip = encode_oip_result("g-1", res.model, res.source, {}, None,
                            {"go": np.array([0], np.uint8)}, partial=partial)  # fmt: skip
    assert errors(load("oip-response.json"), json.loads(oip)) == []
    assert decode_oip_result(oip).partial == partial
    with pytest.raises(ValueError, match="partial: only an ok answer is partial"):
        dataclasses.replace(res, status="error", outputs={}, error=ErrorInfo(
            "inference_failed", "x"))  # fmt: skip
