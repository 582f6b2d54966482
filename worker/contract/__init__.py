"""The wire contract, version 1: msgpack requests in, msgpack results out.

The contract is public (schemas/README.md, schemas/*.json) and clients in any
language write to it, so this package is the one place that decides what a
record means: ``tensors`` (how arrays travel), ``requests`` (input records,
decoded defensively under ``limits``), ``results`` (output records), and
``images`` (the model's image input). No pickle and no msgpack ext types, ever:
both would let a record choose what code runs or what objects get built.
"""

from worker.contract.images import check_image, check_image_value
from worker.contract.limits import DEFAULT_LIMITS, Limits
from worker.contract.ok_results import encode_ok_result
from worker.contract.requests import decode_request, encode_request
from worker.contract.results import decode_result, encode_result
from worker.flow.codes import ErrorCode
from worker.flow.values import (
    DTYPES,
    ERROR_CODES,
    SUPPORTED_VERSIONS,
    EncodedImage,
    ErrorInfo,
    InputValue,
    ModelInfo,
    ModelRef,
    Request,
    Result,
    Source,
    Tensor,
    sniff_format,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DTYPES",
    "ERROR_CODES",
    "SUPPORTED_VERSIONS",
    "EncodedImage",
    "ErrorCode",
    "ErrorInfo",
    "InputValue",
    "Limits",
    "ModelInfo",
    "ModelRef",
    "Request",
    "Result",
    "Source",
    "Tensor",
    "check_image",
    "check_image_value",
    "decode_request",
    "decode_result",
    "encode_ok_result",
    "encode_request",
    "encode_result",
    "sniff_format",
]
