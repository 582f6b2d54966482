"""Encoded images end to end (issue 9): files answered like tensors, bad files
answered precisely, nothing sent to the DLQ, memory flat against a PNG bomb."""

from __future__ import annotations

import numpy as np
import pytest

from tests.images import encode, png_bomb
from tests.integration.test_pipeline import collect, start_worker
from worker.bench.demo import labelled_samples
from worker.contract import EncodedImage, Request, Tensor, encode_request
from worker.ops.broker import Broker, create_topics
from worker.ops.topics import produce_all

pytestmark = pytest.mark.integration


def _request(rid: str, image: Tensor | EncodedImage) -> bytes:
    return encode_request(Request(v=1, id=rid, inputs={"image": image}))


def _file(data: bytes) -> EncodedImage:
    return EncodedImage("png", data)  # the format field is not sent: the worker sniffs


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


async def test_files_are_answered_like_tensors_and_bad_files_precisely(
    broker: Broker, names: dict[str, str]
) -> None:
    topics = {names["requests"]: 1, names["results"]: 1, names["dlq"]: 1}
    await create_topics(broker.bootstrap, topics)
    samples = labelled_samples(2)[350:370]  # 8x8 and 16x16 digits
    records = []
    for s in samples:
        records.append((b"k", _request(f"raw-{s.id}", Tensor.from_numpy(s.image))))
        records.append((b"k", _request(f"png-{s.id}", _file(encode(s.image, "PNG")))))
    photo = np.kron(samples[0].image, np.ones((8, 8, 1), np.uint8))
    jpeg = encode(photo, "JPEG", quality=95)
    corrupt = bytearray(encode(photo, "PNG"))  # a sound header, a broken zlib stream
    at = corrupt.find(b"IDAT") + 20
    corrupt[at : at + 30] = bytes(30)
    records += [
        (b"k", _request("corrupt-png", _file(bytes(corrupt)))),
        (b"k", _request("jpeg", _file(jpeg))),
        (b"k", _request("webp", _file(encode(photo, "WEBP", lossless=True)))),
        (b"k", _request("truncated", _file(jpeg[: len(jpeg) // 2]))),
        (b"k", _request("bomb", _file(png_bomb()))),
        (b"k", _request("bomb-below-decoder-guard", _file(png_bomb(6000, 6000)))),
        (b"k", _request("garbage", _file(b"\x00\x01 not an image"))),
    ]
    w = await start_worker(broker, names, 1)
    try:
        await produce_all(broker.bootstrap, names["requests"], records)
        c = await collect(broker, [names["results"], names["dlq"]], len(records))
        peak_kib = _peak_rss_kib(w.pid)
        decoded = {
            k: v for k, v in w.metrics().items() if k.startswith("infer_images_decoded_total")
        }
    finally:
        assert w.terminate() == 0
    assert c.count(names["dlq"]) == 0  # the envelope decoded: never the DLQ
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    for s in samples:
        raw, png = results[f"raw-{s.id}"], results[f"png-{s.id}"]
        assert raw.status == png.status == "ok", (raw.error, png.error)
        for name in ("topk_indices", "topk_scores"):  # exactly the raw tensor's answer
            assert raw.outputs[name].data == png.outputs[name].data
        assert "decode" in png.timing_us and "decode" not in raw.timing_us
    assert results["jpeg"].status == "ok" and results["webp"].status == "ok"
    bad = {
        "truncated": ("invalid_request", "truncated"),
        "corrupt-png": ("invalid_request", "broken data stream"),
        "bomb": ("too_large", "exceeds"),
        "bomb-below-decoder-guard": ("too_large", "6000x6000 exceeds"),
        "garbage": ("invalid_request", "not a JPEG, PNG or WebP"),
    }
    for rid, (code, text) in bad.items():
        err = results[rid].error
        assert err is not None and err.code == code, (rid, err)
        assert text.lower() in err.message.lower(), (rid, err)
    # 20 PNGs, the JPEG and the WebP decoded; the corrupt PNG failed in the
    # decoder; the truncated file, the bombs and the garbage never reached it
    # (refused from their headers and magic bytes).
    assert decoded == {
        'infer_images_decoded_total{decoder="host",outcome="ok"}': 22.0,
        'infer_images_decoded_total{decoder="host",outcome="invalid"}': 1.0,
    }, decoded
    # A decoded 40000x40000 RGB image would take 4.8 GB; the worker stays small.
    assert peak_kib < 600 * 1024, f"peak RSS {peak_kib} KiB"
