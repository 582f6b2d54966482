"""The Python client refuses what the worker would refuse, before sending: an
image array that is not uint8 is never cast (float pixels in [0, 1) would become
a black image, answered ``ok``)."""

from __future__ import annotations

import numpy as np
import pytest

from worker.client import InferenceClient, _as_image


def test_uint8_pixels_and_files_pass_unchanged() -> None:
    pixels = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)[:, ::-1]  # not contiguous
    out = _as_image(pixels)
    assert isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, pixels)
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
    assert _as_image(png) is png


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "uint16", "bool"])
def test_other_pixel_dtypes_are_refused_not_cast(dtype: str) -> None:
    with pytest.raises(TypeError, match=rf"image: expected uint8 .* got {dtype}"):
        _as_image(np.zeros((8, 8, 1), dtype=dtype))


async def test_infer_refuses_before_anything_is_sent() -> None:
    client = InferenceClient("127.0.0.1:1")
    client._producer = object()  # type: ignore[assignment]  # never reached
    with pytest.raises(TypeError, match="got float32"):
        await client.infer(np.random.default_rng(0).random((8, 8, 1), dtype=np.float32))
    assert client._waiting == {}
