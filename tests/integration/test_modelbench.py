"""``bench --model digits`` and ``--model sentiment`` end to end, as CI runs it:
the embedded broker, the engine alone, the bare-consumer drain, ``run --procs N``
draining the same backlog with every request answered, and the paced run with
its stages."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from worker.bench.openloop import STAGES

pytestmark = pytest.mark.integration


def _bench(tmp_path: Path, *args: str, model: str = "digits") -> tuple[dict[str, Any], Path, str]:
    out = tmp_path / "copy.json"
    results = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable, "-m", "worker", "bench", "--model", model, *args,
            "--duration", "1", "--results-dir", str(results), "--json", str(out),
        ],
        capture_output=True,
        check=False,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = sorted(results.iterdir())
    assert len(written) == 1
    summary = json.loads(written[0].read_text())
    assert json.loads(out.read_text()) == summary
    return summary, written[0], proc.stdout


def _check_common(
    summary: dict[str, Any], payload: str, procs: int, records: int, model: str = "digits"
) -> None:
    assert summary["device"] == f"cpu{os.cpu_count()}"
    assert (summary["model"], summary["payload"], summary["procs"]) == (model, payload, procs)
    assert summary["records"] == records and summary["worker_exit"] == 0
    assert summary["records_sized_by"] == "--records"
    # The steady window lies inside the drain and holds most of it (10% off each end).
    assert 0 < summary["worker_steady_s"] <= summary["worker_drain_s"]
    assert summary["worker_first_to_last_img_s"] > 0
    for key in ("engine_img_s", "ingest_ceiling_rec_s", "worker_img_s"):
        assert summary[key] > 0, key
    # As many bare readers as the worker has processes (issue 66: the ceiling it meets).
    assert summary["ingest_ceiling_readers"] == min(procs, summary["partitions"])
    # The ratios are those of the figures in the same summary.
    assert summary["worker_to_ceiling"] == pytest.approx(
        summary["worker_img_s"] / summary["ingest_ceiling_rec_s"], rel=1e-3, abs=1e-4
    )
    assert summary["worker_to_engine"] == pytest.approx(
        summary["worker_img_s"] / summary["engine_img_s"], rel=1e-3, abs=1e-4
    )
    # The batch size the worker derives from the model, for the engine alone too:
    # the digits model's small fixed rows 256, a text model's free lengths 64.
    derived = 256 if model == "digits" else 64
    assert 1 <= summary["mean_batch"] <= summary["engine_batch"] == derived
    assert summary["gpu_busy"] is None and summary["gpu_busy_note"]
    paced = summary["paced"]
    # Paced at half the measured drain rate, for --duration 1 s; all answered ok.
    assert paced["rate"] == pytest.approx(summary["worker_img_s"] / 2, rel=1e-3, abs=0.1)
    assert paced["sent"] == paced["answered"] and paced["errors"] == 0
    assert abs(paced["sent"] - paced["rate"]) <= 1
    # One sender process per worker process unless --senders says otherwise.
    assert paced["senders"] == procs and f"--senders {procs}" in summary["command"]
    assert 0 < paced["p50_ms"] <= paced["p95_ms"] <= paced["p99_ms"] <= paced["max_ms"]
    assert list(paced["stages"])[: len(STAGES)] == list(STAGES)
    for stage, q in paced["stages"].items():
        assert 0 <= q["p50_ms"] <= q["p99_ms"], stage
    assert paced["stages"]["total"]["p50_ms"] > 0
    assert paced["stages"]["total"]["p99_ms"] <= paced["max_ms"]
    assert summary["command"].startswith(f"infer-worker bench --model {model} --payload {payload}")
    assert summary["settings"]["model"]["path"] == f"builtin:{model}"


def test_png_payload_one_process(tmp_path: Path) -> None:
    summary, path, stdout = _bench(tmp_path, "--payload", "png", "--records", "1500")
    assert path.name == f"{dt.date.today().isoformat()}-cpu{os.cpu_count()}-png.json"
    _check_common(summary, "png", 1, 1500)
    assert summary["worker_join_s"] == 0.0  # one process: timed from its first result
    assert "decode" in summary["paced"]["stages"]  # files are decoded; tensors are not
    for label in ("engine alone", "bare consumer drain", "worker drain", "p99", "queue"):
        assert label in stdout
    assert str(path) in stdout


def test_raw_payload_two_processes_timed_once_the_group_has_formed(tmp_path: Path) -> None:
    # Enough that one process cannot drain it all while the second joins: since
    # paused partitions keep their fetched records, 6,000 sometimes went first.
    summary, _, _ = _bench(tmp_path, "--payload", "raw", "--records", "20000", "--procs", "2")
    _check_common(summary, "raw", 2, 20000)
    assert summary["partitions"] == 4 and summary["worker_join_s"] >= 0
    assert "decode" not in summary["paced"]["stages"]


def test_the_text_model_takes_texts(tmp_path: Path) -> None:
    """The bundled text model: the engine alone runs a tokenized, padded batch, and
    the worker tokenizes every review it drains; rates are texts/s."""
    summary, path, stdout = _bench(tmp_path, "--records", "3000", model="sentiment")
    assert path.name == f"{dt.date.today().isoformat()}-cpu{os.cpu_count()}-text.json"
    _check_common(summary, "text", 1, 3000, model="sentiment")
    assert "texts/s" in stdout and "decode" not in summary["paced"]["stages"]


async def test_the_ceiling_with_several_readers_reads_every_record_once(
    broker: Any, names: dict[str, str]
) -> None:
    """``drain_ceiling(readers=N)``: N processes, each its share of the partitions,
    together read exactly the backlog (none twice: each counts its own), timed
    from their common start."""
    import msgpack

    from worker.bench.ceiling import drain_ceiling
    from worker.ops.broker import create_topics
    from worker.ops.topics import produce_all

    topic, parts, n = names["requests"], 4, 2_000
    await create_topics(broker.bootstrap, {topic: parts})
    records = [(None, msgpack.packb({"i": i})) for i in range(n)]
    await produce_all(broker.bootstrap, topic, records, partition_of=lambda i: i % parts)
    counts = {p: len(range(p, n, parts)) for p in range(parts)}
    drain = await drain_ceiling(broker.bootstrap, topic, n, readers=3, per_partition=counts)
    assert (drain.name, drain.records) == ("ceiling x3", n) and drain.seconds > 0
    one = await drain_ceiling(broker.bootstrap, topic, n)
    assert (one.name, one.records) == ("ceiling", n)
