"""The nvJPEG path with torchvision's CPU decoder in place of the device one
(``NvJpeg(..., decoder="cpu")``): routing by frame header, one batched decode,
the per-image retry when one file fails the batch, refused files handed to the
host decoder (whose complaint becomes the request's error), the shape check,
and the planar-to-interleaved placement at each image's offset in the packed
staging buffer. What only a GPU shows (nvJPEG itself, stream order, device
memory) is tests/gpu/test_gpu_nvjpeg.py's.

torch and torchvision are not installed in CI (see README, Development): these
tests run wherever they are.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.images import encode
from worker.compute.gpu.nvjpeg import NvJpeg
from worker.compute.gpu.staging import route_encoded
from worker.contract import EncodedImage
from worker.flow.messages import Job, TopicPartition
from worker.model.rows import Row

pytestmark = pytest.mark.usefixtures("torch_installed")

RNG = np.random.default_rng(5)
SMOOTH = np.clip(
    np.linspace(0, 255, 24 * 32 * 3).reshape(24, 32, 3) + RNG.normal(0, 8, (24, 32, 3)), 0, 255
).astype(np.uint8)


@dataclass
class HostStream:
    synchronized: int = 0

    def synchronize(self) -> None:
        self.synchronized += 1


@dataclass
class HostSlot:
    """What the decoder sees of a slot: its index, stream and packed staging."""

    index: int
    dev_packed: np.ndarray
    stream: HostStream = field(default_factory=HostStream)


def _answer(offset: int, data: bytes) -> Row:
    job = Job(TopicPartition("t", 0), offset, None, arrived=time.monotonic(), deadline=None)
    job.inputs["image"] = EncodedImage("jpeg", data)
    return Row.of(job)


def bad_scan(data: bytes) -> bytes:
    """A JPEG whose frame header is sound but whose scan names a component the
    frame does not have: the header check passes it, the decoders refuse it."""
    at = data.index(b"\xff\xda")
    out = bytearray(data)
    out[at + 5] = 9  # the first scan component's id
    return bytes(out)


def pillow(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_a_batch_decodes_retries_one_by_one_and_hands_refusals_to_the_host() -> None:
    good = encode(SMOOTH, "JPEG", quality=90)
    progressive = encode(SMOOTH[:16], "JPEG", quality=80, progressive=True)
    gray = encode(SMOOTH[..., 0], "JPEG", quality=90)
    broken = bad_scan(good)
    answers = [_answer(i, d) for i, d in enumerate((good, broken, progressive, gray))]
    to_host, on_device = route_encoded(answers, 3, use_nvjpeg=True)
    assert to_host == [] and len(on_device) == 4  # every header passes

    decoder = NvJpeg(0, 3, decoder="cpu")
    slot: Any = HostSlot(0, np.zeros(1 << 16, np.uint8))
    decoder.attach(slot)
    runnable, seconds = decoder.decode_answers(slot, answers, on_device, "image")
    assert seconds >= 0 and slot.stream.synchronized == 1
    # The broken file failed the batched call; the retry decoded the others one
    # by one and the host decoder gave the broken one its error.
    assert [a.job.offset for a in runnable] == [0, 2, 3]
    assert answers[1].error is not None and answers[1].error.code == "invalid_request"
    assert id(answers[1]) not in on_device
    assert (decoder.decoded, decoder.refused) == (3, 1)

    placed: list[tuple[int, Any]] = []
    offset = 0
    for answer in runnable:
        image = on_device[id(answer)]
        assert tuple(image.pixels.shape) == (3, image.height, image.width)
        placed.append((offset, image))
        offset += image.nbytes
    decoder.place(slot, placed)
    for (at, image), data in zip(placed, (good, progressive, gray), strict=True):
        hwc = slot.dev_packed[at : at + image.nbytes].reshape(image.height, image.width, 3)
        # the same libjpeg-turbo either way; allow a step for IDCT rounding differences
        assert np.abs(hwc.astype(int) - pillow(data).astype(int)).max() <= 2
    decoder.close()


def test_a_file_decoded_to_another_size_than_its_header_says_is_refused() -> None:
    data = encode(SMOOTH, "JPEG", quality=90)
    (answer,) = answers = [_answer(0, data)]
    _, on_device = route_encoded(answers, 3, use_nvjpeg=True)
    decoder = NvJpeg(0, 3, decoder="cpu")
    slot: Any = HostSlot(0, np.zeros(1 << 14, np.uint8))
    decoder.attach(slot)
    image = on_device[id(answer)]
    image.height += 1  # as if the header and the decoder disagreed
    problems = decoder.decode(slot, [image])
    assert problems == [f"nvJPEG decoded [3, 24, 32]; the header says (3, {image.height}, 32)"]
    assert image.pixels is None


def test_images_of_one_size_back_to_back_are_placed_as_one_run() -> None:
    """Three 24x32 images back to back (one run: one stack, one copy), a 16x32
    one, a gray one, then a 24x32 one after a gap: each lands at its own offset,
    interleaved, and the bytes around them stay as they were."""
    sizes = [SMOOTH, SMOOTH[::-1], SMOOTH[:, ::-1], SMOOTH[:16], SMOOTH[..., 0], SMOOTH]
    files = [encode(np.ascontiguousarray(a), "JPEG", quality=95) for a in sizes]
    answers = [_answer(i, data) for i, data in enumerate(files)]
    _, on_device = route_encoded(answers, 3, use_nvjpeg=True)
    decoder = NvJpeg(0, 3, decoder="cpu")
    slot: Any = HostSlot(0, np.full(1 << 15, 7, np.uint8))
    decoder.attach(slot)
    runnable, _ = decoder.decode_answers(slot, answers, on_device, "image")
    assert len(runnable) == len(sizes)
    placed: list[tuple[int, Any]] = []
    offset = 16
    for i, answer in enumerate(runnable):
        image = on_device[id(answer)]
        offset += 8 if i == 5 else 0  # a gap: the last image starts a run of its own
        placed.append((offset, image))
        offset += image.nbytes
    decoder.place(slot, placed)
    written = np.zeros(slot.dev_packed.size, bool)
    for at, image in placed:
        hwc = slot.dev_packed[at : at + image.nbytes].reshape(image.height, image.width, -1)
        chw = image.pixels.numpy()
        assert np.array_equal(hwc, chw.transpose(1, 2, 0))
        written[at : at + image.nbytes] = True
    assert (slot.dev_packed[~written] == 7).all()
    decoder.close()
