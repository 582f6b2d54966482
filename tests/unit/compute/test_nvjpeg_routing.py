"""gpu.decode = "nvjpeg" without a GPU: which files nvJPEG gets (read from the JPEG's
own markers), the staging byte budget counted in decoded bytes, the packed layout
that keeps device-decoded pixels out of pinned memory, and the start-up error
when torch/torchvision with CUDA is missing. The decoding itself is tested on a
GPU (tests/gpu/test_gpu_nvjpeg.py)."""

from __future__ import annotations

import io
import sys
import time
import types
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.images import encode
from worker.compute.gpu.nvjpeg import NvJpeg, _runs, check_config, device_image
from worker.compute.gpu.slots import DeviceImage, pack_batch
from worker.compute.gpu.stage import GpuStage
from worker.compute.gpu.staging import (
    reject_oversized,
    route_encoded,
    split_chunks,
    staged_bytes,
)
from worker.config import GpuConfig, LimitsConfig, ModelConfig, PreprocessConfig
from worker.contract import EncodedImage
from worker.contract.jpeg import read_frame
from worker.flow.errors import ConfigError
from worker.flow.messages import Job, TopicPartition
from worker.model.inputs import bind_model
from worker.model.io import ModelIO, TensorDesc
from worker.model.rows import Row

RNG = np.random.default_rng(11)
PHOTO = RNG.integers(0, 256, (30, 40, 3), dtype=np.uint8)


def jpeg(pixels: np.ndarray = PHOTO, **options: Any) -> bytes:
    return encode(pixels, "JPEG", quality=90, **options)


def cmyk_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(PHOTO).convert("CMYK").save(buf, format="JPEG")
    return buf.getvalue()


def with_segment(data: bytes, marker: int, body: bytes) -> bytes:
    """``data`` with one marker segment inserted right after SOI."""
    return data[:2] + bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body + data[2:]


def patched_frame(data: bytes, *, marker: int | None = None, precision: int | None = None) -> bytes:
    """``data`` with its SOF0 marker or sample precision changed (header only)."""
    at = data.index(b"\xff\xc0")
    out = bytearray(data)
    if marker is not None:
        out[at + 1] = marker
    if precision is not None:
        out[at + 4] = precision
    return bytes(out)


# --- the frame header --------------------------------------------------------------


def test_frame_header_of_pillow_jpegs() -> None:
    frame = read_frame(jpeg())
    assert frame is not None
    assert (frame.process, frame.precision, frame.height, frame.width) == (0xC0, 8, 30, 40)
    assert frame.components == 3 and frame.complete and frame.adobe_transform is None
    grey = read_frame(jpeg(PHOTO[:, :, :1]))
    assert grey is not None and grey.components == 1
    progressive = read_frame(jpeg(progressive=True))
    assert progressive is not None and progressive.process == 0xC2
    cmyk = read_frame(cmyk_jpeg())
    assert cmyk is not None and cmyk.components == 4 and cmyk.adobe_transform is not None


def test_frame_header_of_broken_files() -> None:
    data = jpeg()
    assert read_frame(b"") is None
    assert read_frame(b"\xff\xd8\xff") is None
    assert read_frame(b"\x89PNG\r\n\x1a\n" + data) is None
    assert read_frame(data[:20]) is None  # cut inside the segments before the frame
    half = read_frame(data[: len(data) // 2])  # cut inside the scan: frame read, not complete
    assert half is not None and not half.complete
    garbled = bytearray(data)
    garbled[2] = 0x00  # a marker that is not one
    assert read_frame(bytes(garbled)) is None


# --- which files go to nvJPEG ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "data", "channels", "on_device"),
    [
        ("baseline", jpeg(), 3, True),
        ("baseline to grey", jpeg(), 1, True),
        ("grey source", jpeg(PHOTO[:, :, :1]), 3, True),
        ("progressive", jpeg(progressive=True), 3, True),
        ("4:4:4", jpeg(subsampling=0), 3, True),
        ("RGBA model", jpeg(), 4, False),
        ("CMYK", cmyk_jpeg(), 3, False),
        ("truncated", jpeg()[:-200], 3, False),
        ("12-bit", patched_frame(jpeg(), precision=12), 3, False),
        ("arithmetic", patched_frame(jpeg(), marker=0xC9), 3, False),
        ("lossless", patched_frame(jpeg(), marker=0xC3), 3, False),
        ("RGB samples", with_segment(jpeg(), 0xEE, b"Adobe\x00\x64\x00\x00\x00\x00\x00"), 3, False),
        ("Adobe YCbCr", with_segment(jpeg(), 0xEE, b"Adobe\x00\x64\x00\x00\x00\x00\x01"), 3, True),
    ],
)
def test_which_jpegs_nvjpeg_gets(name: str, data: bytes, channels: int, on_device: bool) -> None:
    image = device_image(EncodedImage("jpeg", data), channels)
    assert (image is not None) == on_device, name
    if image is not None:
        assert (image.height, image.width, image.channels) == (30, 40, channels)
        assert image.nbytes == 30 * 40 * channels and image.pixels is None


def test_png_and_webp_stay_on_the_host() -> None:
    for fmt, name in (("PNG", "png"), ("WEBP", "webp")):
        assert device_image(EncodedImage(name, encode(PHOTO, fmt)), 3) is None  # type: ignore[arg-type]


def _answer(offset: int, image: np.ndarray | None = None, encoded: bytes | None = None) -> Row:
    job = Job(TopicPartition("t", 0), offset, None, arrived=time.monotonic(), deadline=None)
    if image is not None:
        job.inputs["image"] = image
    if encoded is not None:
        fmt = "png" if encoded.startswith(b"\x89PNG") else "jpeg"
        job.inputs["image"] = EncodedImage(fmt, encoded)
    return Row.of(job)


def test_routing_a_mixed_batch() -> None:
    answers = [
        _answer(0, image=PHOTO),
        _answer(1, encoded=jpeg()),
        _answer(2, encoded=encode(PHOTO, "PNG")),
        _answer(3, encoded=cmyk_jpeg()),
        _answer(4, encoded=jpeg()[:-100]),
        _answer(5, encoded=jpeg(progressive=True)),
    ]
    to_host, on_device = route_encoded(answers, 3, use_nvjpeg=True)
    assert [a.job.offset for a in to_host] == [2, 3, 4]
    assert sorted(on_device) == sorted([id(answers[1]), id(answers[5])])
    to_host, on_device = route_encoded(answers, 3, use_nvjpeg=False)
    assert [a.job.offset for a in to_host] == [1, 2, 3, 4, 5] and on_device == {}


# --- the staging byte budget counts decoded bytes ------------------------------------


def test_budget_counts_a_jpeg_by_its_decoded_size() -> None:
    big = np.tile(np.linspace(0, 255, 300, dtype=np.uint8)[:, None, None], (1, 200, 3))
    data = jpeg(big)  # a smooth 300x200 image: a few KB as a file, 180 kB decoded
    assert len(data) < 20_000
    answers = [_answer(i, encoded=data) for i in range(3)]
    answers.append(_answer(3, image=PHOTO))  # 3.6 kB of raw pixels
    _, on_device = route_encoded(answers, 3, use_nvjpeg=True)
    size = lambda a: staged_bytes(a, on_device)  # noqa: E731
    assert [size(a) for a in answers] == [180_000, 180_000, 180_000, PHOTO.nbytes]
    chunks = split_chunks(answers, size, max_rows=8, limit=400_000)
    assert [[a.job.offset for a in c] for c in chunks] == [[0, 1], [2, 3]]
    assert len(split_chunks(answers, size, max_rows=2, limit=None)) == 2
    kept = reject_oversized(answers, size, limit=100_000)
    assert [a.job.offset for a in kept] == [3]
    assert answers[0].error is not None and answers[0].error.code == "too_large"
    assert "180000 bytes" in answers[0].error.message


# --- packing: device images take staging bytes without touching pinned memory --------


def test_pack_batch_keeps_device_images_out_of_pinned_staging() -> None:
    a = RNG.integers(0, 256, (2, 3, 3), dtype=np.uint8)
    b = RNG.integers(0, 256, (4, 1, 3), dtype=np.uint8)
    dev1, dev2 = DeviceImage(b"", 5, 4, 3), DeviceImage(b"", 2, 2, 3)
    packed = np.full(200, 0xAB, np.uint8)
    table = np.full((4, 3), -1, np.int64)
    packing = pack_batch([dev1, a, dev2, b], packed, table)
    assert packing.host_bytes == a.size + b.size  # the one H2D copy
    assert packing.total_bytes == packing.host_bytes + dev1.nbytes + dev2.nbytes
    # Host images first, back to back; device images after them, in batch order.
    assert table.tolist() == [
        [a.size + b.size, 5, 4],
        [0, 2, 3],
        [a.size + b.size + dev1.nbytes, 2, 2],
        [a.size, 4, 1],
    ]
    assert packing.on_device == [(table[0, 0], dev1), (table[2, 0], dev2)]
    assert np.array_equal(packed[: a.size], a.reshape(-1))
    assert np.array_equal(packed[a.size : packing.host_bytes], b.reshape(-1))
    assert (packed[packing.host_bytes :] == 0xAB).all()  # no device pixel went through here
    only_device = pack_batch([dev1], np.full(60, 0xAB, np.uint8), table)
    assert only_device.host_bytes == 0 and only_device.total_bytes == 60
    with pytest.raises(ValueError, match="staging"):
        pack_batch([dev1, dev1], np.zeros(100, np.uint8), table)


# --- start-up -------------------------------------------------------------------------

GPU_MODEL = ModelConfig(
    name="m",
    path="unused",
    backend="torch",
    preprocess=PreprocessConfig(
        size=(8, 8), channels=3, mean=(0.5,) * 3, std=(0.5,) * 3, layout="NCHW", device="gpu"
    ),
)


def test_nvjpeg_needs_gpu_preprocessing_and_1_or_3_channels() -> None:
    check_config("nvjpeg", GPU_MODEL.preprocess)
    check_config("host", replace(GPU_MODEL.preprocess, device="cpu"))
    with pytest.raises(ConfigError, match=r"gpu.decode.*model.preprocess.device"):
        check_config("nvjpeg", replace(GPU_MODEL.preprocess, device="cpu"))
    with pytest.raises(ConfigError, match=r"gpu.decode.*channels is 4"):
        check_config(
            "nvjpeg", replace(GPU_MODEL.preprocess, channels=4, mean=(0,) * 4, std=(1,) * 4)
        )


def test_start_up_without_torch_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(ConfigError, match=r"gpu.decode = 'nvjpeg' needs torch and torchvision"):
        NvJpeg(0, 3)


def test_start_up_with_a_torch_without_cuda_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0+cpu"  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(is_available=lambda: False)  # type: ignore[attr-defined]
    vision = types.ModuleType("torchvision")
    vision_io = types.ModuleType("torchvision.io")
    vision_io.ImageReadMode = object  # type: ignore[attr-defined]
    vision_io.decode_jpeg = object  # type: ignore[attr-defined]
    vision.io = vision_io  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torchvision", vision)
    monkeypatch.setitem(sys.modules, "torchvision.io", vision_io)
    with pytest.raises(ConfigError, match=r"torch 0\.0\+cpu sees no CUDA device"):
        NvJpeg(0, 3)


def test_the_gpu_stage_fails_start_up_naming_gpu_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before CuPy is touched, so it names what is missing even on a host
    without CUDA; ``infer-worker`` exits 2 on a ConfigError."""
    monkeypatch.setitem(sys.modules, "torch", None)
    f32 = np.dtype(np.float32)
    io = ModelIO((TensorDesc("image", f32, (3, 8, 8)),), (TensorDesc("logits", f32, (10,)),))
    engine = types.SimpleNamespace(
        max_batch_size=8,
        min_batch_size=1,
        input=TensorDesc("image", f32, (3, 8, 8)),
        info=types.SimpleNamespace(io=io, name="m", version="v"),
    )
    with pytest.raises(ConfigError, match=r"gpu\.decode = 'nvjpeg' needs torch"):
        GpuStage(
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            engine,  # type: ignore[arg-type]
            bind_model(GPU_MODEL, io, LimitsConfig()),
            max_batch_size=8,
            num_slots=1,
            gpu=GpuConfig(decode="nvjpeg"),
        )


def test_placement_runs_are_images_of_one_size_at_consecutive_offsets() -> None:
    def image(height: int, width: int = 4, channels: int = 3) -> DeviceImage:
        return DeviceImage(b"", height, width, channels, pixels=object())

    a, b, c, d, e, f = image(2), image(2), image(2), image(3), image(2, channels=1), image(2)
    on_device = [(0, a), (24, b), (48, c), (72, d), (108, e), (120, f)]
    runs = _runs(on_device)
    assert [(offset, len(run)) for offset, run in runs] == [(0, 3), (72, 1), (108, 1), (120, 1)]
    assert runs[0][1] == [a, b, c]
    # the same size after a gap starts a run of its own
    assert [offset for offset, _ in _runs([(0, a), (25, b)])] == [0, 25]
    with pytest.raises(ValueError, match="before it was decoded"):
        _runs([(0, DeviceImage(b"", 2, 4, 3))])
