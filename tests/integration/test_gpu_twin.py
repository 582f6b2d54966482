"""Several GPU models and a pipeline's GPU step in one worker, on the GPU stage's
CPU twin (``backend = "gpu-twin"``), served from Kafka on both brokers (issues
64 and 65): the digits model with its images preprocessed by the kernels'
references and top-k on the device, the text model with its free dimension,
the digits model again beside them on the CPU stage, and a pipeline whose
detector runs on the CPU and whose classifier step runs on the GPU stage, each
model its own slot ring, what each took measured against the one share of the
device. Every answer equals the model run by hand on the CPU path.

A GPU runs the same stages on CuPy (issue 66 measures it); the twin checks the
wiring (routing, a ring per model, the share, pipelines' GPU steps), not CUDA."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import pipeline_functions as fn
from tests import read_pipeline
from tests.models import cpu_stage
from tests.onnx_models import conv_detector, run_alone
from tests.serving import wire
from worker.compute.engines import load_engine
from worker.compute.ops.crops import crop_boxes
from worker.config import ModelConfig
from worker.contract import Tensor
from worker.flow.messages import Batch
from worker.model.inputs.image import resolve
from worker.model.preprocess import preprocess
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.samples import labelled_samples, offline_correct, sentiment_samples
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")

CONFIG = """
[gpu]
num_slots = 2

[models.digits]
path = "{digits_path}"
backend = "{backend}"
topics = ["{digits}"]{digits_extra}
[models.digits.preprocess]
device = "gpu"{preprocess_extra}

[models.reader]
path = "builtin:sentiment"
backend = "{reader_backend}"
topics = ["{texts}"]

[models.plain]
path = "builtin:digits"
topics = ["{plain}"]

[models.detector]
path = "{detector}"

[pipelines.read]
topics = ["{read}"]
inputs = {{ pixels = "uint8 [H, W, 1]" }}
outputs = {{ digit = "digit.topk_indices", boxes = "peak.boxes" }}
{read_steps}"""


def _digits_by_hand(crops: np.ndarray) -> np.ndarray:
    cfg = ModelConfig()
    engine = load_engine(cfg)
    try:
        desc = engine.info.io.inputs[0]
        batch = preprocess(list(crops), resolve(cfg.preprocess, desc))
        logits = engine.run({desc.name: batch})[engine.info.output_names[0]]
    finally:
        engine.close()
    return np.asarray(logits).argmax(axis=1)


async def _texts_by_hand(texts: list[str]) -> list[np.ndarray]:
    from tests.gpu.support import request_jobs
    from worker.config import LimitsConfig
    from worker.model.inputs import bind

    cfg = ModelConfig(path="builtin:sentiment")
    stage = cpu_stage(cfg)
    try:
        jobs = request_jobs(bind(cfg, stage.info.io, LimitsConfig()), [{"text": t} for t in texts])
        done = await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
    finally:
        stage.close()
    return [np.asarray(a.outputs["logits"]) for a in done.answers]


# The digits model as TorchScript (scripts/digits_torchscript.py: the image's torch
# engine) takes its preprocessing from the configuration: a TorchScript file does
# not declare its input.
TORCH_PREPROCESS = """
size = [8, 8]
channels = 1
scale = 0.00392156862745098
mean = [0.5]
std = [0.5]
layout = "NCHW"
dtype = "float32"
"""


def _backend_config(backend: str, tmp_path: Path) -> dict[str, str]:
    """``gpu-twin``: everything on the GPU stage's CPU twin, here; ``torch``: the
    digits model (its own stage and the pipeline's step) on a real GPU with the
    torch engine, the text model on the CPU (the GPU session runs it)."""
    if backend == "gpu-twin":
        return {"digits_path": "builtin:digits", "backend": "gpu-twin", "digits_extra": "",
                "preprocess_extra": "", "reader_backend": "gpu-twin"}  # fmt: skip
    from tests.gpu.conftest import cuda_unavailable, torch_unavailable

    problem = cuda_unavailable() or torch_unavailable()
    if problem:
        pytest.skip(problem)
    script = Path(__file__).resolve().parents[2] / "scripts" / "digits_torchscript.py"
    path = tmp_path / "digits.pt"
    subprocess.run([sys.executable, str(script), str(path)], check=True, timeout=300)
    return {"digits_path": str(path), "backend": "torch", "digits_extra": '\noutput = "logits"',
            "preprocess_extra": TORCH_PREPROCESS, "reader_backend": "onnxruntime"}  # fmt: skip


@pytest.mark.parametrize("backend", ["gpu-twin", "torch"])
async def test_gpu_models_and_a_pipelines_gpu_step_beside_cpu_ones(
    broker: Broker, names: dict[str, str], tmp_path: Path, backend: str
) -> None:
    backends = await asyncio.to_thread(_backend_config, backend, tmp_path)
    det_path = conv_detector(tmp_path / "det.onnx")
    topics = {k: f"{names['requests']}.{k}" for k in ("digits", "texts", "plain", "read")}
    config = tmp_path / "worker.toml"
    config.write_text(CONFIG.format(detector=det_path, **topics, **backends,
                                    read_steps=read_pipeline.STEPS))
    await create_topics(broker.bootstrap, {**{t: 2 for t in topics.values()},
                                           names["results"]: 1, names["dlq"]: 1})  # fmt: skip
    samples = labelled_samples(1)[:40]
    texts = sentiment_samples()[:30]
    rng = np.random.default_rng(64)
    read = {f"r-{i}": rng.integers(0, 256, (int(rng.integers(16, 40)), int(rng.integers(16, 40)),
                                            1)).astype(np.uint8) for i in range(24)}  # fmt: skip
    w = spawn_worker(broker.bootstrap, input_topics=list(topics.values()),
                     output_topic=names["results"], dlq_topic=names["dlq"],
                     group_id=names["group"], command=("run", "--config", str(config)))  # fmt: skip
    total = 2 * len(samples) + len(texts) + len(read)
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 8, 90.0, "assignment"
        )
        for key, prefix in (("digits", "g"), ("plain", "p")):
            await produce_all(broker.bootstrap, topics[key], [
                (f"{prefix}-{s.id}".encode(),
                 wire(f"{prefix}-{s.id}", {"image": Tensor.from_numpy(s.image)}))
                for s in samples])  # fmt: skip
        await produce_all(broker.bootstrap, topics["texts"], [
            (f"t-{s.id}".encode(), wire(f"t-{s.id}", {"text": s.text})) for s in texts])
        await produce_all(broker.bootstrap, topics["read"], [
            (rid.encode(), wire(rid, {"pixels": Tensor.from_numpy(p)})) for rid, p in read.items()])
        await c.start()
        assert await c.collect(lambda c: c.count() >= total, 90.0), w.log_tail()
    finally:
        await c.stop()
        assert w.terminate() == 0, w.log_tail()
    assert not c.records.get(names["dlq"])
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    assert len(results) == total
    alone = offline_correct(samples, ModelConfig())
    for prefix, model in (("g", "digits"), ("p", "plain")):
        got = [results[f"{prefix}-{s.id}"] for s in samples]
        assert all((r.status, r.model.name) == ("ok", model) for r in got), got[0].error
        right = sum(int(r.outputs["topk_indices"].to_numpy()[0] == s.label)
                    for r, s in zip(got, samples, strict=True))  # fmt: skip
        assert right == alone  # the twin's kernels answer as the CPU path does
    for s, want in zip(texts, await _texts_by_hand([s.text for s in texts]), strict=True):
        r = results[f"t-{s.id}"]
        assert (r.status, r.model.name) == ("ok", "reader"), r.error
        np.testing.assert_allclose(r.outputs["logits"].to_numpy(), want, rtol=1e-5, atol=1e-6)
    for rid, pixels in read.items():
        r = results[rid]
        assert (r.status, r.model.name) == ("ok", "read"), r.error
        heat = run_alone(det_path, {"x": fn.as_floats(pixels)["x"]})["heat"]
        boxes = fn.peak_boxes(heat)["boxes"]
        crops = crop_boxes(pixels, boxes, size=(8, 8))["crops"]
        np.testing.assert_array_equal(r.outputs["boxes"].to_numpy(), boxes)
        np.testing.assert_array_equal(r.outputs["digit"].to_numpy()[:, 0], _digits_by_hand(crops))
    measured = [line for line in w.log_tail(400).splitlines() if "gpu_model_memory" in line]
    rings = ("digits", "read.digits") + (("reader",) if backend == "gpu-twin" else ())
    for ring in rings:  # a ring each, measured in one share
        assert any(f'"model": "{ring}"' in line for line in measured), measured
