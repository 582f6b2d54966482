"""What every peer shares: the same model, preprocessing and wire format as the
worker, so a peer differs from it only in how records flow. Benchmark code."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import onnxruntime as ort

from worker.app.plan import as_run
from worker.compute.engines import load_engine
from worker.config import Settings, load_settings
from worker.model.files import resolve_model_path
from worker.model.inputs import bind
from worker.model.inputs.image import BoundImage
from worker.model.postprocess import postprocess
from worker.model.preprocess import ImagePreprocess, preprocess


def image_preprocess(settings: Settings) -> ImagePreprocess:
    """The image input's preprocessing exactly as the worker binds it (its settings
    completed from the model file)."""
    engine = load_engine(settings.model)
    try:
        kind = bind(settings.model, engine.info.io, settings.limits).kinds[0]
    finally:
        engine.close()
    if not isinstance(kind, BoundImage):
        raise SystemExit(
            f"the peers serve an image model; {settings.model.path} takes a {kind.kind}"
        )
    return kind.cfg


class Model:
    def __init__(self, settings: Settings | None = None) -> None:
        # The batch size the worker would run with (derived from the model on
        # the CPU path), so a peer's batches hold as many records as the worker's.
        self.settings = s = settings or as_run(load_settings())
        self._session = ort.InferenceSession(
            str(resolve_model_path(s.model.path)), providers=["CPUExecutionProvider"]
        )
        self._in = self._session.get_inputs()[0].name
        self._out = s.model.output or self._session.get_outputs()[0].name
        self._pre = image_preprocess(s)

    def answer(
        self, values: Sequence[bytes], sources: Sequence[tuple[str, int, int]]
    ) -> list[tuple[str, bytes]]:
        """msgpack requests in, (id, msgpack result) out, one batched model run."""
        started = time.monotonic()
        requests = [msgpack.unpackb(v, raw=False) for v in values]
        images = []
        for req in requests:
            t = req["inputs"]["image"]
            images.append(np.frombuffer(t["data"], np.uint8).reshape(t["shape"]))
        m = self.settings.model
        batch = preprocess(images, self._pre)
        raw = self._session.run([self._out], {self._in: batch})[0]
        out = postprocess(raw, m.postprocess, self._out)
        total = round((time.monotonic() - started) * 1e6)
        results = []
        for i, (req, (topic, partition, offset)) in enumerate(zip(requests, sources, strict=True)):
            outputs: dict[str, Any] = {
                name: {"dtype": a.dtype.name, "shape": list(a.shape[1:]), "data": a[i].tobytes()}
                for name, a in out.items()
            }
            result = {
                "v": 1, "id": req["id"], "status": "ok", "outputs": outputs,
                "model": {"name": m.name, "version": "peer"},
                "source": {"topic": topic, "partition": partition, "offset": offset},
                "timing_us": {"total": total},
            }  # fmt: skip
            results.append((req["id"], msgpack.packb(result)))
        return results
