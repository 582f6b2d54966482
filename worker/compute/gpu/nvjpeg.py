"""JPEGs decoded on the GPU (``gpu.decode = "nvjpeg"``): torchvision's batched nvJPEG.

Which files go to nvJPEG is decided from the file's own frame header, read here
without decoding (``read_frame``): 8-bit Huffman-coded JPEGs (baseline, extended
or progressive) with 1 or 3 components that end with their end-of-image marker,
for a model of 1 or 3 channels. Everything else (PNG, WebP, CMYK/YCCK, RGB
stored without the YCbCr transform, 12-bit, arithmetic or lossless coding, a
file cut short) is decoded on the host by ``worker.model.decode``, whose
complaint then names what is wrong with a bad file. The header also gives the
decoded size, which the stage's staging byte budget counts before decoding.

A chunk's JPEGs are decoded in one ``torchvision.io.decode_jpeg(list, device=
"cuda")`` call into device memory, then copied device to device (planar CHW to
the interleaved HWC the preprocess kernel reads) into the slot's packed staging
buffer at their table offsets. No decoded pixel passes through the host.

Streams, from torchvision's source (``csrc/io/image/cuda/decode_jpegs_cuda.cpp``,
the same in 0.26 and 0.29):

- the decoder is one process-wide object behind a mutex, with its own stream
  from torch's pool; ``prepare_buffers`` allocates the outputs with
  ``torch::empty`` on the *caller's current stream*, which is the slot's stream
  here (``torch.cuda.stream(ExternalStream(slot.stream))``), so the outputs
  belong to that stream's pool in torch's caching allocator;
- ``decode_images`` ends with ``cudaStreamSynchronize`` on its own stream, and
  ``decode_jpegs_cuda`` then records an event there and makes the current stream
  wait on it (``event.record(stream); event.block(current_stream)``): the
  pixels are complete when the call returns, and anything enqueued on the slot's
  stream afterwards (our copies, the kernel) is ordered after the decode anyway;
- but nothing makes the decoder's stream wait for the caller's stream *before*
  nvJPEG writes the outputs, and nvJPEG's hardware path does not even honour
  its own stream's order (pytorch/vision#9606, meta-pytorch/torchcodec#1634): a
  block the allocator hands out because it was freed on the slot's stream while
  a queued kernel still reads it would be overwritten. So the slot's stream must
  be idle when we decode: the stage decodes only at the start of a batch or
  between chunks, when ``run_rows`` has waited for the stream, and ``decode``
  synchronises the stream once more (free when it is idle) to make that a fact
  rather than an assumption.

Memory: the decoded images come from torch's caching allocator (the slot's
stream's pool), at most one chunk's worth (``gpu.max_input_bytes``) per slot at a
time, and stay cached for the next batch, so a steady stream of batches makes
no ``cudaMalloc``; nvJPEG keeps its own pinned and device buffers besides.

torch and torchvision are imported only when ``gpu.decode = "nvjpeg"``; the
header reading and the routing are pure and run anywhere. For tests without a
GPU, ``NvJpeg(..., decoder="cpu")`` runs the same batching, fallbacks, checks and
placement with torchvision's CPU decoder into host tensors
(tests/unit/compute/test_nvjpeg_cpu.py); the worker never builds it so.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Final, Literal

import structlog

from worker.compute.engines.cuda import buffer_address, translate_gpu_error
from worker.compute.gpu.slots import DeviceImage, Slot
from worker.config import PreprocessConfig
from worker.contract import EncodedImage
from worker.contract.jpeg import read_frame
from worker.flow.errors import ConfigError, EngineDead
from worker.model.decode import decode_pending
from worker.model.preprocess import ImagePreprocess
from worker.model.rows import Row
from worker.obs import metrics

log = structlog.get_logger(__name__)

# Huffman-coded baseline, extended sequential and progressive: what nvJPEG decodes.
NVJPEG_PROCESSES: Final = frozenset({0xC0, 0xC1, 0xC2})


def device_image(image: EncodedImage, channels: int) -> DeviceImage | None:
    """The file as an image to decode with nvJPEG into ``channels`` channels, or None
    if it is one for the host decoder (see the module docstring)."""
    if image.format != "jpeg" or channels not in (1, 3):
        return None
    frame = read_frame(image.data)
    if frame is None or not frame.complete:
        return None  # the host decoder says what is wrong
    if frame.process not in NVJPEG_PROCESSES or frame.precision != 8:
        return None
    if frame.components not in (1, 3) or frame.height < 1 or frame.width < 1:
        return None  # CMYK/YCCK: converted the way Pillow converts them, on the host
    if frame.components == 3 and frame.adobe_transform == 0:
        return None  # samples stored as RGB, not YCbCr
    return DeviceImage(image.data, frame.height, frame.width, channels)


def check_config(decode: str, preprocess: PreprocessConfig | ImagePreprocess) -> None:
    """What ``gpu.decode = "nvjpeg"`` needs of the model (start-up, no GPU needed):
    the settings before the model is loaded, the resolved preprocessing after."""
    if decode != "nvjpeg":
        return
    if preprocess.device != "gpu":
        raise ConfigError(
            "gpu.decode: 'nvjpeg' keeps decoded pixels on the device and needs "
            "model.preprocess.device = 'gpu'"
        )
    if preprocess.channels not in (None, 1, 3):
        raise ConfigError(
            f"gpu.decode: 'nvjpeg' decodes to 1 or 3 channels, but "
            f"model.preprocess.channels is {preprocess.channels}; use 'host'"
        )


def check_available(decode: str, preprocess: PreprocessConfig | ImagePreprocess) -> None:
    """``check_config``, then that torch and torchvision with CUDA import: the
    worker calls it before loading the engine, so a missing library is exit 2 at
    once rather than after a long engine load."""
    check_config(decode, preprocess)
    if decode == "nvjpeg":
        _import_torchvision()


def _import_torchvision(need_cuda: bool = True) -> tuple[Any, Any, Any]:
    hint = (
        "gpu.decode = 'nvjpeg' needs torch and torchvision with CUDA "
        "(pip install -e '.[gpu,torch]'), or set gpu.decode = 'host'"
    )
    try:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg
    except (ImportError, OSError) as exc:  # OSError: a wheel's CUDA libraries missing
        raise ConfigError(f"{hint}: {type(exc).__name__}: {exc}") from exc
    if need_cuda and not torch.cuda.is_available():
        raise ConfigError(f"{hint}: torch {torch.__version__} sees no CUDA device")
    return torch, decode_jpeg, ImageReadMode


def _tiny_jpeg() -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.linspace(0, 255, 16 * 16 * 3).astype(np.uint8).reshape(16, 16, 3)
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"nvJPEG: {text[0] if text else type(exc).__name__}"


@dataclass
class _SlotViews:
    stream: Any  # torch.cuda.ExternalStream over the slot's CUDA stream
    packed: Any  # torch uint8 view of the slot's packed device staging (no copy)


class NvJpeg:
    """torchvision's nvJPEG decoder, for one GPU stage on one device.

    Built at start-up, where it fails with ``ConfigError`` if torch or torchvision
    is missing, has no CUDA, or cannot decode a JPEG on the device. ``decode`` and
    ``place`` run on the stage's threads, each for the slot that thread holds.
    """

    def __init__(
        self, device: int, channels: int, decoder: Literal["cuda", "cpu"] = "cuda"
    ) -> None:
        torch, decode_jpeg, modes = _import_torchvision(need_cuda=decoder == "cuda")
        self._on_cuda = decoder == "cuda"
        if self._on_cuda and device >= (count := torch.cuda.device_count()):
            raise ConfigError(f"gpu.device: {device}, but torch sees {count} CUDA device(s)")
        self._torch = torch
        self._decode_jpeg = decode_jpeg
        self._mode = modes.GRAY if channels == 1 else modes.RGB
        self._device = device
        self._target = torch.device("cuda", device) if self._on_cuda else torch.device("cpu")
        self._channels = channels
        self._views: dict[int, _SlotViews] = {}
        self._lock = threading.Lock()
        self.decoded = 0  # images nvJPEG decoded
        self.refused = 0  # images it refused (then decoded on the host)
        self._warm()

    def _warm(self) -> None:
        """Decode one small JPEG now: nvJPEG creates its handle and buffers on first
        use (hundreds of ms), and a torchvision built without nvJPEG fails here,
        at start-up, rather than on the first batch."""
        torch = self._torch
        with warnings.catch_warnings():
            # torch.frombuffer warns, once per process, that the bytes it wraps are
            # read-only (nvJPEG only reads them): let that one warning go here,
            # during start-up, rather than from a batch.
            warnings.simplefilter("ignore")
            try:
                source = torch.frombuffer(_tiny_jpeg(), dtype=torch.uint8)
                with self._on(None):
                    self._decode_jpeg([source], mode=self._mode, device=self._target)
                    if self._on_cuda:
                        torch.cuda.synchronize(self._device)
            except Exception as exc:  # boundary: any failure here means no nvJPEG
                raise ConfigError(
                    f"gpu.decode = 'nvjpeg': torchvision cannot decode JPEGs on "
                    f"{self._target}: {type(exc).__name__}: {exc}"
                ) from exc

    def _on(self, stream: Any) -> contextlib.ExitStack[bool | None]:
        """The device, and the stream when given, as torch's current ones."""
        stack = contextlib.ExitStack()
        if self._on_cuda:
            stack.enter_context(self._torch.cuda.device(self._device))
            if stream is not None:
                stack.enter_context(self._torch.cuda.stream(stream))
        return stack

    def attach(self, slot: Slot) -> None:
        """Wrap the slot's stream and packed device buffer for torch (start-up)."""
        torch = self._torch
        stream = None
        with self._on(None):
            if self._on_cuda:
                stream = torch.cuda.ExternalStream(int(slot.stream.ptr), device=self._target)
            packed = torch.from_dlpack(slot.dev_packed)
        if packed.data_ptr() != buffer_address(slot.dev_packed):
            raise ConfigError("gpu.decode: the DLPack import of the slot's staging made a copy")
        self._views[slot.index] = _SlotViews(stream, packed)

    def close(self) -> None:
        self._views.clear()

    def decode(self, slot: Slot, images: list[DeviceImage]) -> list[str | None]:
        """Decode ``images`` into device memory (their ``pixels``) in one batched
        call. Returns, per image, None or why nvJPEG refused it; a refused image
        has no pixels and is for the host decoder. Blocks until the pixels are
        written. Raises ``EngineDead`` if the device is gone."""
        if not images:
            return []
        torch = self._torch
        views = self._views[slot.index]
        # See the module docstring: nvJPEG's writes are not ordered after the
        # slot's stream, so nothing may still be queued on it.
        slot.stream.synchronize()
        sources = [torch.frombuffer(image.data, dtype=torch.uint8) for image in images]
        outputs: list[Any]
        with self._on(views.stream):
            try:
                outputs = list(self._decode_jpeg(sources, mode=self._mode, device=self._target))
            except RuntimeError as exc:  # boundary: one bad file fails the whole call
                self._check_alive(exc)
                outputs = [self._decode_one(s) for s in sources] if len(sources) > 1 else [exc]
        problems: list[str | None] = []
        for image, out in zip(images, outputs, strict=True):
            if isinstance(out, BaseException):
                problems.append(_first_line(out))
                continue
            expected = (image.channels, image.height, image.width)
            if tuple(out.shape) != expected:
                problems.append(f"nvJPEG decoded {list(out.shape)}; the header says {expected}")
                continue
            image.pixels = out
            problems.append(None)
        refused = sum(p is not None for p in problems)
        with self._lock:
            self.decoded += len(problems) - refused
            self.refused += refused
        metrics.IMAGES_DECODED.labels(decoder="nvjpeg", outcome="ok").inc(len(problems) - refused)
        if refused:
            metrics.IMAGES_DECODED.labels(decoder="nvjpeg", outcome="refused").inc(refused)
        return problems

    def _decode_one(self, source: Any) -> Any:
        try:
            return self._decode_jpeg([source], mode=self._mode, device=self._target)[0]
        except RuntimeError as exc:
            self._check_alive(exc)
            return exc

    @staticmethod
    def _check_alive(exc: RuntimeError) -> None:
        error = translate_gpu_error(exc, "nvjpeg")
        if isinstance(error, EngineDead):
            raise error from exc

    def decode_answers(
        self, slot: Slot, answers: list[Row], on_device: dict[int, DeviceImage], name: str
    ) -> tuple[list[Row], float]:
        """On a stage thread: one batched nvJPEG call for the group's JPEGs; those it
        refuses go to the host decoder (request input ``name``). Returns the answers
        that can run and the decode's seconds."""
        jpegs = [a for a in answers if id(a) in on_device]
        started = time.monotonic()
        problems = self.decode(slot, [on_device[id(a)] for a in jpegs])
        seconds = time.monotonic() - started
        refused: list[Row] = []
        for answer, problem in zip(jpegs, problems, strict=True):
            if problem is None:
                continue  # its pixels are on the device (``on_device``)
            del on_device[id(answer)]
            refused.append(answer)
            log.debug("nvjpeg_refused", offset=answer.job.offset, reason=problem)
        if refused:
            decode_pending(refused, self._channels, name)
        return [a for a in answers if a.error is None], seconds

    def place(self, slot: Slot, on_device: list[tuple[int, DeviceImage]]) -> None:
        """Enqueue on the slot's stream the device-to-device copies of the decoded
        images into the packed staging buffer at their byte offsets, planar CHW to
        the interleaved HWC the preprocess kernel reads.

        Images of one size that lie back to back in the buffer (``pack_batch``
        packs them so, in order) go as one run: one ``torch.stack`` and one
        strided copy for the run instead of a copy per image. Per image, the
        Python and torch dispatch of the slicing, view, permute and copy was the
        launcher thread's largest cost on the JPEG path (21% of the worker's
        samples on an H100, BENCHMARKS.md "The GPU path on an H100"). The stack
        takes one run's pixels again from the slot stream's pool in torch's
        caching allocator, at most ``gpu.max_input_bytes``, freed when the copy
        has run."""
        views = self._views[slot.index]
        with self._on(views.stream):
            for offset, run in _runs(on_device):
                first = run[0]
                hwc = views.packed[offset : offset + len(run) * first.nbytes]
                target = hwc.view(len(run), first.height, first.width, first.channels)
                if len(run) == 1:
                    target[0].copy_(first.pixels.permute(1, 2, 0))
                else:
                    pixels = self._torch.stack([image.pixels for image in run])
                    target.copy_(pixels.permute(0, 2, 3, 1))


def _runs(on_device: list[tuple[int, DeviceImage]]) -> list[tuple[int, list[DeviceImage]]]:
    """``on_device`` cut into runs of decoded images of one (channels, height,
    width) at consecutive offsets: (the run's first offset, its images)."""
    runs: list[tuple[int, list[DeviceImage]]] = []
    end = -1
    for offset, image in on_device:
        if image.pixels is None:
            raise ValueError("a device image was staged before it was decoded")
        if runs and offset == end and _shape(image) == _shape(runs[-1][1][0]):
            runs[-1][1].append(image)
        else:
            runs.append((offset, [image]))
        end = offset + image.nbytes
    return runs


def _shape(image: DeviceImage) -> tuple[int, int, int]:
    return image.channels, image.height, image.width
