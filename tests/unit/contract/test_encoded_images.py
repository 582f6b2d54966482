"""Encoded images in the contract (issue 9): a bin input is a JPEG, PNG or WebP
file, checked by its header at intake and decoded later into the model's
channel count; a lossless file gives exactly the raw tensor's pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tests.images import encode, png_bomb
from worker.contract import (
    EncodedImage,
    Limits,
    Request,
    Tensor,
    check_image,
    decode_request,
    encode_request,
    sniff_format,
)
from worker.flow.errors import InvalidRequest, TensorTooLarge
from worker.model.decode import DecodeFailed, decode_image

RNG = np.random.default_rng(3)
RGB = RNG.integers(0, 256, (20, 30, 3), dtype=np.uint8)


def request_with(data: bytes) -> Request:
    return decode_request(encode_request(Request(v=1, id="r", inputs={"image": _raw(data)})))


def _raw(data: bytes) -> EncodedImage:
    fmt = sniff_format(data)
    return EncodedImage(fmt or "png", data)


@pytest.mark.parametrize(("fmt", "name"), [("JPEG", "jpeg"), ("PNG", "png"), ("WEBP", "webp")])
def test_formats_are_recognised_by_magic_bytes(fmt: str, name: str) -> None:
    req = request_with(encode(RGB, fmt))
    image = req.inputs["image"]
    assert isinstance(image, EncodedImage) and image.format == name
    assert isinstance(check_image(req, "image", 3, 1 << 20), EncodedImage)


def test_a_lossless_png_decodes_to_exactly_the_raw_pixels() -> None:
    assert np.array_equal(decode_image(EncodedImage("png", encode(RGB, "PNG")), 3), RGB)
    grey = RNG.integers(0, 256, (9, 7, 1), dtype=np.uint8)
    assert np.array_equal(decode_image(EncodedImage("png", encode(grey, "PNG")), 1), grey)


def test_channels_follow_the_model() -> None:
    rgb_file = EncodedImage("png", encode(RGB, "PNG"))
    grey = decode_image(rgb_file, 1)
    assert grey.shape == (20, 30, 1) and grey.dtype == np.uint8
    grey_file = EncodedImage("png", encode(RGB[:, :, :1], "PNG"))
    rgb = decode_image(grey_file, 3)
    assert rgb.shape == (20, 30, 3)
    assert np.array_equal(rgb[:, :, 0], RGB[:, :, 0]) and np.array_equal(rgb[:, :, 2], rgb[:, :, 0])
    assert decode_image(rgb_file, 4).shape == (20, 30, 4)


def test_unknown_bin_is_an_invalid_request_naming_what_it_got() -> None:
    wire = encode_request(Request(v=1, id="r", inputs={"image": EncodedImage("png", b"GIF89a..")}))
    with pytest.raises(InvalidRequest, match=r"inputs.image: bin is not a JPEG, PNG or WebP") as e:
        decode_request(wire)
    assert e.value.request_id == "r"


def test_an_oversized_file_is_too_large_before_anything_is_read() -> None:
    data = encode(RGB, "PNG")
    wire = encode_request(Request(v=1, id="r", inputs={"image": EncodedImage("png", data)}))
    with pytest.raises(TensorTooLarge, match="encoded image"):
        decode_request(wire, Limits(max_tensor_bytes=len(data) - 1))


def test_a_small_png_claiming_huge_dimensions_is_too_large_from_its_header() -> None:
    bomb = png_bomb()
    assert len(bomb) < 25_000
    req = request_with(bomb)
    with pytest.raises(TensorTooLarge, match=r"png exceeds 16777216 pixels"):
        check_image(req, "image", 3, 4096 * 4096)
    # Below the decoder's own bomb guard, our limit decides, from the header.
    with pytest.raises(TensorTooLarge, match="png of 5000x5000 exceeds 16777216 pixels"):
        check_image(request_with(png_bomb(5000, 5000)), "image", 3, 4096 * 4096)


def _jpeg_claiming(height: int, width: int) -> bytes:
    """A small, complete JPEG whose frame header claims another size (a JPEG bomb)."""
    data = bytearray(encode(RGB, "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


@pytest.mark.parametrize(
    "image",
    [
        RGB,
        RGB[:, :, :1],
        RNG.integers(0, 256, (1, 1, 3), dtype=np.uint8),
        RNG.integers(0, 256, (480, 640, 3), dtype=np.uint8),
    ],
    ids=["rgb", "grey", "1x1", "640x480"],
)
@pytest.mark.parametrize("progressive", [False, True])
def test_jpeg_sizes_from_the_frame_header_agree_with_pillow(
    image: np.ndarray, progressive: bool
) -> None:
    """The JPEG fast path (no Pillow) decides exactly as Pillow's header does, at
    the limit and one pixel below it."""
    from PIL import Image

    from worker.contract.images import header_problem

    data = encode(image, "JPEG", progressive=progressive)
    h, w = image.shape[:2]
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == (w, h)
    assert header_problem(EncodedImage("jpeg", data), h * w) is None
    problem = header_problem(EncodedImage("jpeg", data), h * w - 1) if h * w > 1 else None
    if problem is not None:
        assert problem == (f"jpeg of {h}x{w} exceeds {h * w - 1} pixels", True)


def test_a_small_jpeg_claiming_huge_dimensions_is_too_large_from_its_header() -> None:
    bomb = _jpeg_claiming(40000, 40000)
    assert len(bomb) < 5_000
    with pytest.raises(TensorTooLarge, match="jpeg of 40000x40000 exceeds 16777216 pixels"):
        check_image(request_with(bomb), "image", 3, 4096 * 4096)


def test_a_truncated_file_passes_the_header_and_fails_decoding_with_the_reason() -> None:
    data = encode(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8), "JPEG", quality=90)
    cut = data[: len(data) // 2]
    req = request_with(cut)
    image = check_image(req, "image", 3, 1 << 20)
    assert isinstance(image, EncodedImage)
    with pytest.raises(DecodeFailed, match="truncated"):
        decode_image(image, 3)


def test_a_garbled_header_is_an_invalid_request() -> None:
    data = bytearray(encode(RGB, "PNG"))
    data[16:24] = b"\xff" * 8  # IHDR width/height fields
    req = request_with(bytes(data))
    with pytest.raises(InvalidRequest, match="png header"):
        check_image(req, "image", 3, 1 << 20)


def test_tensor_inputs_still_work_beside_files() -> None:
    req = Request(v=1, id="r", inputs={"image": Tensor.from_numpy(RGB)})
    out = check_image(decode_request(encode_request(req)), "image", 3, 1 << 20)
    assert isinstance(out, np.ndarray) and np.array_equal(out, RGB)
