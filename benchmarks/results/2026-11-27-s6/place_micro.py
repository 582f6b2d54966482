"""NvJpeg.place, per image against per run, on the device (issue-free GPU check,
2026-11-27 evening): the host microseconds the launcher thread spends enqueuing a
batch's device-to-device placement, and the batch's time to the stream's end.

    python3 benchmarks/results/2026-11-27-s6/place_micro.py OUT.json          # CUDA
    python3 benchmarks/results/2026-11-27-s6/place_micro.py OUT.json --cpu    # sanity, no GPU

"per image" is the loop ``place`` ran before this change (copied below);
"per run" is ``worker.compute.gpu.nvjpeg.NvJpeg.place`` itself. Both place the
same nvJPEG-decoded 256x256 JPEGs; their bytes are compared. Rounds alternate.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from tests.images import encode
from worker.compute.gpu.nvjpeg import NvJpeg
from worker.compute.gpu.slots import DeviceImage

SIDE = 256
ROUNDS = 5
ITERS = 40


def per_image(nv: NvJpeg, slot: Any, on_device: list[tuple[int, DeviceImage]]) -> None:
    """The placement before this change: one strided copy per image."""
    views = nv._views[slot.index]
    with nv._on(views.stream):
        for offset, image in on_device:
            hwc = views.packed[offset : offset + image.nbytes]
            hwc.view(image.height, image.width, image.channels).copy_(image.pixels.permute(1, 2, 0))


def main() -> None:
    out, cpu = sys.argv[1], "--cpu" in sys.argv
    rng = np.random.default_rng(3)
    base = np.clip(
        np.linspace(0, 255, SIDE * SIDE * 3).reshape(SIDE, SIDE, 3)
        + rng.normal(0, 20, (SIDE, SIDE, 3)),
        0,
        255,
    ).astype(np.uint8)
    nv = NvJpeg(0, 3, decoder="cpu" if cpu else "cuda")
    if cpu:
        stream = SimpleNamespace(synchronize=lambda: None)
        make = lambda n: np.zeros(n, np.uint8)  # noqa: E731
    else:
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        make = lambda n: cupy.zeros(n, cupy.uint8)  # noqa: E731
    report: dict[str, Any] = {"device": "cpu" if cpu else nv._torch.cuda.get_device_name(0)}
    for batch in (16, 64):
        files = [encode(np.roll(base, 7 * i, axis=1), "JPEG", quality=90) for i in range(batch)]
        nbytes = SIDE * SIDE * 3
        slot = SimpleNamespace(index=batch, stream=stream, dev_packed=make(batch * nbytes))
        nv.attach(slot)
        images = [DeviceImage(f, SIDE, SIDE, 3) for f in files]
        assert nv.decode(slot, images) == [None] * batch
        on_device = [(i * nbytes, im) for i, im in enumerate(images)]
        results: dict[str, dict[str, list[float]]] = {}
        placed: dict[str, bytes] = {}
        for _ in range(ROUNDS):
            for name, fn in (("per_image", per_image), ("per_run", NvJpeg.place)):
                host, total = [], []
                for _ in range(ITERS):
                    stream.synchronize()
                    t0 = time.perf_counter()
                    fn(nv, slot, on_device)
                    t1 = time.perf_counter()
                    stream.synchronize()
                    t2 = time.perf_counter()
                    host.append((t1 - t0) * 1e6)
                    total.append((t2 - t0) * 1e6)
                r = results.setdefault(name, {"host_us": [], "to_end_us": []})
                r["host_us"].append(statistics.median(host))
                r["to_end_us"].append(statistics.median(total))
                dev = slot.dev_packed
                placed[name] = bytes(dev if cpu else dev.get())
                dev.fill(0)
        assert placed["per_image"] == placed["per_run"], "the two placements differ"
        summary = {
            name: {k: {"median": statistics.median(v), "rounds": v} for k, v in r.items()}
            for name, r in results.items()
        }
        ratio = summary["per_image"]["host_us"]["median"] / summary["per_run"]["host_us"]["median"]
        summary["host_ratio_per_image_to_per_run"] = ratio
        report[f"batch_{batch}"] = summary
        print(
            f"batch {batch}: host us per image {summary['per_image']['host_us']['median']:.0f}"
            f" per run {summary['per_run']['host_us']['median']:.0f} ({ratio:.1f}x);"
            f" to end {summary['per_image']['to_end_us']['median']:.0f}"
            f" / {summary['per_run']['to_end_us']['median']:.0f}",
            flush=True,
        )
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
