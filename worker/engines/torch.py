"""Torch engine: a TorchScript (``torch.jit.save``) or exported (``.pt2``) model on CUDA.

It runs inside the slot pipeline without copies or extra synchronisation:

- the slot's CuPy device buffers are shared with torch zero-copy through DLPack
  (``torch.from_dlpack``), once per slot, so the preprocess kernel writes the
  model input in place and the model's outputs are copied (``copy_``, a device
  copy) straight into the buffers the postprocess kernel reads;
- the model runs on the slot's own CUDA stream, wrapped as
  ``torch.cuda.ExternalStream``, so it is ordered after the preprocess kernel and
  before the postprocess kernel by the stream alone. Torch's caching allocator
  keeps per-stream pools, so memory freed by one slot's batch is reused only on
  that slot's stream, in order.

What makes it keep up (``[model.torch]``; measured on an H100 with ResNet-50,
batch 64: eager TorchScript 8.2k img/s, channels_last + CUDA graph 12.9k,
torch.compile 22.0k):

- the module computes in ``precision`` with ``channels_last`` weights, and an
  exported program is compiled with ``torch.compile`` (TorchScript cannot be);
- every batch is padded up to a bucket (``worker.engines.buckets``), and when a
  slot is created every bucket is run (compiling, autotuning, choosing cuDNN
  algorithms) and then captured as one CUDA graph per bucket. This happens
  while the GPU stage is built, before the worker joins its consumer group, so
  no request waits on a compilation or a new shape. A batch then costs one
  graph launch on the slot's stream. The graphs bind the slot's buffers, which
  never move; the graphs of one slot share a memory pool, which is safe because
  they replay one at a time on that slot's stream and keep no tensor alive
  between replays.

Also what the GPU tests use where TensorRT is not installed. ``torch`` is
imported when the engine is constructed, so this module imports anywhere.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import structlog

from worker.config import ModelConfig, TorchConfig
from worker.engines.base import (
    EngineInfo,
    EngineSlot,
    EngineUnavailable,
    Feeds,
    TensorSpec,
    content_version,
)
from worker.engines.buckets import bucket_for, bucket_sizes, slot_buckets
from worker.engines.cuda import translate_gpu_error
from worker.errors import ConfigError, EngineDead, InferenceFailed
from worker.inference.preprocess import batch_shape
from worker.model import ModelIO

log = structlog.get_logger(__name__)

# Runs of each bucket before capture: the first compiles (and lets cuDNN time its
# algorithms), later ones must hit the compiled code with nothing left to set up.
WARM_RUNS: Final = 3


def import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise EngineUnavailable(
            "model.backend = 'torch' needs PyTorch with CUDA: pip install -e '.[torch]'"
        ) from exc
    if not torch.cuda.is_available():
        raise EngineUnavailable(
            f"PyTorch {torch.__version__} sees no CUDA device (a CPU-only build, or no driver)"
        )
    return torch


def load_module(torch: Any, path: Path, device: Any) -> Any:
    """A TorchScript file, or an exported program when the suffix is ``.pt2``, on
    ``device`` and in eval mode."""
    try:
        if path.suffix == ".pt2":
            program = torch.export.load(str(path))
            try:
                from torch.export.passes import move_to_device_pass
            except ImportError:  # torch < 2.6: move the unlifted module instead
                module = program.module().to(device)
            else:
                module = move_to_device_pass(program, device).module()
        else:
            module = torch.jit.load(str(path), map_location=device)
    except Exception as exc:  # boundary: torch raises RuntimeError for bad files
        raise ConfigError(f"model.path: cannot load {path} with torch: {exc}") from exc
    # Exported programs are fixed in the mode they were exported in, and some torch
    # versions refuse eval() on them; TorchScript modules need it (dropout, BN).
    with contextlib.suppress(NotImplementedError, RuntimeError):
        module.eval()
    return module


def _torch_dtype(torch: Any, name: str) -> Any:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def compute_dtype(torch: Any, cfg: TorchConfig, input_dtype: str) -> Any:
    """The dtype the module computes in: ``precision``, or the input's for "auto"."""
    return _torch_dtype(torch, input_dtype if cfg.precision == "auto" else cfg.precision)


def prepare_module(
    torch: Any, module: Any, cfg: TorchConfig, dtype: Any, max_shapes: int = 8
) -> tuple[Any, Any]:
    """``module`` in ``dtype`` and, with ``channels_last``, NHWC weights; and the
    callable to run: ``torch.compile`` of it for an exported program unless
    ``compile = "off"``, for up to ``max_shapes`` batch shapes (the buckets).
    Device-agnostic (tested on CPU torch). Compilation itself happens lazily, on
    the first call of each new shape: the warm-up's."""
    try:
        module = module.to(dtype=dtype)
        if cfg.channels_last:
            module = module.to(memory_format=torch.channels_last)
    except Exception as exc:  # boundary: a module whose parameters cannot convert
        raise ConfigError(f"model.torch: cannot convert the model to {dtype}: {exc}") from exc
    if cfg.compile == "off" or isinstance(module, torch.jit.ScriptModule):
        # TorchScript is compiled by its own profiling executor, not by dynamo.
        return module, module
    # One specialised compilation per bucket (dynamic=False): with automatic
    # dynamic shapes every bucket after the second would run generic kernels,
    # and autotuning would tune for one size only. Dynamo falls back to eager
    # beyond its recompile limit (8 by default), so it is raised to cover them.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), max_shapes + 1))
    return module, torch.compile(module, mode=cfg.compile, fullgraph=False, dynamic=False)


def _numpy_dtype(torch: Any, dtype: Any, name: str) -> np.dtype[Any]:
    if dtype == torch.bfloat16:
        # NumPy has no bfloat16: the slot's output buffer is float32, and the
        # device copy into it converts.
        return np.dtype(np.float32)
    try:
        result: np.dtype[Any] = torch.empty((), dtype=dtype).numpy().dtype
    except TypeError as exc:
        raise ConfigError(f"torch output {name!r}: {dtype} has no NumPy equivalent") from exc
    return result


def _to_host(torch: Any, t: Any, dtype: np.dtype[Any]) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        t = t.float()  # NumPy has no bfloat16 (see _numpy_dtype)
    return np.asarray(t.detach().cpu().numpy(), dtype=dtype)


@dataclass
class _Context:
    stream: Any  # torch.cuda.ExternalStream over the slot's stream
    input: Any  # torch view of slot.engine_input
    outputs: dict[str, Any]  # torch views of slot.engine_outputs
    buckets: tuple[int, ...]  # the engine's buckets that fit this slot's rows
    graphs: dict[int, Any] = field(default_factory=dict)  # bucket -> torch.cuda.CUDAGraph


class TorchEngine:
    def __init__(
        self,
        path: Path,
        cfg: ModelConfig,
        *,
        device: int = 0,
        max_batch_size: int = 64,
        buckets: Sequence[int] | None = None,
        output_names: Sequence[str] | None = None,
    ) -> None:
        torch = import_torch()
        self._torch = torch
        self.device = device
        self._device = torch.device("cuda", device)
        self._settings = cfg.torch
        pp = cfg.preprocess
        row = batch_shape(pp, 1)[1:]
        self.input = TensorSpec("input", np.dtype(pp.dtype), row)
        self.min_batch_size = 1
        self.max_batch_size = max_batch_size
        self.buckets = tuple(buckets) if buckets else bucket_sizes(max_batch_size)
        if self.buckets[-1] > max_batch_size:
            raise ConfigError(f"torch: bucket {self.buckets[-1]} exceeds the maximum batch")
        self._dtype = compute_dtype(torch, cfg.torch, pp.dtype)
        self._channels_last = cfg.torch.channels_last and len(row) == 3
        self._cuda_graphs = cfg.torch.cuda_graphs
        module = load_module(torch, path, self._device)
        if self._cuda_graphs:
            # cuDNN times its convolution algorithms once per shape, and the warm-up
            # pays for it; the captured graphs keep the choice. Without graphs this
            # stays off: cuDNN's benchmark cache is per thread, so every stage
            # thread would time again during live batches.
            torch.backends.cudnn.benchmark = True
        self._eager, self._module = prepare_module(
            torch, module, cfg.torch, self._dtype, max_shapes=len(self.buckets)
        )
        self.outputs = self._probe_outputs(cfg, output_names)
        self.info = EngineInfo(
            backend="torch",
            name=cfg.name,
            version=content_version(path),
            io=ModelIO((self.input.desc(),), tuple(s.desc() for s in self.outputs)),
            max_batch_size=max_batch_size,
        )
        log.info(
            "torch_engine_loaded",
            path=str(path),
            precision=str(self._dtype).removeprefix("torch."),
            compile=cfg.torch.compile if self._module is not self._eager else "off",
            channels_last=self._channels_last,
            cuda_graphs=self._cuda_graphs,
            buckets=list(self.buckets),
        )
        self._closed = False

    def _probe_outputs(
        self, cfg: ModelConfig, output_names: Sequence[str] | None
    ) -> tuple[TensorSpec, ...]:
        """Run a zero batch once, eagerly (a probe must not compile a shape no
        batch will use), to learn the outputs' names, shapes and dtypes (a
        TorchScript file does not declare them). Start-up only."""
        torch = self._torch
        rows = min(2, self.max_batch_size)
        dtype = _torch_dtype(torch, self.input.dtype.name)
        try:
            with torch.inference_mode(), torch.cuda.device(self._device):
                x = torch.zeros((rows, *self.input.shape), dtype=dtype, device=self._device)
                values = self._forward(self._eager, x)
                torch.cuda.synchronize(self._device)
        except InferenceFailed as exc:
            raise ConfigError(f"model.path: {exc}") from exc
        except Exception as exc:  # boundary: the model rejects its own input shape
            raise ConfigError(
                f"model.path: the torch model fails on a {self.input.dtype}"
                f"{[rows, *self.input.shape]} batch: {exc}"
            ) from exc
        names: list[str]
        if all(name is not None for name, _ in values):
            names = [str(name) for name, _ in values]
        elif output_names is not None:
            names = list(output_names)
        elif len(values) == 1:
            names = [cfg.output or "output"]
        else:
            names = [f"output_{i}" for i in range(len(values))]
        if len(names) != len(values):
            raise ConfigError(f"torch: {len(values)} outputs but names {names}")
        specs = []
        for name, (_, t) in zip(names, values, strict=True):
            if t.dim() < 1 or t.shape[0] != rows:
                raise ConfigError(f"torch output {name!r} has no batch dimension ({t.shape})")
            specs.append(TensorSpec(name, _numpy_dtype(torch, t.dtype, name), tuple(t.shape[1:])))
        return tuple(specs)

    def _forward(self, module: Any, x: Any) -> list[tuple[str | None, Any]]:
        """``module`` on ``x`` in the compute dtype and memory format (one copy at
        most, none when both already match)."""
        if self._channels_last:
            x = x.to(dtype=self._dtype, memory_format=self._torch.channels_last)
        elif x.dtype != self._dtype:
            x = x.to(self._dtype)
        return self._flatten(module(x))

    def _flatten(self, value: Any) -> list[tuple[str | None, Any]]:
        torch = self._torch
        if isinstance(value, torch.Tensor):
            return [(None, value)]
        if isinstance(value, dict):
            return [(str(k), v) for k, v in value.items()]
        if isinstance(value, tuple | list):
            return [(None, v) for v in value]
        raise InferenceFailed(f"torch: unsupported model output type {type(value).__name__}")

    # --- GpuEngine -----------------------------------------------------------------

    def create_context(self, slot: EngineSlot) -> _Context:
        """Views of the slot's buffers, then every bucket warmed and captured
        (start-up: this is where compilation time goes)."""
        torch = self._torch
        with torch.cuda.device(self._device):
            stream = torch.cuda.ExternalStream(int(slot.stream.ptr), device=self._device)
            inp = torch.from_dlpack(slot.engine_input)
            outs = {s.name: torch.from_dlpack(slot.engine_outputs[s.name]) for s in self.outputs}
        if inp.data_ptr() != int(slot.engine_input.data.ptr):
            raise ConfigError("torch: DLPack import of the slot input made a copy")
        context = _Context(stream, inp, outs, slot_buckets(self.buckets, int(inp.shape[0])))
        self._warm(slot.index, context)
        return context

    def _warm(self, slot: int, c: _Context) -> None:
        torch = self._torch
        started = time.monotonic()
        bucket_ms: dict[int, float] = {}
        try:
            with (
                torch.cuda.device(self._device),
                torch.cuda.stream(c.stream),
                torch.inference_mode(),
            ):
                for bucket in reversed(c.buckets):  # largest first: it sizes the pools
                    t0 = time.monotonic()
                    for _ in range(WARM_RUNS):
                        self._run_into(c, bucket)
                    c.stream.synchronize()
                    bucket_ms[bucket] = round((time.monotonic() - t0) * 1e3, 1)
                    # Progress: the first slot compiles every bucket, which for
                    # a large model is the bulk of the worker's start-up.
                    log.info(
                        "torch_bucket_warmed",
                        slot=slot,
                        bucket=bucket,
                        ms=bucket_ms[bucket],
                        done=len(bucket_ms),
                        of=len(c.buckets),
                    )
        except (InferenceFailed, EngineDead, ConfigError):
            raise
        except Exception as exc:  # boundary: compilation or the model failing
            raise ConfigError(f"model.path: the torch model fails while warming up: {exc}") from exc
        if self._cuda_graphs:
            self._capture(slot, c)
        log.info(
            "torch_slot_warmed",
            slot=slot,
            seconds=round(time.monotonic() - started, 2),
            bucket_ms=bucket_ms,
            graphs=sorted(c.graphs),
        )

    def _capture(self, slot: int, c: _Context) -> None:
        """One CUDA graph per bucket on the slot's stream, sharing one pool.

        A failed capture stops start-up (exit 2) rather than falling back: on torch
        2.11 a capture that fails leaves the caching allocator believing a capture
        is still under way (``CUDAGraph::capture_end`` throws before it ends the
        pool; fixed upstream in pytorch#180395), after which ``empty_cache`` and
        every later capture in the process fail. Recovering in process is not safe.
        """
        torch = self._torch
        pool = None
        try:
            with torch.cuda.device(self._device), torch.inference_mode():
                for bucket in reversed(c.buckets):
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: other threads' CUDA calls during start-up (the
                    # NVML monitor, CuPy on the legacy stream) must not invalidate it.
                    with torch.cuda.graph(
                        graph, pool=pool, stream=c.stream, capture_error_mode="thread_local"
                    ):
                        self._run_into(c, bucket)
                    pool = graph.pool() if pool is None else pool
                    c.graphs[bucket] = graph
        except Exception as exc:  # boundary: a model that cannot be captured
            raise ConfigError(
                f"model.torch.cuda_graphs: the model cannot be captured as a CUDA graph "
                f"(slot {slot}): {type(exc).__name__}: {exc}. A model that reads device "
                f"values in forward (.item(), bool(tensor), printing) cannot be; set "
                f"model.torch.cuda_graphs = false"
            ) from exc

    def _run_into(self, c: _Context, rows: int) -> None:
        """The module on the first ``rows`` of the slot's input, its outputs copied
        into the slot's output buffers (on the current stream)."""
        values = self._forward(self._module, c.input[:rows])
        if len(values) != len(self.outputs):
            raise InferenceFailed(
                f"torch: model returned {len(values)} outputs, expected {len(self.outputs)}"
            )
        for spec, (_, t) in zip(self.outputs, values, strict=True):
            dst = c.outputs[spec.name][:rows]
            if tuple(t.shape) != tuple(dst.shape):
                raise InferenceFailed(
                    f"torch: output {spec.name!r} has shape {tuple(t.shape)} "
                    f"for {rows} rows, expected {tuple(dst.shape)}"
                )
            dst.copy_(t)  # device copy on the slot's stream, dtype-converting

    def enqueue(self, slot: EngineSlot, batch_size: int) -> None:
        """Runs the bucket that holds ``batch_size`` rows: its graph, or the module."""
        if self._closed:
            raise EngineDead("torch engine is closed")
        torch = self._torch
        c: _Context = slot.context
        try:
            bucket = bucket_for(batch_size, c.buckets)
            graph = c.graphs.get(bucket)
            with torch.cuda.stream(c.stream):
                if graph is not None:
                    graph.replay()
                else:
                    with torch.inference_mode():
                        self._run_into(c, bucket)
        except (InferenceFailed, EngineDead):
            raise
        except ValueError as exc:  # more rows than the slot holds: a caller's bug
            raise InferenceFailed(f"torch: {exc}") from exc
        except Exception as exc:  # boundary: torch raises RuntimeError for CUDA failures
            raise translate_gpu_error(exc, "torch") from exc

    # --- CPU protocol (parity tests) -------------------------------------------------

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]:
        """Synchronous run of a host batch on torch's current stream; allocates.
        Padded to a bucket like ``enqueue``, so it runs the same compiled shapes."""
        if self._closed:
            raise EngineDead("torch engine is closed")
        torch = self._torch
        batch = feeds[self.input.name]
        n = len(batch)
        try:
            with torch.inference_mode(), torch.cuda.device(self._device):
                host = np.ascontiguousarray(batch, dtype=self.input.dtype)
                rows = bucket_for(n, self.buckets) if 1 <= n <= self.buckets[-1] else n
                x = torch.zeros((rows, *host.shape[1:]), dtype=_torch_dtype(torch, host.dtype.name))
                x[:n] = torch.from_numpy(host)
                values = self._forward(self._module, x.to(self._device))
                return {
                    spec.name: _to_host(torch, t[:n], spec.dtype)
                    for spec, (_, t) in zip(self.outputs, values, strict=True)
                }
        except (InferenceFailed, EngineDead):
            raise
        except Exception as exc:  # boundary
            raise translate_gpu_error(exc, "torch") from exc

    def close(self) -> None:
        self._closed = True
        self._module = None
        self._eager = None
