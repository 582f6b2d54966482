"""Functions the pipeline tests name as steps (``function = "tests.pipeline_functions:..."``):
what a user writes between two models, numpy in, numpy out."""

from __future__ import annotations

import numpy as np

WINDOW = 76  # mel frames openWakeWord's embedding model takes


def mel_window(mel: np.ndarray) -> dict[str, np.ndarray]:
    """openWakeWord's step between its melspectrogram and embedding models: the
    spectrogram scaled as it scales it (x / 10 + 2) and its last 76 frames, with
    the channel axis the embedding model takes."""
    frames = mel[0] / 10.0 + 2.0
    if frames.shape[0] < WINDOW:
        raise ValueError(f"{frames.shape[0]} mel frames; the embedding takes {WINDOW}")
    return {"frames": np.ascontiguousarray(frames[-WINDOW:, :, None], dtype=np.float32)}


def doubled(x: np.ndarray) -> dict[str, np.ndarray]:
    """The smallest function step: its input, doubled (a pipeline over the bundled
    digits model in the fault tests)."""
    return {"y": x * 2}


def tiles(image: np.ndarray) -> dict[str, np.ndarray]:
    """A fan-out step: 0, 1 or 2 regions of an image (as its first pixel says),
    each the image shifted along its width."""
    n = int(image[0, 0, 0]) % 3
    shifted = [np.roll(image, k + 1, axis=1) for k in range(n)]
    return {"tile": np.stack(shifted) if shifted else np.zeros((0, *image.shape), image.dtype)}


def corner_boxes(image: np.ndarray) -> dict[str, np.ndarray]:
    """A stand-in detector's boxes (x0, y0, x1, y1): the whole image and its
    top-left quarter."""
    h, w = image.shape[:2]
    return {"boxes": np.array([[0, 0, w, h], [0, 0, w / 2, h / 2]], np.float32)}


# PaddleOCR's detector -> boxes -> crops -> recogniser, the steps between the models
# (tests/integration/test_pipelines.py): numpy stand-ins for RapidOCR's own.


def row_runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Each run of true values in ``rows`` as (first, past the last)."""
    runs, y = [], 0
    while y < len(rows):
        if not rows[y]:
            y += 1
            continue
        top = y
        while y < len(rows) and rows[y]:
            y += 1
        runs.append((top, y))
    return runs


def text_boxes(prob: np.ndarray) -> dict[str, np.ndarray]:
    """The detector's probability map ``[1, H, W]`` as boxes (x0, y0, x1, y1): each
    run of rows holding pixels over 0.3, the columns they span, padded by half the
    run's height (as DB post-processing unclips a text region)."""
    hit = prob[0] > 0.3
    boxes = []
    for top, y in row_runs(hit.any(axis=1)):
        cols = np.where(hit[top:y].any(axis=0))[0]
        pad = (y - top) / 2
        boxes.append([cols.min() - pad, top - pad, cols.max() + 1 + pad, y + pad])
    return {"boxes": np.array(boxes, np.float32).reshape(-1, 4)}


def pixels(x: np.ndarray) -> dict[str, np.ndarray]:
    """The detector's normalised input ``[3, H, W]`` back to uint8 pixels ``[H, W, 3]``."""
    restored = np.clip(np.round((x * 0.5 + 0.5) * 255.0), 0, 255).astype(np.uint8)
    return {"image": np.ascontiguousarray(restored.transpose(1, 2, 0))}


def rec_input(crop: np.ndarray) -> dict[str, np.ndarray]:
    """A crop ``[48, W, 3]`` as the recogniser takes it: ``[3, 48, W]``, in -1..1."""
    scaled = (crop.astype(np.float32) / 255.0 - 0.5) / 0.5
    return {"x": np.ascontiguousarray(scaled.transpose(2, 0, 1))}


def greedy(probs: np.ndarray) -> dict[str, np.ndarray]:
    """CTC's greedy reading: the likeliest character index at every step."""
    return {"ids": probs.argmax(axis=-1).astype(np.int64)}


def unsure_doubled(x: np.ndarray) -> dict[str, np.ndarray]:
    """``doubled``, refusing scores the model is sure of (over 0.8): a pipeline
    whose answers show it answered (the sweep's test)."""
    if x[0] > 0.8:
        raise ValueError("too sure")
    return doubled(x)


# Preprocessing before the first model (declared pipeline inputs, issue 65).


def standardise(raw: np.ndarray) -> dict[str, np.ndarray]:
    """Raw features scaled as a model was trained on them: (x - 1.5) / 2."""
    return {"features": ((raw - 1.5) / 2.0).astype(np.float32)}


def as_floats(pixels: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 pixels [H, W, 1] as a detector takes them: float32 [1, H, W] in 0..1."""
    return {"x": (pixels[None, :, :, 0].astype(np.float32) / 255.0)}


def peak_boxes(heat: np.ndarray) -> dict[str, np.ndarray]:
    """A detector's map [1, h, w] as one box (x0, y0, x1, y1) in the input's
    pixels: the 12x12 window the map's peak was computed from."""
    y, x = np.unravel_index(int(np.argmax(heat[0])), heat[0].shape)
    return {"boxes": np.array([[x, y, x + 12, y + 12]], np.float32)}


def candidates(heat: np.ndarray) -> dict[str, np.ndarray]:
    """Every position of a detector's map [1, h, w] as a candidate box (the 12x12
    window it was computed from) with its score."""
    h, w = heat.shape[1:]
    ys, xs = np.mgrid[0:h, 0:w]
    x0, y0 = xs.ravel().astype(np.float32), ys.ravel().astype(np.float32)
    boxes = np.stack([x0, y0, x0 + 12, y0 + 12], axis=1)
    return {"boxes": boxes, "scores": heat[0].ravel().astype(np.float32)}


def to_pixels(boxes: np.ndarray, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """Boxes found on a 32x32 resize, in the original image's pixels."""
    h, w = pixels.shape[:2]
    scale = np.array([w / 32, h / 32, w / 32, h / 32], np.float32)
    return {"boxes": (boxes * scale).astype(np.float32)}


# A branch and an optional step (issue 65).


def gate(raw: np.ndarray) -> dict[str, np.ndarray]:
    """A cheap decision: the expensive model runs only where the first feature is
    over 1.5; the features passed on as they are."""
    return {"go": np.array([raw[0] > 1.5], np.uint8), "features": raw.astype(np.float32)}


def fragile(features: np.ndarray) -> dict[str, np.ndarray]:
    """An optional step that fails some requests (a negative second feature)."""
    if features[1] < 0:
        raise ValueError(f"feature 1 is {features[1]:.3f}, under 0")
    return {"y": np.sqrt(features[1:2]).astype(np.float32)}


def regions(pixels: np.ndarray, boxes: np.ndarray) -> dict[str, np.ndarray]:
    """A fan-out of a user's own: each box's 16x16 crop and the box, one region
    each (so the steps after it know their region's box)."""
    from worker.compute.ops.crops import crop_boxes

    crops = crop_boxes(pixels, boxes, size=(16, 16))["crops"]
    return {"crop": crops, "box": boxes.astype(np.float32).reshape(-1, 4)}


def refine(crop: np.ndarray, box: np.ndarray) -> dict[str, np.ndarray]:
    """A stand-in refiner: the region's box shrunk towards its brightest quarter."""
    h, w = crop.shape[:2]
    quarters = [crop[:h // 2, :w // 2], crop[:h // 2, w // 2:], crop[h // 2:, :w // 2],
                crop[h // 2:, w // 2:]]  # fmt: skip
    q = int(np.argmax([float(x.mean()) for x in quarters]))
    x0, y0, x1, y1 = (float(v) for v in box)
    dx, dy = (x1 - x0) / 4, (y1 - y0) / 4
    shift_x, shift_y = (q % 2) * dx, (q // 2) * dy
    return {"box": np.array([[x0 + shift_x, y0 + shift_y, x1 - dx + shift_x,
                              y1 - dy + shift_y]], np.float32)}  # fmt: skip


def bright(tile: np.ndarray) -> dict[str, np.ndarray]:
    """A branch per region: whether a tile's top-left pixel is brighter than
    mid-grey (the tiles of one image are shifted: they differ there)."""
    return {"go": np.array([tile[0, 0, 0] > 127], np.bool_)}


def strip(tile: np.ndarray) -> dict[str, np.ndarray]:
    """A per-region output whose regions differ in shape: the first 1 to 5 pixels
    of a tile's first row (as many as its first pixel says)."""
    return {"row": np.ascontiguousarray(tile[0, : 1 + int(tile[0, 0, 0]) % 5, 0])}


def short_when_large(raw: np.ndarray) -> dict[str, np.ndarray]:
    """``standardise``, but a request whose first value is over 50 loses its last
    feature (a free-length output a model of fixed inputs cannot take)."""
    features = standardise(raw)["features"]
    return {"features": features[:3] if raw[0] > 50 else features}


def scattered_boxes(pixels: np.ndarray) -> dict[str, np.ndarray]:
    """A stand-in detector's boxes and scores, from the pixels: 1 to 6 boxes
    inside the image (overlapping, for nms to thin), and one wholly outside it
    where the second pixel is over 250 (a box crop_boxes refuses)."""
    h, w = pixels.shape[:2]
    n = 1 + int(pixels[0, 0, 0]) % 6
    rng = np.random.default_rng(int(pixels[0, 0, 0]) * 256 + int(pixels[-1, -1, 0]))
    x0, y0 = rng.uniform(0, w - 4, n), rng.uniform(0, h - 4, n)
    boxes = np.stack([x0, y0, x0 + rng.uniform(3, w / 2, n), y0 + rng.uniform(3, h / 2, n)], 1)
    if pixels[0, 1, 0] > 250:
        boxes[-1] = [w + 5, h + 5, w + 9, h + 9]
    return {"boxes": boxes.astype(np.float32), "scores": rng.random(n).astype(np.float32)}


SEEN_ROWS: list[int] = []  # the rows each call of ``standardise_rows`` was given


def standardise_rows(raw: np.ndarray) -> dict[str, np.ndarray]:
    """``standardise`` as a vectorized step calls it (rows first), noting how
    many rows each call had; refusing a batch with a row whose first value is
    over 50 (the rows then go one by one, and only that one fails)."""
    SEEN_ROWS.append(len(raw))
    if (raw[:, 0] > 50).any():
        raise ValueError(f"{int((raw[:, 0] > 50).sum())} rows over 50")
    return standardise(raw)


def corner(tile: np.ndarray) -> dict[str, np.ndarray]:
    """A per-region output of two dimensions that differ by region: the first 1
    to 3 rows (as many as its first pixel says) of a tile's first two columns."""
    return {"block": np.ascontiguousarray(tile[: 1 + int(tile[0, 0, 0]) % 3, :2, 0])}


def doubled_in_place(p: np.ndarray) -> dict[str, np.ndarray]:
    """A function that (wrongly) writes into its input."""
    p *= 2
    return {"p": p}
