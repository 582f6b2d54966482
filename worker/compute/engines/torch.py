"""Torch engine: a TorchScript (``torch.jit.save``) or exported (``.pt2``) model on CUDA.

It runs inside the slot pipeline without copies or extra synchronisation:

- the slot's CuPy device buffers (one per model input and output, each sized for
  the largest batch at the longest lengths) are shared with torch zero-copy
  through DLPack (``torch.from_dlpack``), once per slot; a run reads each input
  and writes each output densely from the start of its buffer at the run's
  shape (``worker.compute.engines.base.dense``), so the preprocess kernel and the host
  copies write the model's inputs in place and the postprocess kernel and the
  copies back read its outputs in place;
- the model runs on the slot's own CUDA stream, wrapped as
  ``torch.cuda.ExternalStream``, so it is ordered after the inputs' copies and
  before the outputs' by the stream alone. Torch's caching allocator keeps
  per-stream pools, so memory freed by one slot's batch is reused only on that
  slot's stream, in order.

What makes it keep up (``[model.torch]``; measured on an H100 with ResNet-50,
batch 64: eager TorchScript 8.2k img/s, channels_last + CUDA graph 12.9k,
torch.compile 22.0k): the module computes in ``precision`` with
``channels_last`` weights, an exported program is compiled with
``torch.compile`` (``worker.compute.engines.torch_module``), and every shape a slot will
run (``SlotShapes``: the batch buckets, times the length buckets of each padded
dimension of a text or sequence model) is run when the slot is created, then
captured as one CUDA graph each. This happens while the GPU stage is built,
before the worker joins its consumer group, so no request waits on a
compilation or a new shape; a batch then costs one graph launch. The graphs
bind the slot's buffers, which never move; the graphs of one slot share a
memory pool, which is safe because they replay one at a time on that slot's
stream and keep no tensor alive between replays.

For tests, the engine also runs on CPU torch (``device="cpu"``) through a slot
of host arrays (no stream, no graphs): loading, description, precision, compile,
warm-up, padding and the copies out are the same code. ``torch`` is imported
when the engine is constructed, so this module imports anywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from worker.compute.engines.base import EngineSlot, Feeds
from worker.compute.engines.cuda import buffer_address, translate_gpu_error
from worker.compute.engines.torch_module import (
    compute_dtype,
    flatten_outputs,
    import_torch,
    load_module,
    load_program,
    prepare_module,
    probe_outputs,
    strip_dtype_asserts,
    to_host,
)
from worker.compute.engines.torch_warm import SlotWarming
from worker.config import ModelConfig
from worker.flow.errors import ConfigError, EngineDead, InferenceFailed
from worker.model.files import content_version
from worker.model.inputs.image import resolve_declared
from worker.model.io import EngineInfo, ModelIO, TensorDesc
from worker.model.shapes import ShapeKey, SlotShapes, bucket_for, bucket_sizes, dense, shape_key

log = structlog.get_logger(__name__)

# The model's loading and preparation live in torch_module; importable from here.
__all__ = ["TorchEngine", "compute_dtype", "import_torch", "load_module", "prepare_module"]


@dataclass
class _Context:
    stream: Any  # torch.cuda.ExternalStream over the slot's stream (None on CPU)
    inputs: dict[str, Any]  # torch views of slot.engine_inputs
    outputs: dict[str, Any]  # torch views of slot.engine_outputs
    rows: int  # the slot's buffers' batch rows
    graphs: dict[ShapeKey, Any] = field(default_factory=dict)  # shape -> torch.cuda.CUDAGraph
    shapes: dict[ShapeKey, dict[str, tuple[int, ...]]] = field(default_factory=dict)  # out rows


class TorchEngine:
    def __init__(
        self,
        path: Path,
        cfg: ModelConfig,
        *,
        device: int | str = 0,
        max_batch_size: int = 64,
        buckets: Sequence[int] | None = None,
        output_names: Sequence[str] | None = None,
    ) -> None:
        """``device``: a CUDA ordinal, or ``"cpu"`` (tests: a slot of host arrays);
        ``buckets``: the batch buckets until ``prepare`` names the shapes."""
        on_cpu = device == "cpu"
        torch = import_torch(need_cuda=not on_cpu)
        self._torch = torch
        self.device = 0 if on_cpu else int(device)
        self._device = torch.device("cpu") if on_cpu else torch.device("cuda", self.device)
        self.min_batch_size = 1
        self.max_batch_size = max_batch_size
        batches = tuple(buckets) if buckets else bucket_sizes(max_batch_size)
        if batches[-1] > max_batch_size:
            raise ConfigError(f"torch: bucket {batches[-1]} exceeds the maximum batch")
        self.shapes = SlotShapes(batches)
        self._dtype = compute_dtype(torch, cfg.torch, cfg.preprocess.dtype or "float32")
        self._channels_last = cfg.torch.channels_last  # read by _call, probes included
        self._cuda_graphs = cfg.torch.cuda_graphs and not on_cpu
        loaded = load_program(torch, path, self._device)
        self._bounds = loaded.bounds or {}
        if self._cuda_graphs:
            # cuDNN times its convolution algorithms once per shape, and the warm-up
            # pays for it; the captured graphs keep the choice. Without graphs this
            # stays off: cuDNN's benchmark cache is per thread, so every stage
            # thread would time again during live batches.
            torch.backends.cudnn.benchmark = True
        self._eager, self._module = prepare_module(
            torch, loaded.module, cfg.torch, self._dtype, max_shapes=4 * len(batches)
        )
        self._autocast = False
        if loaded.io is not None:
            io = loaded.io
            self._fit_precision(io)
        else:  # TorchScript: one input, what [model.preprocess] produces; outputs probed
            pp = resolve_declared(
                cfg.preprocess, "a TorchScript file does not declare its input's shape"
            )
            inp = TensorDesc("input", np.dtype(pp.dtype), pp.batch_shape(1)[1:])
            rows = min(2, self.max_batch_size)
            with self._on_device():
                outputs = probe_outputs(
                    torch, lambda x: self._call(self._eager, [x]), inp, rows, self._device,
                    output_names or ((cfg.output,) if cfg.output else None),
                )  # fmt: skip
            io = ModelIO((inp,), outputs)
        self._io = io
        self.inputs: tuple[TensorDesc, ...] = ()
        self.outputs: tuple[TensorDesc, ...] = ()
        if not any(t.free_axes for t in (*io.inputs, *io.outputs)):
            self.prepare(self.shapes)  # fixed shapes: sized now (what tools read)
        self.info = EngineInfo(
            backend="torch",
            name=cfg.name,
            version=content_version(path),
            io=io,
            max_batch_size=max_batch_size,
        )
        log.info(
            "torch_engine_loaded",
            path=str(path),
            device=str(self._device),
            precision=str(self._dtype).removeprefix("torch."),
            autocast=self._autocast,
            compile=cfg.torch.compile if self._module is not self._eager else "off",
            channels_last=self._channels_last,
            cuda_graphs=self._cuda_graphs,
            inputs={t.name: t.shown() for t in io.inputs},
            outputs={t.name: t.shown() for t in io.outputs},
        )
        self._closed = False

    # --- start-up --------------------------------------------------------------------

    def prepare(self, shapes: SlotShapes) -> None:
        """The shapes the slots run: buffers are sized for the largest, and every one
        is warmed when a slot is created."""
        for symbol, buckets in shapes.lengths:
            lo, hi = self._bounds.get(symbol, (1, 1 << 62))
            if buckets[0] < lo or buckets[-1] > hi:
                raise ConfigError(
                    f"batching.length_buckets: the program takes {symbol!r} in {lo}..{hi}; "
                    f"the buckets span {buckets[0]}..{buckets[-1]}"
                )
        top = shapes.max_lengths
        self.shapes = shapes
        self.inputs = tuple(TensorDesc(t.name, t.dtype, t.row_at(top)) for t in self._io.inputs)
        self.outputs = tuple(TensorDesc(t.name, t.dtype, t.row_at(top)) for t in self._io.outputs)

    def _fit_precision(self, io: ModelIO) -> None:
        """Check the converted program runs at all. One that casts itself in forward
        (export fixed its ``.float()`` and asserts the dtype before it) fails with
        converted weights: it runs with float32 weights under autocast instead, its
        dtype assertions removed (autocast changes the dtypes they check)."""
        torch = self._torch
        if self._dtype == torch.float32:
            return
        try:
            self._probe(io)
            return
        except Exception as exc:  # boundary: a dtype the program's casts refuse
            reason = str(exc)[:200]
        # In place (Module.to converts the module itself), so the compiled wrapper,
        # which has compiled nothing yet, wraps the converted module as it is.
        self._eager.to(dtype=torch.float32)
        stripped = strip_dtype_asserts(torch, self._eager)
        self._autocast = True
        try:
            self._probe(io)
        except Exception as exc:  # boundary: not even autocast runs it
            raise ConfigError(
                f"model.torch.precision: the program does not run in {self._dtype} "
                f"(converted: {reason}; under autocast: {exc}); export it in that precision "
                'or set precision = "float32"'
            ) from exc
        log.warning("torch_precision_autocast", dtype=str(self._dtype), reason=reason,
                    dtype_asserts_removed=stripped)  # fmt: skip

    def _probe(self, io: ModelIO) -> None:
        """The eager module on a small zero batch (ids of 0 are valid ids)."""
        lengths = {
            s: max(2, self._bounds.get(s, (2, 2))[0]) for t in io.inputs for s in t.symbols()
        }
        probe = [self._zeros(t, 2, lengths) for t in io.inputs]
        with self._torch.inference_mode(), self._on_device():
            self._call(self._eager, probe)

    def _zeros(self, desc: TensorDesc, rows: int, lengths: Mapping[str, int]) -> Any:
        dtype = self._torch.from_numpy(np.zeros(0, desc.dtype)).dtype
        return self._torch.zeros((rows, *desc.row_at(lengths)), dtype=dtype,
                                 device=self._device)  # fmt: skip

    # --- running the module ----------------------------------------------------------

    def _call(
        self, module: Any, inputs: list[Any], mark: bool = False
    ) -> list[tuple[str | None, Any]]:
        """``module`` on ``inputs`` (in the model's order), floating inputs in the
        compute dtype (one copy at most) and 4-D ones in NHWC with
        ``channels_last``; under autocast when precision needs it. ``mark``: mark
        the dynamic dimensions of the tensors the module gets, after any cast (a
        mark on the tensor before a copy is lost: the first compilation would
        specialise on the batch, and the next bucket compile again)."""
        torch = self._torch
        target = torch.float32 if self._autocast else self._dtype
        cast = []
        for x in inputs:
            if x.is_floating_point() and x.dim() == 4 and self._channels_last:
                cast.append(x.to(dtype=target, memory_format=torch.channels_last))
            elif x.is_floating_point() and x.dtype != target:
                cast.append(x.to(target))
            else:
                cast.append(x)
        if mark:
            for x, desc in zip(cast, self._io.inputs, strict=True):
                self._mark_dynamic(x, desc)
        if self._autocast:
            with torch.autocast(self._device.type, dtype=self._dtype):
                return flatten_outputs(torch, module(*cast))
        return flatten_outputs(torch, module(*cast))

    def _on_device(self) -> Any:
        if self._device.type == "cuda":
            return self._torch.cuda.device(self._device)
        return contextlib.nullcontext()

    # --- GpuEngine -----------------------------------------------------------------

    def create_context(self, slot: EngineSlot) -> _Context:
        """Views of the slot's buffers, then every shape warmed and captured
        (start-up: this is where compilation time goes)."""
        torch = self._torch
        with self._on_device():
            stream = (
                torch.cuda.ExternalStream(int(slot.stream.ptr), device=self._device)
                if slot.stream is not None
                else None
            )
            inputs = {s.name: torch.from_dlpack(slot.engine_inputs[s.name]) for s in self.inputs}
            outputs = {s.name: torch.from_dlpack(slot.engine_outputs[s.name]) for s in self.outputs}
        for name, view in inputs.items():
            if view.data_ptr() != buffer_address(slot.engine_inputs[name]):
                raise ConfigError(f"torch: DLPack import of the slot's input {name!r} made a copy")
        rows = int(next(iter(inputs.values())).shape[0])
        context = _Context(stream, inputs, outputs, rows)
        combos = [(b, lengths) for b, lengths in self.shapes.combos() if b <= rows]
        SlotWarming(self._torch, self._device, slot.index, context, combos, self._run_into).run(
            self._cuda_graphs
        )
        return context

    def _run_into(
        self, c: _Context, rows: int, lengths: Mapping[str, int], mark: bool = False
    ) -> None:
        """The module on the first ``rows`` rows of the slot's inputs at ``lengths``,
        its outputs copied into the slot's output buffers (on the current stream);
        records each output's row shape for the run. ``mark``: mark the batch and
        padded dimensions dynamic (the warm-up's first call compiles for them)."""
        inputs = [
            dense(c.inputs[desc.name], rows, desc.row_at(lengths)) for desc in self._io.inputs
        ]
        values = self._call(self._module, inputs, mark=mark and self._module is not self._eager)
        if len(values) != len(self.outputs):
            raise InferenceFailed(
                f"torch: model returned {len(values)} outputs, expected {len(self.outputs)}"
            )
        shapes: dict[str, tuple[int, ...]] = {}
        for spec, (_, t) in zip(self.outputs, values, strict=True):
            row = tuple(int(d) for d in t.shape[1:])
            if (
                t.dim() < 1
                or int(t.shape[0]) != rows
                or len(row) != len(spec.shape)
                or any(r > m for r, m in zip(row, spec.fixed_shape, strict=True))
            ):
                raise InferenceFailed(
                    f"torch: output {spec.name!r} has shape {tuple(t.shape)} for {rows} rows; "
                    f"the slot holds [{rows}, {', '.join(map(str, spec.shape))}] at most"
                )
            dense(c.outputs[spec.name], rows, row).copy_(t)  # on the current stream
            shapes[spec.name] = row
        c.shapes[shape_key(rows, lengths)] = shapes

    def _mark_dynamic(self, x: Any, desc: TensorDesc) -> None:
        # maybe_: a model whose code specialises a marked dimension compiles for
        # that size (dynamo then recompiles dynamic at the next bucket) instead of
        # failing. torch 2.9 on the CPU does so for ResNet-18 in channels_last at
        # batch 16 (not at 8, 4, 2): benchmarks/torch_start.py.
        mark = self._torch._dynamo.maybe_mark_dynamic
        if len(self.shapes.batches) > 1:
            mark(x, 0)
        # Every free dimension: a padded one runs at several buckets, and one that
        # is not padded runs at each request's own length (rows of equal lengths
        # share a run), which may be none of the warmed ones.
        for axis in desc.free_axes:
            mark(x, axis + 1)

    def enqueue(
        self, slot: EngineSlot, batch_size: int, lengths: Mapping[str, int]
    ) -> Mapping[str, tuple[int, ...]]:
        """Runs the shape that holds ``batch_size`` rows at ``lengths``: its graph,
        or the module. Returns each output's row shape in this run."""
        if self._closed:
            raise EngineDead("torch engine is closed")
        torch = self._torch
        c: _Context = slot.context
        try:
            bucket = bucket_for(batch_size, [b for b in self.shapes.batches if b <= c.rows])
            key = shape_key(bucket, lengths)
            graph = c.graphs.get(key)
            on_stream = (
                torch.cuda.stream(c.stream) if c.stream is not None else contextlib.nullcontext()
            )
            with on_stream:
                if graph is not None:
                    graph.replay()
                else:
                    with torch.inference_mode():
                        self._run_into(c, bucket, lengths)
            return c.shapes[key]
        except (InferenceFailed, EngineDead):
            raise
        except ValueError as exc:  # more rows than the slot holds: a caller's bug
            raise InferenceFailed(f"torch: {exc}") from exc
        except Exception as exc:  # boundary: torch raises RuntimeError for CUDA failures
            raise translate_gpu_error(exc, "torch") from exc

    # --- CPU protocol (parity tests) -------------------------------------------------

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        """Synchronous run of host feeds on torch's current stream; allocates.
        Padded to a batch bucket like ``enqueue``, so it runs the same compiled
        shapes."""
        if self._closed:
            raise EngineDead("torch engine is closed")
        torch = self._torch
        n = len(next(iter(feeds.values())))
        batches = self.shapes.batches
        rows = bucket_for(n, batches) if 1 <= n <= batches[-1] else n
        try:
            with torch.inference_mode(), self._on_device():
                inputs = []
                for desc in self._io.inputs:
                    host = np.ascontiguousarray(feeds[desc.name])
                    x = torch.zeros((rows, *host.shape[1:]), dtype=torch.from_numpy(host).dtype)
                    x[:n] = torch.from_numpy(host)
                    inputs.append(x.to(self._device))
                values = self._call(self._module, inputs)
                return {
                    spec.name: to_host(torch, t[:n], spec.dtype)
                    for spec, (_, t) in zip(self._io.outputs, values, strict=True)
                }
        except (InferenceFailed, EngineDead):
            raise
        except Exception as exc:  # boundary
            raise translate_gpu_error(exc, "torch") from exc

    def close(self) -> None:
        self._closed = True
        self._module = None
        self._eager = None
