"""gpu.decode = "nvjpeg" on a GPU: JPEGs decoded by torchvision's nvJPEG on the slot's
device, against the same files decoded on the host (Pillow), through the real stage.

Run them all in one go: ``python3 -m pytest -q tests/gpu/test_gpu_nvjpeg.py``.

Tolerance. Two JPEG decoders need not agree bit for bit: the standard lets the
inverse DCT round differently, and chroma upsampling (4:2:0) and the YCbCr to
RGB conversion are implementation choices (libjpeg-turbo's "fancy" upsampling
against nvJPEG's). torchvision's own test of this decoder against libjpeg
(``test_decode_jpegs_cuda``) allows a mean absolute difference below 2 grey
levels per image, and so do these tests: per image, the mean of |nvJPEG - host|
over every value, in grey levels (a preprocessed difference is divided by
``scale / std`` of its channel). A misplaced, transposed or channel-swapped image
is off by tens of levels, so the bound still catches layout errors. Everything
that does not go through nvJPEG (raw tensors, PNG, WebP, CMYK JPEGs) must be
bit-identical between the two runs.

Images: photographs from scikit-image (astronaut, coffee, chelsea, rocket), cut
into crops of several sizes; smooth synthetic scenes if it is missing.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.gpu.support import gpu_stage
from tests.images import encode
from worker.compute.gpu.stage import GpuStage
from worker.config import GpuConfig, ModelConfig, PostprocessConfig, PreprocessConfig, TorchConfig
from worker.contract import EncodedImage, sniff_format
from worker.flow.messages import Answer
from worker.model.decode import decode_image

from .support import IdentityEngine, batches_of, make_jobs, queues, run_stage

pytestmark = [pytest.mark.gpu, pytest.mark.needs_torch]

MEAN_LEVELS = 2.0  # see the module docstring
RNG_SEED = 5
Item = np.ndarray | bytes


@pytest.fixture(scope="module", autouse=True)
def _torchvision() -> None:
    pytest.importorskip("torchvision", reason="gpu.decode = 'nvjpeg' needs torchvision")


def _photos() -> list[np.ndarray]:
    try:
        from skimage import data

        return [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    except Exception:  # scikit-image missing: smooth scenes with edges and texture
        rng = np.random.default_rng(RNG_SEED)
        y, x = np.mgrid[0:400, 0:500].astype(np.float32)
        scenes = []
        for k in range(4):
            base = np.stack([x / 2 + 40 * k, y / 2, (x + y) / 4], axis=-1)
            base += 30 * np.sin((x + 3 * y) / (17 + k))[..., None]
            base[100 + 40 * k : 200 + 40 * k, 150:300] *= 0.4  # a hard-edged block
            base += rng.normal(0, 6, base.shape)
            scenes.append(np.clip(base, 0, 255).astype(np.uint8))
        return scenes


PHOTOS = _photos()


def crops(sizes: Sequence[tuple[int, int]], seed: int = RNG_SEED) -> list[np.ndarray]:
    """RGB crops of the photos, one per (height, width), from random places."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (h, w) in enumerate(sizes):
        photo = PHOTOS[i % len(PHOTOS)]
        top = int(rng.integers(0, photo.shape[0] - h + 1))
        left = int(rng.integers(0, photo.shape[1] - w + 1))
        out.append(np.ascontiguousarray(photo[top : top + h, left : left + w]))
    return out


def grey(rgb: np.ndarray) -> np.ndarray:
    return np.asarray(Image.fromarray(rgb).convert("L"))[:, :, None]


def jpeg(pixels: np.ndarray, **options: Any) -> bytes:
    return encode(pixels, "JPEG", **{"quality": 90, **options})


def cmyk_jpeg(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def corrupt_huffman(data: bytes) -> bytes:
    """A JPEG whose first Huffman table claims more codes than exist: the header
    (up to the frame) is intact, the data cannot be decoded."""
    at = data.index(b"\xff\xc4")
    out = bytearray(data)
    out[at + 5 : at + 21] = b"\xff" * 16
    return bytes(out)


def host_pixels(item: Item, channels: int) -> np.ndarray:
    """What the host path stages for ``item`` (Pillow for files)."""
    if isinstance(item, bytes):
        fmt = sniff_format(item)
        assert fmt is not None
        return decode_image(EncodedImage(fmt, item), channels)
    return item


def pixels_model(h: int, w: int, channels: int) -> ModelConfig:
    """Preprocessing that is the identity at the images' own size (scale 1, mean 0,
    std 1, NHWC, no resampling): the engine's output is the decoded pixels."""
    return ModelConfig(
        name="pixels",
        path="unused",
        backend="torch",
        output="pixels",
        preprocess=PreprocessConfig(
            size=(h, w),
            channels=channels,
            scale=1.0,
            mean=(0.0,) * channels,
            std=(1.0,) * channels,
            layout="NHWC",
            device="gpu",
        ),
        postprocess=PostprocessConfig(softmax=False, top_k=0, include_raw=True),
    )


IMAGENET = ModelConfig(
    name="imagenet-like",
    path="unused",
    backend="torch",
    output="pixels",
    preprocess=PreprocessConfig(
        size=(24, 20),
        channels=3,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        layout="NCHW",
        device="gpu",
    ),
    postprocess=PostprocessConfig(softmax=False, top_k=0, include_raw=True),
)


def engine_for(model: ModelConfig) -> IdentityEngine:
    pp = model.preprocess
    h, w = pp.size
    row = (h, w, pp.channels) if pp.layout == "NHWC" else (pp.channels, h, w)
    return IdentityEngine(row)


def level_diff(a: np.ndarray, b: np.ndarray, model: ModelConfig) -> float:
    """Mean |a - b| of two preprocessed rows, in grey levels (see the module doc)."""
    pp = model.preprocess
    h, w = pp.size
    per_level = pp.scale / np.asarray(pp.std, dtype=np.float64)  # one level, per channel
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = d.reshape(pp.channels, h * w) if pp.layout == "NCHW" else d.reshape(h * w, pp.channels).T
    return float((d / per_level[:, None]).mean())


async def run(
    model: ModelConfig,
    items: Sequence[Item],
    decode: str,
    sizes: Sequence[int],
    *,
    slots: int = 1,
    engine: Any = None,
    before: Callable[[GpuStage], None] | None = None,
) -> tuple[list[Answer], tuple[int, int]]:
    """Answers in request order, and nvJPEG's (decoded, refused) counts."""
    source, sink = queues()
    gpu = GpuConfig(decode=decode, max_input_bytes=1 << 22)  # type: ignore[arg-type]
    stage = gpu_stage(source, sink, engine or engine_for(model), model, max(sizes), slots, gpu)
    try:
        if before is not None:
            before(stage)
        completed = await run_stage(stage, source, sink, batches_of(make_jobs(items), sizes))
        nv = stage.nvjpeg
        counts = (nv.decoded, nv.refused) if nv is not None else (0, 0)
    finally:
        stage.close()
    answers = [a for c in completed for a in c.answers]
    assert [a.job.offset for a in answers] == list(range(len(items)))
    return answers, counts


def out(answer: Answer) -> np.ndarray:
    assert answer.error is None, answer.error
    assert answer.outputs is not None
    return answer.outputs["pixels"]


# --- decoded pixels ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "channels", "to_file"),
    [
        ("4:2:0 q90", 3, jpeg),
        ("4:4:4 q95", 3, lambda p: jpeg(p, quality=95, subsampling=0)),
        ("progressive", 3, lambda p: jpeg(p, progressive=True)),
        ("grey file, RGB model", 3, lambda p: jpeg(grey(p))),
        ("colour file, grey model", 1, jpeg),
        ("grey file, grey model", 1, lambda p: jpeg(grey(p))),
    ],
)
async def test_decoded_pixels_match_the_host_decoder(
    case: str, channels: int, to_file: Callable[[np.ndarray], bytes]
) -> None:
    files = [to_file(p) for p in crops([(48, 64)] * 6)]
    model = pixels_model(48, 64, channels)
    want = [host_pixels(f, channels).reshape(-1).astype(np.float32) for f in files]
    host, _ = await run(model, files, "host", [6])
    assert all(np.array_equal(out(a), w) for a, w in zip(host, want, strict=True))  # harness
    answers, (decoded, refused) = await run(model, files, "nvjpeg", [6])
    assert (decoded, refused) == (6, 0), case
    for i, (a, w) in enumerate(zip(answers, want, strict=True)):
        got = out(a)
        assert got.shape == w.shape
        assert np.all((got >= 0) & (got <= 255) & (got == np.round(got)))  # uint8 pixels
        diff = float(np.abs(got - w).mean())
        assert diff < MEAN_LEVELS, f"{case}, image {i}: mean |nvJPEG - Pillow| = {diff:.2f}"


# --- preprocessed like host-decoded, in any mix --------------------------------------


async def test_a_batch_of_photos_preprocesses_like_host_decode() -> None:
    sizes = [(33, 50), (120, 80), (256, 256), (17, 300), (300, 17), (224, 224), (64, 65)]
    files = [jpeg(p) for p in crops(sizes * 2, seed=7)]
    host, _ = await run(IMAGENET, files, "host", [14])
    answers, (decoded, refused) = await run(IMAGENET, files, "nvjpeg", [14])
    assert (decoded, refused) == (14, 0)
    for i, (a, h) in enumerate(zip(answers, host, strict=True)):
        diff = level_diff(out(a), out(h), IMAGENET)
        assert diff < MEAN_LEVELS, f"image {i} ({sizes[i % len(sizes)]}): {diff:.2f} levels"
        assert a.timing_us["preprocess"] > 0 and "decode" not in a.timing_us


async def test_mixed_batch_of_jpeg_png_webp_cmyk_and_raw_tensors() -> None:
    p = crops([(40, 60), (50, 30), (64, 64), (33, 47), (80, 20), (45, 45), (60, 40)], seed=9)
    items: list[Item] = [
        p[0],  # raw tensor
        encode(p[0], "PNG"),  # the same pixels, lossless
        jpeg(p[1]),
        encode(p[2], "WEBP", lossless=True),
        cmyk_jpeg(p[3]),  # routed to the host by its header
        jpeg(p[4], progressive=True),
        jpeg(grey(p[5])),
        jpeg(p[6], subsampling=0),
    ]
    on_nvjpeg = {2, 5, 6, 7}
    host, _ = await run(IMAGENET, items, "host", [8])
    answers, (decoded, refused) = await run(IMAGENET, items, "nvjpeg", [8])
    assert (decoded, refused) == (len(on_nvjpeg), 0)
    assert np.array_equal(out(answers[0]), out(answers[1]))  # PNG == raw tensor, exactly
    for i, (a, h) in enumerate(zip(answers, host, strict=True)):
        if i in on_nvjpeg:
            assert level_diff(out(a), out(h), IMAGENET) < MEAN_LEVELS, i
        else:
            assert np.array_equal(out(a), out(h)), i  # decoded on the host both times


async def test_a_corrupt_jpeg_is_answered_alone_and_the_rest_runs() -> None:
    p = crops([(40, 60), (50, 30), (64, 64), (33, 47)], seed=3)
    good = jpeg(p[1])
    items: list[Item] = [
        jpeg(p[0]),
        corrupt_huffman(good),  # nvJPEG refuses it, then Pillow does
        jpeg(p[2]),
        good[: len(good) // 2],  # truncated: no end marker, so the host decoder names it
        p[3],
    ]
    answers, (decoded, refused) = await run(IMAGENET, items, "nvjpeg", [5])
    assert (decoded, refused) == (2, 1)
    bad, cut = answers[1].error, answers[3].error
    assert bad is not None and bad.code == "invalid_request" and answers[1].outputs is None
    assert bad.message.startswith("inputs.image: jpeg cannot be decoded: "), bad.message
    assert cut is not None and cut.code == "invalid_request" and "truncated" in cut.message.lower()
    host, _ = await run(IMAGENET, [items[0], items[2], items[4]], "host", [3])
    for a, h in zip([answers[0], answers[2], answers[4]], host, strict=True):
        assert level_diff(out(a), out(h), IMAGENET) < MEAN_LEVELS


# --- no decoded pixel through the host ---------------------------------------------------


async def test_no_decoded_pixel_passes_through_pinned_staging() -> None:
    p = crops([(40, 60), (50, 30), (64, 64), (33, 47)], seed=4)
    raw_a, raw_b = p[0], p[3]
    sentinel = 0xAB
    staged: dict[str, Any] = {}

    def poison(stage: GpuStage) -> None:
        slot = stage.slots[0]
        assert slot.host_packed is not None
        slot.host_packed.fill(sentinel)
        staged["packed"], staged["table"] = slot.host_packed, slot.host_table

    files = [jpeg(x) for x in p]
    answers, (decoded, _) = await run(IMAGENET, files, "nvjpeg", [4], before=poison)
    assert decoded == 4 and all(a.outputs is not None for a in answers)
    assert (staged["packed"] == sentinel).all(), "an nvJPEG image was written to pinned memory"

    # Mixed: only the raw tensors' bytes are staged on the host, back to back.
    items: list[Item] = [raw_a, jpeg(p[1]), raw_b, jpeg(p[2])]
    answers, (decoded, _) = await run(IMAGENET, items, "nvjpeg", [4], before=poison)
    assert decoded == 2 and all(a.outputs is not None for a in answers)
    packed, table = staged["packed"], staged["table"]
    host_bytes = raw_a.size + raw_b.size
    assert np.array_equal(packed[: raw_a.size], raw_a.reshape(-1))
    assert np.array_equal(packed[raw_a.size : host_bytes], raw_b.reshape(-1))
    assert (packed[host_bytes:] == sentinel).all()
    assert table[1, 0] >= host_bytes and table[3, 0] >= host_bytes  # JPEGs: device bytes


# --- with the torch engine on the slot's stream -------------------------------------------


@pytest.fixture(scope="module")
def identity_torchscript(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TorchScript model that returns its input, computed through temporaries
    (2x - x, exact in float32): eager torch allocates and frees on the slot's
    stream between decodes, which is what the decoder's stream ordering must
    survive (see worker/compute/gpu/nvjpeg.py)."""
    import torch

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2.0
            return (y - x).flatten(1)

    path = tmp_path_factory.mktemp("nvjpeg") / "identity.pt"
    torch.jit.script(Identity()).save(str(path))
    return path


async def test_torch_engine_on_three_slots_gives_the_same_bits_every_run(
    identity_torchscript: Path,
) -> None:
    from worker.compute.engines.torch import TorchEngine

    model = ModelConfig(
        name="identity",
        path=str(identity_torchscript),
        backend="torch",
        output="pixels",
        preprocess=IMAGENET.preprocess,
        postprocess=IMAGENET.postprocess,
        torch=TorchConfig(cuda_graphs=False, channels_last=False),  # eager: it allocates
    )
    sizes = [(int(h), int(w)) for h, w in np.random.default_rng(1).integers(16, 300, (60, 2))]
    files = [jpeg(p) for p in crops(sizes, seed=11)]
    batch_sizes = [5, 8, 3, 8, 1, 8]
    results = []
    for slots in (1, 3):  # one batch at a time, then three slots at once
        engine = TorchEngine(identity_torchscript, model, max_batch_size=8)
        try:
            answers, (decoded, _) = await run(
                model, files, "nvjpeg", batch_sizes, slots=slots, engine=engine
            )
        finally:
            engine.close()
        assert decoded == len(files)
        results.append([out(a) for a in answers])
    for i, (one, three) in enumerate(zip(*results, strict=True)):
        assert np.array_equal(one, three), f"image {i} differs between runs"
    host, _ = await run(IMAGENET, files[:8], "host", [8])
    for a, h in zip(results[1][:8], host, strict=True):
        assert level_diff(a, out(h), IMAGENET) < MEAN_LEVELS
