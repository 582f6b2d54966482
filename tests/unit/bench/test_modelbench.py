"""``bench --model``'s pure parts: names, summaries, the drain's span and its
refusals; payloads the worker's own decoder reads back. The run itself is
exercised in tests/integration/test_modelbench.py."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.__main__ import main
from worker.bench.backlog import (
    DRAIN_SECONDS,
    PROCESS_RATE,
    plan_backlog,
    short_drain_note,
)
from worker.bench.drain import Sample, all_joined, busy_fraction, score_drain
from worker.bench.engine import engine_rate
from worker.bench.openloop import STAGES, stage_summary
from worker.bench.options import BenchError, model_overrides
from worker.bench.payloads import (
    encode_image,
    payload_images,
    payload_inputs,
    request_records,
    requests,
)
from worker.bench.report import device_slug, results_path
from worker.config import load_settings
from worker.contract import EncodedImage, Tensor, decode_request
from worker.model.decode import decode_image
from worker.ops.processes import override_env
from worker.ops.topics import Collected


@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("Tesla T4", "t4"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA RTX A6000", "rtxa6000"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA", "gpu"),
    ],
)
def test_device_slug(name: str, slug: str) -> None:
    assert device_slug(name) == slug


def test_results_path_never_overwrites(tmp_path: Path) -> None:
    day = dt.date(2026, 11, 23)
    first = results_path(tmp_path, day, "h100", "jpeg")
    assert first == tmp_path / "2026-11-23-h100-jpeg.json"
    first.write_text("{}")
    second = results_path(tmp_path, day, "h100", "jpeg")
    assert second == tmp_path / "2026-11-23-h100-jpeg-2.json"
    second.write_text("{}")
    assert results_path(tmp_path, day, "h100", "jpeg").name == "2026-11-23-h100-jpeg-3.json"
    assert results_path(tmp_path, day, "h100", "raw").name == "2026-11-23-h100-raw.json"
    assert results_path(tmp_path, day, "h100", "jpeg", 4).name == "2026-11-23-h100-jpeg-procs4.json"


def test_stage_summary_percentiles_in_ms_contract_stages_first() -> None:
    timings = [
        {"total": 1000 * (i + 1), "queue": 500, "infer": 2000 * i, "decode": 7, "d2h": 0,
         "preprocess": 100}
        for i in range(101)
    ]  # fmt: skip
    out = stage_summary(timings)
    assert list(out) == [*STAGES, "decode"]
    assert out["total"] == {"p50_ms": 51.0, "p99_ms": 100.0}
    assert out["infer"] == {"p50_ms": 100.0, "p99_ms": 198.0}
    assert out["queue"] == {"p50_ms": 0.5, "p99_ms": 0.5}
    assert stage_summary([]) == {}


def test_all_joined_needs_every_member_and_every_partition_once() -> None:
    assert all_joined((4,), 4)
    assert not all_joined((4, 0), 4)  # the second member has not joined yet
    assert not all_joined((4, 2), 4)  # mid-rebalance: the old owner still holds them
    assert all_joined((2, 2), 4)
    assert all_joined((1, 1, 0, 1), 3)  # more members than partitions
    assert not all_joined((2, 1, 0, 0), 3)


def _results(times: list[float]) -> list[Collected]:
    return [Collected(f"k{i}".encode(), b"", {}, 0, i, t) for i, t in enumerate(times)]


def _sample(at: float, assigned: tuple[int, ...], rows: float, batches: float) -> Sample:
    return Sample(at, assigned, rows, batches, gpu_busy=at / 10)


def test_one_process_is_timed_over_the_middle_of_its_drain() -> None:
    # A first batch of 64 at t = 10, then 100 results over the next second: the
    # rate counts what arrived after the steady window's clock started.
    results = _results([10.0] * 64 + [10.0 + (i + 1) * 0.01 for i in range(100)])
    samples = [_sample(9.0, (4,), 0, 0), _sample(10.5, (4,), 3200, 50)]
    final = _sample(11.5, (4,), 6400, 100)
    drain = score_drain(results, samples, 1, 4, final)
    assert drain.rate == pytest.approx(100.0)
    assert drain.first_to_last_rate == pytest.approx(100.0)
    assert drain.seconds == pytest.approx(1.0)
    assert drain.steady_seconds == pytest.approx(0.79)  # 10.11 .. 10.90: 10% off each end
    assert drain.mean_batch == 64.0 and drain.join_seconds == 0.0
    assert drain.gpu_busy == pytest.approx(1.05)  # the one sample inside the window


def test_warm_up_and_run_out_are_left_out_of_the_rate() -> None:
    """A slow start (10/s for 5 s), 400 results at 100/s, then a slow end: the
    first-to-last rate mixes them (36/s); the steady rate is the middle's."""
    warm = [0.1 * i for i in range(50)]
    steady = [5.0 + 0.01 * (j + 1) for j in range(400)]
    tail = [9.0 + 0.1 * (k + 1) for k in range(50)]
    drain = score_drain(_results(warm + steady + tail), [], 1, 4, _sample(15.0, (4,), 0, 0))
    assert drain.first_to_last_rate == pytest.approx(499 / 14.0)
    assert drain.rate == pytest.approx(400 / 4.09)  # 5.01 .. 9.1
    assert drain.seconds == pytest.approx(14.0)


def test_a_drain_read_in_few_bursts_takes_its_whole_span() -> None:
    """1,500 results read in two bursts (a small backlog in 256-row batches): the
    trimmed window holds one instant, so the whole span is the window (its rate,
    and steady seconds that are not 0: CI's PNG bench run failed on 0); all at
    one instant, no rate can be measured and the bench says so."""
    times = [1.0] * 700 + [1.5] * 800
    drain = score_drain(_results(times), [], 1, 4, _sample(5.0, (4,), 0, 0))
    assert drain.rate == drain.first_to_last_rate == pytest.approx(800 / 0.5)
    assert drain.steady_seconds == drain.seconds == pytest.approx(0.5)
    with pytest.raises(BenchError, match="arrived at once"):
        score_drain(_results([1.0] * 1500), [], 1, 4, _sample(5.0, (4,), 0, 0))


def test_several_processes_drain_from_when_all_hold_partitions() -> None:
    # One member drains alone from t=10 until the second joins at t=12.
    results = _results([10.0 + i / 10 for i in range(41)])  # t = 10 .. 14
    samples = [
        _sample(10.0, (4, 0), 100, 10),
        _sample(11.0, (4, 2), 200, 20),  # rebalancing
        _sample(12.0, (2, 2), 400, 40),  # the whole group, from here
        _sample(13.0, (2, 2), 1000, 50),
    ]
    final = _sample(14.5, (2, 2), 2000, 60)
    drain = score_drain(results, samples, 2, 4, final)
    assert drain.join_seconds == pytest.approx(2.0)
    # The 20 results after t = 12; the steady window 12.3 .. 13.8 holds 15 of them.
    assert drain.rate == pytest.approx(15 / 1.5)
    assert drain.seconds == pytest.approx(2.0)
    assert drain.first_to_last_rate == pytest.approx(40 / 4.0)
    assert drain.mean_batch == pytest.approx((2000 - 400) / (60 - 40))
    assert drain.gpu_busy == pytest.approx(1.3)  # the sample at 13.0


def test_a_backlog_gone_before_the_group_formed_is_refused() -> None:
    results = _results([10.0, 10.5, 11.0])
    samples = [_sample(10.0, (4, 0), 0, 0), _sample(12.0, (2, 2), 0, 0)]
    with pytest.raises(BenchError, match="--records"):
        score_drain(results, samples, 2, 4, samples[-1])


def test_each_process_gpu_memory_is_its_peak_over_the_drain() -> None:
    """``run --procs N`` on one GPU: what each member held, from its own gauge
    (a device-wide figure would count every process N times)."""
    from worker.bench.drain import peak_gpu_memory, process_gpu_memory

    scraped = {'infer_gpu_process_memory_bytes{device="0",uuid="GPU-1"}': 3e9,
               "infer_assigned_partitions": 2.0}  # fmt: skip
    assert process_gpu_memory(scraped) == 3e9
    assert process_gpu_memory({"infer_assigned_partitions": 2.0}) is None
    samples = [
        Sample(1.0, (2, 2), 0, 0, None, (1e9, None)),
        Sample(2.0, (2, 2), 0, 0, None, (3e9, None)),
        Sample(3.0, (2, 2), 0, 0, None, (2e9, None)),
    ]
    assert peak_gpu_memory(samples) == [3e9, None]
    results = _results([1.0 + i / 10 for i in range(21)])
    drain = score_drain(results, samples, 2, 4, samples[-1])
    assert drain.gpu_memory_per_process == (3e9, None)


def test_busy_fraction_is_none_without_samples_in_the_span() -> None:
    no_nvml = [Sample(t, (1,), 0, 0, None) for t in (1.0, 2.0)]
    assert busy_fraction(no_nvml, 0.0, 3.0) is None
    assert busy_fraction([Sample(5.0, (1,), 0, 0, 0.5)], 0.0, 3.0) is None


@pytest.mark.parametrize("payload", ["raw", "png", "jpeg"])
def test_digit_payloads_decode_as_the_worker_decodes_them(payload: str) -> None:
    images = payload_images("digits")
    assert {img.shape for img in images} == {(8, 8, 1), (16, 16, 1), (24, 24, 1)}
    inputs = [encode_image(img, payload) for img in images[:3]]
    records = request_records("image", inputs, "t", 5)
    assert [k for k, _ in records] == [f"t-{i}".encode() for i in range(5)]
    request = decode_request(records[4][1])  # cycles: the second image again
    assert request.id == "t-4"
    image = request.inputs["image"]
    if payload == "raw":
        assert isinstance(image, Tensor)
        assert np.array_equal(image.to_numpy(), images[1])
        return
    assert isinstance(image, EncodedImage) and image.format == payload
    decoded = decode_image(image, channels=1)
    assert decoded.shape == images[1].shape
    if payload == "png":  # lossless
        assert np.array_equal(decoded, images[1])


def test_resnet50_settings_parse_as_the_worker_reads_them() -> None:
    env = override_env({**model_overrides("resnet50"), "model.path": "resnet50.pt2"})
    s = load_settings(env=env)
    assert s.model.backend == "torch" and s.model.path == "resnet50.pt2"
    p = s.model.preprocess
    # float32 in, as build-engine exports the program; computed in float16.
    assert (p.size, p.channels, p.dtype, p.device) == ((224, 224), 3, "float32", "gpu")
    assert s.model.torch.precision == "float16"
    assert p.mean == (0.485, 0.456, 0.406) and p.std == (0.229, 0.224, 0.225)
    assert s.gpu.decode == "nvjpeg"


def test_resnet50_photographs() -> None:
    pytest.importorskip("skimage", reason="scikit-image (the bench extra) ships the photos")
    images = payload_images("resnet50")
    assert len(images) >= 4
    assert all(img.shape == (256, 256, 3) and img.dtype == np.uint8 for img in images)
    jpeg = encode_image(images[0], "jpeg")
    assert isinstance(jpeg, EncodedImage) and 5_000 < jpeg.nbytes < 60_000


def test_cpu_engine_alone_runs_the_largest_batch() -> None:
    settings = load_settings(env={"INFER_WORKER_BATCHING__MAX_BATCH_SIZE": "32"})
    name, inputs = payload_inputs("digits", "png")
    assert engine_rate(settings, requests(name, inputs, "e", 3), seconds=0.05) > 0


def test_without_scikit_image_resnet50_exits_2_saying_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "skimage", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "skimage.data", None)
    assert main(["bench", "--model", "resnet50", "--payload", "jpeg"]) == 2
    assert "scikit-image" in capsys.readouterr().err


def test_without_torch_resnet50_exits_2_saying_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("skimage", reason="the photos are loaded first")
    for name in ("torch", "torchvision"):  # imports fail as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["bench", "--model", "resnet50", "--payload", "raw"]) == 2
    assert "PyTorch" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--procs", "2"], "--procs: only with --model"),
        (["bench", "--payload", "png"], "--payload: only with --model"),
        (["bench", "--model", "digits", "--sweep"], "not with --sweep"),
        (["bench", "--model", "digits", "--procs", "0"], "--procs: must be >= 1"),
        (["bench", "--senders", "2"], "--senders: only with --model"),
        (["bench", "--model", "digits", "--senders", "0"], "--senders: must be >= 1"),
        (["bench", "--model", "digits", "--records", "0"], "--records: must be >= 1"),
        (["bench", "--model", "digits", "--duration", "0"], "--duration"),
        (["bench", "--model", "digits", "--payload", "text"], "digits takes jpeg, png, raw"),
        (["bench", "--model", "sentiment", "--payload", "png"], "sentiment takes text, not png"),
    ],
)
def test_refused_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_backlog_lasts_ten_seconds_at_the_lowest_expected_rate() -> None:
    # digits on the CPU: the engine alone is far faster; the processes bind.
    digits = plan_backlog("digits", "raw", 2, engine_img_s=3e6, record_bytes=150)
    assert digits.bound == "processes"
    assert digits.records == 2 * PROCESS_RATE[("digits", "raw")] * DRAIN_SECONDS
    # An engine at 10k img/s under 4 processes: 10,000 records would last one
    # second; this lasts ten.
    jpeg = plan_backlog("resnet50", "jpeg", 4, engine_img_s=10_000, record_bytes=19_500)
    assert (jpeg.bound, jpeg.records, jpeg.seconds) == ("engine", 100_000, 10.0)
    # At 25k, four processes of JPEGs are the broker's (320 MB/s), as measured.
    fast = plan_backlog("resnet50", "jpeg", 4, engine_img_s=25_000, record_bytes=19_500)
    assert fast.bound == "broker" and fast.expected_rate == pytest.approx(16_410, rel=1e-3)
    # Raw 256x256 pixels: the broker's bytes bind, 3.2 GB in all.
    raw = plan_backlog("resnet50", "raw", 4, engine_img_s=20_000, record_bytes=196_700)
    assert raw.bound == "broker" and raw.records * 196_700 == pytest.approx(3.2e9, rel=1e-3)
    assert plan_backlog("digits", "png", 1, engine_img_s=10, record_bytes=200).records == 1000


def test_a_drain_shorter_than_ten_seconds_says_how_many_records_would_fill_them() -> None:
    assert short_drain_note(12.0, 5000, 60_000) is None
    note = short_drain_note(4.0, 10_000, 40_000)
    assert note is not None and "--records 120000" in note and "4.0 s" in note
