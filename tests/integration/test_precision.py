"""An INT8 build calibrated on a topic of requests, served: ``build-engine
--backend onnxruntime --precision int8 --calibration-topic`` reads the bundled
digits requests from the embedded broker (no consumer group), and a worker
serving the quantized model answers the bundled samples as the float32 model's
worker does on at least 95% of them, naming the version the build recorded.
An empty calibration topic exits 2 naming the flag."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tests.serving import serve, wire
from worker.contract import Tensor
from worker.ops.broker import Broker, create_topics
from worker.ops.samples import encode_samples, labelled_samples
from worker.ops.topics import produce_all

pytestmark = pytest.mark.integration


async def build_engine(*args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "build-engine", "--backend", "onnxruntime", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, stdout.decode() + stderr.decode()


@pytest.mark.parametrize("broker_kind", ["embedded"])
async def test_int8_calibrated_on_a_topic_serves_as_float32_does(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    samples = labelled_samples(1)  # the 360 held-out digits, 8x8
    calibration, empty = f"{names['requests']}.calibration", f"{names['requests']}.empty"
    await create_topics(broker.bootstrap, {calibration: 2, empty: 1})
    await produce_all(broker.bootstrap, calibration, encode_samples(samples))

    rc, text = await build_engine(
        "builtin:digits", "--precision", "int8", "--out-dir", str(tmp_path / "none"),
        "--calibration-topic", empty, "--bootstrap-servers", broker.bootstrap,
    )  # fmt: skip
    assert rc == 2, text
    assert f"--calibration-topic {empty}: the topic is empty" in text

    out = tmp_path / "digits-int8.onnx"
    rc, text = await build_engine(
        "builtin:digits", "--precision", "int8", "--out", str(out),
        "--calibration-topic", calibration, "--calibration-count", "200",
        "--bootstrap-servers", broker.bootstrap,
    )  # fmt: skip
    assert rc == 0, text
    record = json.loads(out.with_name(out.name + ".build.json").read_text())
    assert record["calibration"]["topic"] == calibration
    assert record["calibration"]["samples"] == 200 and record["calibration"]["refused"] == 0

    requests = [(s.id, wire(s.id, {"image": Tensor.from_numpy(s.image)})) for s in samples]
    base = {k: f"{v}.fp32" for k, v in names.items()}
    quantized = {k: f"{v}.int8" for k, v in names.items()}
    fp32 = await serve(broker, base, requests, {})
    # The bundled model at another path: the image input is named, as its
    # classifier shorthand needs for any file but builtin:digits.
    int8 = await serve(
        broker, quantized, requests,
        {"INFER_WORKER_MODEL__PATH": str(out), "INFER_WORKER_MODEL__INPUT": "image"},
    )  # fmt: skip
    assert {r.status for r in (*fp32.values(), *int8.values())} == {"ok"}
    assert {r.model.version for r in int8.values()} == {record["model_version"]}
    assert {r.model.version for r in fp32.values()} == {record["source"]["version"]}
    agree = sum(
        int(fp32[s.id].outputs["topk_indices"].to_numpy()[0])
        == int(int8[s.id].outputs["topk_indices"].to_numpy()[0])
        for s in samples
    )
    assert agree / len(samples) >= 0.95, f"{agree} of {len(samples)} agree"
