"""TensorRT engine: a serialized plan, one execution context per slot.

Written to the TensorRT 10 Python API with named I/O tensors: the engine's
tensors, the batch range and each input's range come from the plan and its
optimization profiles (``tensorrt_plan``). Each slot gets its own
``IExecutionContext`` with the slot's buffer addresses bound once
(``set_tensor_address``; every input and output, dense from the start of its
buffer): buffers never move, so a batch only sets the inputs' shapes (when they
changed: the batch bucket, and the lengths of a text or sequence model's padded
dimensions) and calls ``execute_async_v3`` on the slot's stream; each output's
shape for the run is the context's (``get_tensor_shape``).
TensorRT requires contexts that run concurrently on a dynamic-shape engine to use
different optimization profiles, so slot i selects profile i: build plans with
as many (identical) profiles as slots (``build-engine --profiles N``).

Batches are padded up to a bucket (``worker.model.shapes``: the preferred
batch sizes, else powers of two, within the profile's range) and padded
dimensions to a length bucket (``SlotShapes``), so a context only ever sees a
few input shapes, and when a slot is created each of them is set and run once,
before the worker joins its consumer group, so first-run costs at a shape
never land on a request. TensorRT still redoes shape-dependent
work on the first run after every input shape change (its best-practices guide,
"Overhead of Shape Change and Optimization Profile Switching"); buckets keep
such changes few.

Optional CUDA graphs (``cuda_graphs=True``), kept to what TensorRT documents: a
graph is captured right after a normal run at the current shape, and is valid
only while the context stays at that shape; an input shape change discards it.
So each slot keeps one graph, for its largest bucket (the full batches of a
saturated worker, where TensorRT's per-call host overhead costs throughput):
captured at start-up, replayed while batches stay full, and captured again on
the batch after one normal run when full batches return after smaller ones
(that batch waits on the capture's host time). Smaller buckets run normally.
Replaying graphs of several shapes on one context (what NVIDIA's Triton
backend does) is not documented, and one context per bucket would need
slots x buckets optimization profiles. A capture that fails at start-up stops
it (exit 2, naming ``gpu.cuda_graphs``); one that fails later leaves the slot
without a graph. Capture uses thread-local mode, so other slots' threads may
keep calling CUDA meanwhile. Not verified here: TensorRT cannot be installed
on the machines this project is tested on (its tests skip without it).

``tensorrt`` is imported when the engine is constructed, so this module imports
anywhere; without it the constructor raises ``EngineUnavailable``. TensorRT and
CUDA failures are translated here, once, into ``InferenceFailed`` /
``EngineDead``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from worker.compute.engines.base import EngineSlot, Feeds
from worker.compute.engines.cuda import import_cupy, translate_gpu_error
from worker.compute.engines.tensorrt_plan import (
    describe_plan,
    import_tensorrt,
    make_logger,
    numpy_dtype,
)
from worker.config import ModelConfig
from worker.flow.errors import ConfigError, EngineDead, InferenceFailed
from worker.model.files import content_version
from worker.model.io import EngineInfo, TensorDesc
from worker.model.shapes import ShapeKey, SlotShapes, bucket_for, bucket_sizes, shape_key

log = structlog.get_logger(__name__)

_THREAD_LOCAL_CAPTURE = 1  # cudaStreamCaptureModeThreadLocal

__all__ = ["TensorRTEngine", "import_tensorrt", "make_logger", "numpy_dtype"]


@dataclass
class _Context:
    """One slot's execution context and what it last did."""

    context: Any  # trt.IExecutionContext
    combos: list[tuple[int, dict[str, int]]]  # the shapes this slot runs, largest first
    key: ShapeKey | None = None  # the current input shapes
    # The largest shape's graph, valid only while the shapes have not changed since
    # it was captured (None: none yet, or discarded by a change).
    graph: Any = None
    graph_failed: bool = False  # a capture failed on this slot: never try again
    shapes: dict[ShapeKey, dict[str, tuple[int, ...]]] = field(default_factory=dict)


class TensorRTEngine:
    def __init__(
        self,
        path: Path,
        cfg: ModelConfig,
        *,
        device: int = 0,
        cuda_graphs: bool = False,
        buckets: Sequence[int] | None = None,
    ) -> None:
        trt = import_tensorrt()
        cp = import_cupy()
        self._trt = trt
        self._cp = cp
        self.device = device
        self._cuda_graphs = cuda_graphs
        self._logger = make_logger(trt)
        self._lock = threading.Lock()  # run() only; slots each own their context
        with cp.cuda.Device(device):
            self._runtime = trt.Runtime(self._logger)
            engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise ConfigError(
                f"model.path: {path} is not a TensorRT plan this TensorRT "
                f"({trt.__version__}) and GPU can run: {self._logger.last_errors()} "
                "(plans are specific to the TensorRT version and GPU; rebuild with build-engine)"
            )
        self._engine = engine
        plan = describe_plan(trt, engine, path)
        self._io = plan.io
        if cfg.output is not None and cfg.output not in plan.io.output_names:
            raise ConfigError(
                f"model.output: {cfg.output!r} not in engine outputs {list(plan.io.output_names)}"
            )
        # With a dynamic batch, contexts running at once need one optimization profile
        # each (TensorRT's rule), so a plan for N slots is built with N identical
        # profiles (build-engine --profiles) and slot i uses profile i.
        self.num_profiles = max(1, int(engine.num_optimization_profiles))
        self.dynamic = plan.dynamic
        self.min_batch_size, self.max_batch_size = plan.min_batch, plan.max_batch
        self._ranges = plan.row_ranges
        fit = tuple(b for b in (buckets or ()) if self.min_batch_size <= b <= self.max_batch_size)
        self.shapes = SlotShapes(fit or bucket_sizes(self.max_batch_size))
        self.inputs: tuple[TensorDesc, ...] = ()
        self.outputs: tuple[TensorDesc, ...] = ()
        if not any(t.free_axes for t in plan.io.inputs):
            self.prepare(self.shapes)
        self.info = EngineInfo(
            backend="tensorrt",
            name=cfg.name,
            version=content_version(path),
            io=plan.io,
            max_batch_size=self.max_batch_size,
        )
        self._closed = False

    # --- start-up --------------------------------------------------------------------

    def prepare(self, shapes: SlotShapes) -> None:
        """Check every shape against the profiles, then size the tensors for the
        largest: inputs from their descriptions, outputs as a context infers them
        at the largest input shapes."""
        for batch, lengths in shapes.combos():
            if not self.min_batch_size <= batch <= self.max_batch_size:
                raise ConfigError(
                    f"batching.max_batch_size: batch {batch} is outside the plan's "
                    f"{self.min_batch_size}..{self.max_batch_size}"
                )
            for desc in self._io.inputs:
                low, high = self._ranges[desc.name]
                row = desc.row_at(lengths)
                if any(not lo <= r <= hi for r, lo, hi in zip(row, low, high, strict=True)):
                    raise ConfigError(
                        f"batching.length_buckets: input {desc.name!r} at {list(row)} is outside "
                        f"the plan's profile {list(low)}..{list(high)} (rebuild it with a wider "
                        "range, or lower model.inputs.*.max_length)"
                    )
        self.shapes = shapes
        top = shapes.max_lengths
        self.inputs = tuple(TensorDesc(t.name, t.dtype, t.row_at(top)) for t in self._io.inputs)
        largest = shapes.batches[-1]
        with self._cp.cuda.Device(self.device):
            ctx = self._engine.create_execution_context()  # dropped below
            if self.dynamic:
                ctx.set_optimization_profile_async(0, self._cp.cuda.get_current_stream().ptr)
            for spec in self.inputs:
                ctx.set_input_shape(spec.name, (largest, *spec.shape))
            outs = []
            for desc in self._io.outputs:
                shape = tuple(int(d) for d in ctx.get_tensor_shape(desc.name))
                if not shape or any(d < 0 for d in shape[1:]):
                    raise ConfigError(
                        f"engine output {desc.name!r}: cannot size its buffer ({shape})"
                    )
                outs.append(TensorDesc(desc.name, desc.dtype, shape[1:]))
            del ctx
        self.outputs = tuple(outs)

    def create_context(self, slot: EngineSlot) -> _Context:
        if self._closed:
            raise EngineDead("tensorrt engine is closed")
        if self.dynamic and slot.index >= self.num_profiles:
            raise ConfigError(
                f"gpu.num_slots: slot {slot.index} needs its own optimization profile but the "
                f"plan has {self.num_profiles}; use at most {self.num_profiles} slots or rebuild "
                f"with build-engine --profiles {slot.index + 1}"
            )
        with self._cp.cuda.Device(slot.device):
            ctx = self._engine.create_execution_context()
            if ctx is None:
                raise EngineDead(
                    f"tensorrt: cannot create an execution context: {self._logger.last_errors()}"
                )
            try:
                ok = True
                if self.dynamic:
                    # Enqueued on the slot's stream, so it is ordered before the slot's
                    # first run. The Python binding raises RuntimeError on failure
                    # (the C++ API returns false).
                    ok = ctx.set_optimization_profile_async(slot.index, slot.stream.ptr)
                buffers = {**slot.engine_inputs, **slot.engine_outputs}
                for spec in (*self.inputs, *self.outputs):
                    ok = ok and ctx.set_tensor_address(spec.name, int(buffers[spec.name].data.ptr))
            except RuntimeError as exc:
                raise ConfigError(
                    f"tensorrt: binding slot {slot.index} failed: {exc}: "
                    f"{self._logger.last_errors()}"
                ) from exc
        if not ok:
            raise ConfigError(
                f"tensorrt: binding slot {slot.index} failed: {self._logger.last_errors()}"
            )
        rows = int(next(iter(slot.engine_inputs.values())).shape[0])
        c = _Context(ctx, [(b, n) for b, n in self.shapes.combos() if b <= rows])
        self._warm(slot, c)
        return c

    def _warm(self, slot: EngineSlot, c: _Context) -> None:
        """Every shape set and run once on the slot's stream, smallest first, so the
        context is left at the largest, whose graph is captured then (with
        ``cuda_graphs``). Start-up, before the worker joins."""
        started = time.monotonic()
        try:
            with self._cp.cuda.Device(slot.device):
                for batch, lengths in reversed(c.combos):
                    self._set_shapes(c, batch, lengths)
                    self._execute(c, slot.stream)
                if self._cuda_graphs:
                    c.graph = self._capture(c, slot.stream)
                    if c.graph is None:
                        raise ConfigError(
                            f"gpu.cuda_graphs: this TensorRT plan cannot be captured as a CUDA "
                            f"graph (slot {slot.index}, see the log); set gpu.cuda_graphs = false"
                        )
                slot.stream.synchronize()
        except ConfigError:
            raise
        except Exception as exc:  # boundary: TensorRT / CuPy exceptions
            error = translate_gpu_error(exc, "tensorrt")
            if isinstance(error, EngineDead):
                raise error from exc
            raise ConfigError(
                f"model.path: the TensorRT plan fails while warming up: {error}"
            ) from exc
        log.info("tensorrt_slot_warmed", slot=slot.index,
                 seconds=round(time.monotonic() - started, 3), shapes=len(c.combos),
                 graph=c.graph is not None)  # fmt: skip

    # --- per batch -------------------------------------------------------------------

    def enqueue(
        self, slot: EngineSlot, batch_size: int, lengths: Mapping[str, int]
    ) -> Mapping[str, tuple[int, ...]]:
        """Runs the shape that holds ``batch_size`` rows at ``lengths``: the slot's
        graph when the context is still at the shapes it was captured at, else a
        normal run (after which the largest shape's graph is captured again)."""
        if self._closed:
            raise EngineDead("tensorrt engine is closed")
        c: _Context = slot.context
        batches = sorted({b for b, _ in c.combos})
        if not self.min_batch_size <= batch_size <= batches[-1]:
            raise InferenceFailed(
                f"tensorrt: batch {batch_size} outside the slot's "
                f"{self.min_batch_size}..{batches[-1]}"
            )
        bucket = bucket_for(batch_size, batches)
        stream = slot.stream
        try:
            self._set_shapes(c, bucket, lengths)
            if c.graph is not None:
                c.graph.launch(stream)
                return c.shapes[shape_key(bucket, lengths)]
            self._execute(c, stream)
        except (InferenceFailed, EngineDead):
            raise
        except Exception as exc:  # boundary: TensorRT / CuPy exceptions
            raise translate_gpu_error(exc, "tensorrt") from exc
        largest = c.combos[0]
        if self._cuda_graphs and (bucket, dict(lengths)) == largest and not c.graph_failed:
            # Full batches are back: TensorRT's protocol (a normal run at the
            # shape, then capture) allows a capture now, replayed from the next.
            c.graph = self._capture(c, stream)
            c.graph_failed = c.graph is None
        return c.shapes[shape_key(bucket, lengths)]

    def _set_shapes(self, c: _Context, batch: int, lengths: Mapping[str, int]) -> None:
        """Set the inputs' shapes when they change; that invalidates the graph. The
        outputs' shapes for these inputs are read once and kept."""
        key = shape_key(batch, lengths)
        if c.key == key:
            return
        c.graph, c.key = None, None  # unknown until it succeeds
        for desc in self._io.inputs:
            shape = (batch, *desc.row_at(lengths))
            if not c.context.set_input_shape(desc.name, shape):
                raise InferenceFailed(
                    f"tensorrt: set_input_shape({desc.name}, {shape}) failed: "
                    f"{self._logger.last_errors()}"
                )
        if key not in c.shapes:
            c.shapes[key] = {
                d.name: tuple(int(x) for x in c.context.get_tensor_shape(d.name))[1:]
                for d in self._io.outputs
            }
        c.key = key

    def _execute(self, c: _Context, stream: Any) -> None:
        if not c.context.execute_async_v3(stream.ptr):
            raise InferenceFailed(
                f"tensorrt: execute_async_v3 failed: {self._logger.last_errors()}"
            )

    def _capture(self, c: _Context, stream: Any) -> Any:
        """Capture this context's enqueue at its current shapes into a graph (right
        after a normal run at them, as TensorRT requires); None when the capture
        fails (logged)."""
        try:
            stream.begin_capture(mode=_THREAD_LOCAL_CAPTURE)
            try:
                ok = c.context.execute_async_v3(stream.ptr)
            finally:
                graph = stream.end_capture()
            if not ok:
                raise RuntimeError(self._logger.last_errors())
        except Exception as exc:  # boundary: capture unsupported for this engine
            log.warning("tensorrt_graph_capture_failed", shape=c.key, error=str(exc))
            return None
        return graph

    # --- CPU protocol (parity tests) -------------------------------------------------

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        """Synchronous run of host feeds; allocates per call. Not for the pipeline:
        its context uses profile 0, like slot 0's, so the two must not run at once."""
        if self._closed:
            raise EngineDead("tensorrt engine is closed")
        n = len(next(iter(feeds.values())))
        if not self.min_batch_size <= n <= self.max_batch_size:
            raise InferenceFailed(
                f"tensorrt: batch {n} outside {self.min_batch_size}..{self.max_batch_size}"
            )
        cp = self._cp
        with self._lock, cp.cuda.Device(self.device):
            # A fresh context per call, dropped afterwards: it takes profile 0, which
            # slot 0's context also uses, and TensorRT refuses two live contexts on
            # one profile of a dynamic-shape engine.
            ctx = None
            try:
                ctx = self._engine.create_execution_context()
                stream = cp.cuda.Stream(non_blocking=True)
                ok = ctx is not None
                if ok and self.dynamic:
                    ok = ctx.set_optimization_profile_async(0, stream.ptr)
                with stream:
                    xs = {d.name: cp.asarray(np.ascontiguousarray(feeds[d.name], d.dtype))
                          for d in self._io.inputs}  # fmt: skip
                for name, x in xs.items():
                    ok = ok and ctx.set_input_shape(name, x.shape)
                    ok = ok and ctx.set_tensor_address(name, int(x.data.ptr))
                outs = {}
                with stream:
                    for d in self._io.outputs:
                        shape = tuple(int(v) for v in ctx.get_tensor_shape(d.name))
                        outs[d.name] = cp.empty(shape, dtype=d.dtype)
                for name, arr in outs.items():
                    ok = ok and ctx.set_tensor_address(name, int(arr.data.ptr))
                ok = ok and ctx.execute_async_v3(stream.ptr)
                if not ok:
                    raise InferenceFailed(f"tensorrt: run failed: {self._logger.last_errors()}")
                stream.synchronize()
                return {name: cp.asnumpy(arr) for name, arr in outs.items()}
            except (InferenceFailed, EngineDead):
                raise
            except Exception as exc:  # boundary
                raise translate_gpu_error(exc, "tensorrt") from exc
            finally:
                del ctx

    def close(self) -> None:
        """Drop the engine; contexts still held by slots keep it alive until freed
        (the bindings reference-count it), so slots must be closed first."""
        self._closed = True
        self._engine = None
