"""TensorRT engine: a serialized plan, one execution context per slot.

Written to the TensorRT 10 Python API with named I/O tensors: the engine's
tensors are listed with ``num_io_tensors`` / ``get_tensor_name`` /
``get_tensor_mode``; the batch range comes from the optimization profiles
(``get_tensor_profile_shape``), whose maximum sizes the slot buffers. Each slot
gets its own ``IExecutionContext`` with the slot's buffer addresses bound once
(``set_tensor_address``): buffers never move, so a batch only sets the input
shape (when it changed) and calls ``execute_async_v3`` on the slot's stream.
TensorRT requires contexts that run concurrently on a dynamic-shape engine to use
different optimization profiles, so slot i selects profile i: build plans with
as many (identical) profiles as slots (``build-engine --profiles N``).

Batches are padded up to a bucket (``worker.engines.buckets``: the preferred
batch sizes, else powers of two, within the profile's range), so a context
only ever sees a few input shapes, and when a slot is created each of them is
set and run once, before the worker joins its consumer group, so first-run
costs at a shape never land on a request. TensorRT still redoes shape-dependent
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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from worker.config import ModelConfig
from worker.engines.base import (
    EngineInfo,
    EngineSlot,
    EngineUnavailable,
    Feeds,
    TensorSpec,
    content_version,
)
from worker.engines.buckets import bucket_for, bucket_sizes, slot_buckets
from worker.engines.cuda import import_cupy, translate_gpu_error
from worker.errors import ConfigError, EngineDead, InferenceFailed
from worker.model import ModelIO

log = structlog.get_logger(__name__)

_THREAD_LOCAL_CAPTURE = 1  # cudaStreamCaptureModeThreadLocal


def import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise EngineUnavailable(
            "model.backend = 'tensorrt' needs the TensorRT Python package (tensorrt >= 10) "
            "on a machine with an NVIDIA GPU; use backend 'torch' or 'onnxruntime' otherwise"
        ) from exc
    major = int(str(tensorrt.__version__).split(".")[0])
    if major < 10:
        raise EngineUnavailable(f"TensorRT {tensorrt.__version__} found; 10 or newer is required")
    return tensorrt


def make_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that keeps the last errors (to explain a failure in the
    exception we raise) and forwards warnings and errors to structlog."""

    class _Logger(trt.ILogger):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: deque[str] = deque(maxlen=8)

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            if level <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                log.error("tensorrt", message=msg)
            elif level == int(trt.ILogger.Severity.WARNING):
                log.warning("tensorrt", message=msg)

        def last_errors(self) -> str:
            return "; ".join(self.errors) or "no error logged"

    return _Logger()


def numpy_dtype(trt: Any, dtype: Any, name: str) -> np.dtype[Any]:
    try:
        result: np.dtype[Any] = np.dtype(trt.nptype(dtype))
    except TypeError as exc:
        raise ConfigError(
            f"tensor {name!r}: TensorRT type {dtype} has no NumPy equivalent"
        ) from exc
    return result


@dataclass
class _Context:
    """One slot's execution context and what it last did."""

    context: Any  # trt.IExecutionContext
    buckets: tuple[int, ...]  # the padded batch sizes this slot runs
    batch: int = -1  # batch size of the current input shape
    # The largest bucket's graph, valid only while the shape has not changed
    # since it was captured (None: none yet, or discarded by a change).
    graph: Any = None
    graph_failed: bool = False  # a capture failed on this slot: never try again


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
        self._buckets = tuple(buckets or ())
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
        inputs: list[str] = []
        outputs: list[str] = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            mode = engine.get_tensor_mode(name)
            (inputs if mode == trt.TensorIOMode.INPUT else outputs).append(name)
        if len(inputs) != 1:
            raise ConfigError(f"model.path: expected one engine input, found {inputs}")
        if cfg.output is not None and cfg.output not in outputs:
            raise ConfigError(f"model.output: {cfg.output!r} not in engine outputs {outputs}")
        in_name = inputs[0]
        # With a dynamic batch, contexts running at once need one optimization profile
        # each (TensorRT's rule), so a plan for N slots is built with N identical
        # profiles (build-engine --profiles) and slot i uses profile i.
        self.num_profiles = max(1, int(engine.num_optimization_profiles))
        self.dynamic = False
        self.min_batch_size, self.max_batch_size, row = self._batch_range(in_name)
        self.input = TensorSpec(
            in_name, numpy_dtype(trt, engine.get_tensor_dtype(in_name), in_name), row
        )
        self.outputs = tuple(self._output_spec(name) for name in outputs)
        self.info = EngineInfo(
            backend="tensorrt",
            name=cfg.name,
            version=content_version(path),
            io=ModelIO((self.input.desc(),), tuple(s.desc() for s in self.outputs)),
            max_batch_size=self.max_batch_size,
        )
        self._closed = False

    def _batch_range(self, name: str) -> tuple[int, int, tuple[int, ...]]:
        """The batch range every optimization profile accepts, and the row shape."""
        shape = tuple(int(d) for d in self._engine.get_tensor_shape(name))
        if not shape:
            raise ConfigError(f"engine input {name!r} has no batch dimension")
        self.dynamic = shape[0] < 0
        if not self.dynamic:  # a static batch: exactly that many rows per run
            lo = hi = shape[0]
            row = shape[1:]
        else:
            lo, hi, row = 1, 1 << 30, shape[1:]
            for profile in range(self.num_profiles):
                lo_shape, _, hi_shape = (
                    tuple(int(d) for d in dims)
                    for dims in self._engine.get_tensor_profile_shape(name, profile)
                )
                if lo_shape[1:] != hi_shape[1:]:
                    raise ConfigError(
                        f"engine input {name!r}: only the batch dimension may be dynamic "
                        f"(profile {profile} spans {lo_shape}..{hi_shape})"
                    )
                lo, hi, row = max(lo, lo_shape[0]), min(hi, hi_shape[0]), hi_shape[1:]
        if any(d < 0 for d in row) or lo < 1 or hi < lo:
            raise ConfigError(f"engine input {name!r}: unusable shape {shape} (batch {lo}..{hi})")
        return lo, hi, row

    def _output_spec(self, name: str) -> TensorSpec:
        """Per-row output shape, resolved at the maximum batch where it is dynamic."""
        dtype = numpy_dtype(self._trt, self._engine.get_tensor_dtype(name), name)
        shape = tuple(int(d) for d in self._engine.get_tensor_shape(name))
        if any(d < 0 for d in shape[1:]):
            with self._cp.cuda.Device(self.device):
                ctx = self._engine.create_execution_context()  # dropped below
                ctx.set_optimization_profile_async(0, self._cp.cuda.get_current_stream().ptr)
                ctx.set_input_shape(self.input.name, (self.max_batch_size, *self.input.shape))
                shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
                del ctx
        if not shape or any(d < 0 for d in shape[1:]):
            raise ConfigError(f"engine output {name!r}: cannot size its buffer ({shape})")
        return TensorSpec(name, dtype, shape[1:])

    # --- GpuEngine -----------------------------------------------------------------

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
                ok = ok and ctx.set_tensor_address(self.input.name, int(slot.engine_input.data.ptr))
                for spec in self.outputs:
                    ok = ok and ctx.set_tensor_address(
                        spec.name, int(slot.engine_outputs[spec.name].data.ptr)
                    )
            except RuntimeError as exc:
                raise ConfigError(
                    f"tensorrt: binding slot {slot.index} failed: {exc}: "
                    f"{self._logger.last_errors()}"
                ) from exc
        if not ok:
            raise ConfigError(
                f"tensorrt: binding slot {slot.index} failed: {self._logger.last_errors()}"
            )
        rows = int(slot.engine_input.shape[0])
        c = _Context(
            ctx, slot_buckets(self._buckets or bucket_sizes(rows), rows, self.min_batch_size)
        )
        self._warm(slot, c)
        return c

    def _warm(self, slot: EngineSlot, c: _Context) -> None:
        """Every bucket set and run once on the slot's stream, smallest first, so
        the context is left at the largest, whose graph is captured then (with
        ``cuda_graphs``). Start-up, before the worker joins."""
        started = time.monotonic()
        try:
            with self._cp.cuda.Device(slot.device):
                for bucket in c.buckets:
                    self._set_shape(c, bucket)
                    self._execute(c, slot.stream)
                if self._cuda_graphs:
                    c.graph = self._capture(c, slot.stream, c.buckets[-1])
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
        log.info(
            "tensorrt_slot_warmed",
            slot=slot.index,
            seconds=round(time.monotonic() - started, 3),
            buckets=list(c.buckets),
            graph=c.graph is not None,
        )

    def enqueue(self, slot: EngineSlot, batch_size: int) -> None:
        """Runs the bucket that holds ``batch_size`` rows: the slot's graph when
        the context is still at the shape it was captured at, else a normal run
        (after which the largest bucket's graph is captured again)."""
        if self._closed:
            raise EngineDead("tensorrt engine is closed")
        c: _Context = slot.context
        if not self.min_batch_size <= batch_size <= c.buckets[-1]:
            raise InferenceFailed(
                f"tensorrt: batch {batch_size} outside the slot's "
                f"{self.min_batch_size}..{c.buckets[-1]}"
            )
        bucket = bucket_for(batch_size, c.buckets)
        stream = slot.stream
        try:
            self._set_shape(c, bucket)
            if c.graph is not None:
                c.graph.launch(stream)
                return
            self._execute(c, stream)
        except (InferenceFailed, EngineDead):
            raise
        except Exception as exc:  # boundary: TensorRT / CuPy exceptions
            raise translate_gpu_error(exc, "tensorrt") from exc
        if self._cuda_graphs and bucket == c.buckets[-1] and not c.graph_failed:
            # Full batches are back: TensorRT's protocol (a normal run at the
            # shape, then capture) allows a capture now, replayed from the next.
            c.graph = self._capture(c, stream, bucket)
            c.graph_failed = c.graph is None

    def _set_shape(self, c: _Context, batch: int) -> None:
        """Set the input shape when it changes; that invalidates the graph."""
        if c.batch == batch:
            return
        c.graph, c.batch = None, -1  # unknown until it succeeds
        if not c.context.set_input_shape(self.input.name, (batch, *self.input.shape)):
            raise InferenceFailed(
                f"tensorrt: set_input_shape({batch}) failed: {self._logger.last_errors()}"
            )
        c.batch = batch

    def _execute(self, c: _Context, stream: Any) -> None:
        if not c.context.execute_async_v3(stream.ptr):
            raise InferenceFailed(
                f"tensorrt: execute_async_v3 failed: {self._logger.last_errors()}"
            )

    def _capture(self, c: _Context, stream: Any, batch_size: int) -> Any:
        """Capture this context's enqueue at ``batch_size`` into a graph (right
        after a normal run at that shape, as TensorRT requires); None when the
        capture fails (logged)."""
        try:
            stream.begin_capture(mode=_THREAD_LOCAL_CAPTURE)
            try:
                ok = c.context.execute_async_v3(stream.ptr)
            finally:
                graph = stream.end_capture()
            if not ok:
                raise RuntimeError(self._logger.last_errors())
        except Exception as exc:  # boundary: capture unsupported for this engine
            log.warning("tensorrt_graph_capture_failed", batch=batch_size, error=str(exc))
            return None
        return graph

    # --- CPU protocol (parity tests) -------------------------------------------------

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        """Synchronous run of a host batch; allocates per call. Not for the pipeline:
        its context uses profile 0, like slot 0's, so the two must not run at once."""
        if self._closed:
            raise EngineDead("tensorrt engine is closed")
        batch = feeds[self.input.name]
        n = int(batch.shape[0])
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
                    x = cp.asarray(np.ascontiguousarray(batch, dtype=self.input.dtype))
                    outs = {s.name: cp.empty((n, *s.shape), dtype=s.dtype) for s in self.outputs}
                ok = ok and ctx.set_input_shape(self.input.name, x.shape)
                ok = ok and ctx.set_tensor_address(self.input.name, int(x.data.ptr))
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
