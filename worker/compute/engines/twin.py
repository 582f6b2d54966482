"""The GPU stage's twin engine: an ONNX model run by ONNX Runtime on a slot's buffers.

``model.backend = "gpu-twin"``: the model runs through the GPU stage on the
CPU twin of CuPy (``worker.compute.gpu.twin``), so the stage's slots, ring,
collation, copies, kernels (their NumPy references) and memory share serve it
as they serve a torch or TensorRT model, and its answers can be compared with
the same file on the CPU path. Like the GPU engines it reads each input and
writes each output densely from the start of its slot buffer at the run's
shape (``worker.model.shapes.dense``), padded up to a batch bucket.

For tests and for checking a GPU configuration (several models, pipelines,
budgets) on a machine without a device; never faster than ``onnxruntime``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from worker.compute.engines.base import EngineSlot, Feeds
from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
from worker.config import ModelConfig
from worker.flow.errors import InferenceFailed
from worker.model.io import EngineInfo, TensorDesc
from worker.model.shapes import SlotShapes, bucket_for, bucket_sizes, dense


class TwinEngine:
    def __init__(
        self,
        path: Path,
        cfg: ModelConfig,
        *,
        max_batch_size: int = 64,
        buckets: Sequence[int] | None = None,
    ) -> None:
        self._ort = OnnxRuntimeEngine(path, cfg)
        io = self._ort.info.io
        fixed = io.batch  # a model file that fixes its batch runs at exactly that
        self.device = 0
        self.min_batch_size = fixed or 1
        self.max_batch_size = fixed or max_batch_size
        self.shapes = SlotShapes(
            (fixed,) if fixed else tuple(buckets) if buckets else bucket_sizes(max_batch_size)
        )
        self.info = EngineInfo("gpu-twin", cfg.name, self._ort.info.version, io,
                               self.max_batch_size)  # fmt: skip
        self.inputs: tuple[TensorDesc, ...] = ()
        self.outputs: tuple[TensorDesc, ...] = ()
        if not any(t.free_axes for t in (*io.inputs, *io.outputs)):
            self.prepare(self.shapes)

    def prepare(self, shapes: SlotShapes) -> None:
        top = shapes.max_lengths
        io = self.info.io
        self.shapes = shapes
        self.inputs = tuple(TensorDesc(t.name, t.dtype, t.row_at(top)) for t in io.inputs)
        self.outputs = tuple(TensorDesc(t.name, t.dtype, t.row_at(top)) for t in io.outputs)

    def create_context(self, slot: EngineSlot) -> Any:
        """Nothing to bind: each run reads the slot's buffers where they are."""
        return None

    def enqueue(
        self, slot: EngineSlot, batch_size: int, lengths: Mapping[str, int]
    ) -> Mapping[str, tuple[int, ...]]:
        """Runs at once (the twin's streams do): the rows padded to a batch bucket,
        each output written densely into the slot's buffer."""
        rows = bucket_for(batch_size, self.shapes.batches)
        io = self.info.io
        feeds = {t.name: dense(slot.engine_inputs[t.name], rows, t.row_at(lengths))
                 for t in io.inputs}  # fmt: skip
        values = self._ort.run(feeds)
        shapes: dict[str, tuple[int, ...]] = {}
        for spec in self.outputs:
            value = values[spec.name]
            row = tuple(int(d) for d in value.shape[1:])
            limit = spec.fixed_shape
            if (
                value.shape[0] != rows
                or len(row) != len(limit)
                or any(r > m for r, m in zip(row, limit, strict=True))
            ):
                raise InferenceFailed(
                    f"gpu-twin: output {spec.name!r} has shape {value.shape} for {rows} rows; "
                    f"the slot holds [{rows}, {', '.join(map(str, limit))}] at most"
                )
            dense(slot.engine_outputs[spec.name], rows, row)[...] = value
            shapes[spec.name] = row
        return shapes

    def run(self, feeds: Feeds) -> dict[str, Any]:
        return self._ort.run(feeds)

    def close(self) -> None:
        self._ort.close()


__all__ = ["TwinEngine"]
