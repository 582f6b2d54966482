"""The model's image input, as the contract allows it: uint8 ``[H, W, C]``.

Checked once per request at intake, before any engine work, against the model's
channel count and the pixel limit, so a bad image is answered with an error
result naming the field instead of failing a whole batch later.
"""

from __future__ import annotations

import numpy as np

from worker.contract.requests import Request
from worker.errors import InvalidRequest, TensorTooLarge


def check_image(request: Request, input_name: str, channels: int, max_pixels: int) -> np.ndarray:
    """Validate the model input of one request; returns the image as a read-only
    uint8 [H, W, C] view (no copy)."""
    tensor = request.inputs.get(input_name)

    def bad(message: str, cls: type[InvalidRequest] = InvalidRequest) -> InvalidRequest:
        return cls(message, request_id=request.id, meta=request.meta)

    if tensor is None:
        names = ", ".join(sorted(request.inputs)) or "none"
        raise bad(f"inputs.{input_name}: missing (got {names})")
    field = f"inputs.{input_name}"
    if tensor.dtype != "uint8":
        raise bad(f"{field}.dtype: expected uint8, got {tensor.dtype}")
    shape = tensor.shape
    if len(shape) == 2 and channels == 1:
        shape = (*shape, 1)
    if len(shape) != 3 or shape[2] != channels:
        raise bad(f"{field}.shape: expected [H, W, {channels}], got {list(tensor.shape)}")
    h, w, _ = shape
    if h < 1 or w < 1:
        raise bad(f"{field}.shape: height and width must be >= 1")
    if h * w > max_pixels:
        raise bad(f"{field}: {h}x{w} exceeds {max_pixels} pixels", TensorTooLarge)
    return tensor.to_numpy().reshape(shape)
