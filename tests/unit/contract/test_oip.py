"""Open Inference Protocol v2 JSON: requests decoded into the contract's Request,
every way one can be wrong named, and results encoded as OIP responses."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from tests.images import encode
from worker.contract import EncodedImage, ErrorInfo, ModelInfo, Source, Tensor
from worker.contract.limits import Limits
from worker.contract.oip import decode_oip_request, encode_oip_result
from worker.flow.errors import InvalidRequest, RecordTooLarge, TensorTooLarge, UndecodableRecord


def body(**extra: Any) -> dict[str, Any]:
    return {
        "id": "42",
        "inputs": [
            {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3.5, 4]},
            {"name": "ids", "shape": [1, 3], "datatype": "INT64", "data": [[7, 8, 9]]},
        ],
        **extra,
    }


def raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def test_a_request_becomes_the_contract_s_request() -> None:
    oip = decode_oip_request(
        raw(body(parameters={"deadline_ms": 123, "tenant": "a"}, outputs=[{"name": "score"}]))
    )
    req = oip.request
    assert (req.id, req.deadline_ms, req.meta) == ("42", 123, {"tenant": "a"})
    assert oip.outputs == ("score",)
    features, ids = req.inputs["features"], req.inputs["ids"]
    assert isinstance(features, Tensor) and isinstance(ids, Tensor)
    assert (features.dtype, features.shape) == ("float32", (1, 4))
    assert ids.to_numpy().tolist() == [[7, 8, 9]]


def test_texts_and_base64_image_files_travel_as_bytes() -> None:
    png = encode(np.zeros((4, 4, 3), np.uint8), "PNG")
    b64 = base64.b64encode(png).decode()
    req = decode_oip_request(raw({"id": "t", "inputs": [
        {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["How do I reset it?"]},
        {"name": "image", "shape": [1], "datatype": "BYTES", "data": [b64],
         "parameters": {"content_type": "base64"}},
    ]})).request  # fmt: skip
    assert req.inputs["text"] == "How do I reset it?"
    assert req.inputs["image"] == EncodedImage("png", png)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"{not json", "not a JSON record"),
        (b"[1, 2]", "top level is an array"),
        (b"", "empty"),
        (b"[" * 100_000 + b"]" * 100_000, "not a JSON record"),
    ],
)
def test_what_is_not_a_json_object_goes_to_the_dlq(value: bytes, message: str) -> None:
    with pytest.raises(UndecodableRecord, match=message):
        decode_oip_request(value)


def test_a_record_over_the_size_limit_is_refused_before_parsing() -> None:
    with pytest.raises(RecordTooLarge):
        decode_oip_request(b"{" + b" " * 2000 + b"}", Limits(max_record_bytes=1000))


def entry(**change: Any) -> dict[str, Any]:
    e = {"name": "x", "shape": [2], "datatype": "INT32", "data": [1, 2]}
    e.update(change)
    return {k: v for k, v in e.items() if v is not None}


BAD: list[tuple[dict[str, Any], type[InvalidRequest], str]] = [
    ({"id": "1", "inputs": [], "extra": 1}, InvalidRequest, "extra: unknown field"),
    ({"id": "1", "inputs": []}, InvalidRequest, "inputs: expected a non-empty list"),
    ({"id": 5, "inputs": [entry()]}, InvalidRequest, "id: expected a string"),
    ({"id": "1", "inputs": [entry(datatype="UINT64")]}, InvalidRequest,
     "inputs.x.datatype: 'UINT64' is not one of BYTES"),
    ({"id": "1", "inputs": [entry(data=[1, 2, 3])]}, InvalidRequest,
     r"inputs.x.data: 3 values for shape \[2\]"),
    ({"id": "1", "inputs": [entry(data=[1.5, 2])]}, InvalidRequest, "INT32 takes integers"),
    ({"id": "1", "inputs": [entry(data=[1, 2**40])]}, InvalidRequest, "out of INT32's range"),
    ({"id": "1", "inputs": [entry(datatype="FP32", data=[1, float("nan")])]}, InvalidRequest,
     "non-finite"),
    ({"id": "1", "inputs": [entry(datatype="BOOL", data=[1, 0])]}, InvalidRequest,
     "BOOL values must be true or false"),
    ({"id": "1", "inputs": [entry(datatype="FP32", data=["a", "b"])]}, InvalidRequest,
     "inputs.x.data"),
    ({"id": "1", "inputs": [entry(shape=None)]}, InvalidRequest, "inputs.x.shape: missing"),
    ({"id": "1", "inputs": [entry(), entry()]}, InvalidRequest, "inputs.x: given twice"),
    ({"id": "1", "inputs": [entry(datatype="BYTES", shape=[2], data=["a", "b"])]},
     InvalidRequest, r"BYTES takes one string per request"),
    ({"id": "1", "inputs": [entry(datatype="BYTES", shape=[1], data=["!!"],
                                  parameters={"content_type": "base64"})]},
     InvalidRequest, "not base64"),
    ({"id": "1", "inputs": [entry(datatype="BYTES", shape=[1], data=["aGVsbG8="],
                                  parameters={"content_type": "base64"})]},
     InvalidRequest, "not a JPEG, PNG or WebP"),
    ({"id": "1", "inputs": [entry(datatype="FP64", shape=[600_000], data=[0.0] * 600_000)]},
     TensorTooLarge, "the limit is"),
    ({"id": "1", "parameters": {"deadline_ms": "soon"}, "inputs": [entry()]}, InvalidRequest,
     "parameters.deadline_ms"),
]  # fmt: skip


@pytest.mark.parametrize(("obj", "error", "message"), BAD)
def test_a_bad_request_is_an_error_answer_naming_the_field(
    obj: dict[str, Any], error: type[InvalidRequest], message: str
) -> None:
    with pytest.raises(error, match=message) as caught:
        decode_oip_request(raw(obj))
    assert type(caught.value) is error
    assert caught.value.request_id == (obj["id"] if isinstance(obj["id"], str) else "")


def test_results_are_oip_responses() -> None:
    model, source = ModelInfo("ranker", "abc"), Source("in", 2, 17)
    ok = json.loads(encode_oip_result(
        "42", model, source, {"queue": 5, "total": 9}, {"tenant": "a"},
        outputs={"score": np.array([0.25], np.float32), "label": np.array(3, np.int64)},
    ))  # fmt: skip
    assert ok["id"] == "42" and ok["model_name"] == "ranker" and ok["model_version"] == "abc"
    assert ok["outputs"] == [
        {"name": "score", "shape": [1, 1], "datatype": "FP32", "data": [0.25]},
        {"name": "label", "shape": [1], "datatype": "INT64", "data": [3]},
    ]
    assert ok["parameters"] == {
        "status": "ok", "source": {"topic": "in", "partition": 2, "offset": 17},
        "timing_us": {"queue": 5, "total": 9}, "meta": {"tenant": "a"},
    }  # fmt: skip
    err = json.loads(encode_oip_result(
        "42", model, source, {}, None, error=ErrorInfo("invalid_request", "inputs.x: missing")
    ))  # fmt: skip
    assert err["error"] == "inputs.x: missing" and "outputs" not in err
    assert err["parameters"]["code"] == "invalid_request" and err["parameters"]["status"] == "error"


def test_requests_and_responses_match_their_json_schemas() -> None:
    import jsonschema

    from tests.unit.contract.test_schemas import load

    request_schema, response_schema = load("oip-request.json"), load("oip-response.json")
    for schema in (request_schema, response_schema):
        jsonschema.Draft202012Validator.check_schema(schema)
    requests = [body(), body(parameters={"deadline_ms": 5}, outputs=[{"name": "score"}])]
    for obj in requests:
        decode_oip_request(raw(obj))  # what the worker takes, the schema takes
        assert list(jsonschema.Draft202012Validator(request_schema).iter_errors(obj)) == []
    bad = body()
    bad["inputs"][0]["datatype"] = "UINT64"
    assert list(jsonschema.Draft202012Validator(request_schema).iter_errors(bad))
    model, source = ModelInfo("m", "v"), Source("in", 0, 1)
    ok = encode_oip_result("1", model, source, {"total": 1}, None,
                           outputs={"y": np.ones(2, np.float32)})  # fmt: skip
    err = encode_oip_result("1", model, source, {}, None, error=ErrorInfo("too_large", "big"))
    validator = jsonschema.Draft202012Validator(response_schema)
    for value in (ok, err):
        errors = list(validator.iter_errors(json.loads(value)))
        assert errors == [], errors
