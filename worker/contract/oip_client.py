"""The client side of the Open Inference Protocol JSON format (``worker.contract.oip``
is the worker's side): a contract request written as an OIP request, and an OIP
answer read as the contract's ``Result``, for ``produce``, ``consume``, the
``InferenceClient``, tests and benchmarks."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from worker.contract.oip import DATATYPES, TO_OIP, plain_json
from worker.flow.codes import ErrorCode
from worker.flow.values import EncodedImage, ErrorInfo, ModelInfo, Request, Result, Source, Tensor


def encode_oip_request(request: Request, outputs: tuple[str, ...] | None = None) -> bytes:
    """A contract request as an OIP v2 JSON request (tensors with a batch of 1,
    texts and image files as BYTES)."""
    inputs: list[dict[str, Any]] = []
    for name, value in request.inputs.items():
        if isinstance(value, str):
            inputs.append({"name": name, "shape": [1], "datatype": "BYTES", "data": [value]})
        elif isinstance(value, EncodedImage):
            inputs.append({"name": name, "shape": [1], "datatype": "BYTES",
                           "data": [base64.b64encode(value.data).decode()],
                           "parameters": {"content_type": "base64"}})  # fmt: skip
        else:
            arr = value.to_numpy()
            datatype = TO_OIP[value.dtype]
            inputs.append({"name": name, "shape": [1, *arr.shape], "datatype": datatype,
                           "data": arr.reshape(-1).tolist()})  # fmt: skip
    body: dict[str, Any] = {"id": request.id, "inputs": inputs}
    params = dict(request.meta or {})
    if request.deadline_ms is not None:
        params["deadline_ms"] = request.deadline_ms
    for flag in ("sequence_start", "sequence_end"):
        if getattr(request, flag):
            params[flag] = True
    if params:
        body["parameters"] = params
    if outputs is not None:
        body["outputs"] = [{"name": n} for n in outputs]
    if request.model is not None:
        body["model_name"] = request.model.name
        if request.model.version is not None:
            body["model_version"] = request.model.version
    return json.dumps(body, default=plain_json).encode()


def decode_oip_result(value: bytes) -> Result:
    """An OIP answer as the contract's ``Result`` (outputs without their batch of 1),
    so a client reads both formats the same way; raises ``ValueError``."""
    try:
        obj = json.loads(value)
        params = obj["parameters"]
        source = Source(**params["source"])
        model = ModelInfo(obj.get("model_name", ""), obj.get("model_version", ""))
        timing = {str(k): int(v) for k, v in params.get("timing_us", {}).items()}
        if "error" in obj:
            error = ErrorInfo(params.get("code", ErrorCode.INTERNAL), str(obj["error"]))
            return Result(obj.get("id", ""), "error", source, model, error=error,
                          meta=params.get("meta"), timing_us=timing)  # fmt: skip
        outputs = {}
        for out in obj["outputs"]:
            dtype = DATATYPES[out["datatype"]]
            arr = np.asarray(out["data"], dtype=dtype).reshape(out["shape"])
            outputs[out["name"]] = Tensor.from_numpy(arr[0] if arr.ndim and arr.shape[0] == 1
                                                     else arr)  # fmt: skip
        return Result(obj.get("id", ""), "ok", source, model, outputs=outputs,
                      meta=params.get("meta"), timing_us=timing,
                      partial=params.get("partial"))  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not an OIP answer: {exc!r}") from exc
