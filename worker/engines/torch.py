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

Also what the GPU tests use where TensorRT is not installed. ``torch`` is
imported when the engine is constructed, so this module imports anywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.config import ModelConfig
from worker.engines.base import (
    EngineInfo,
    EngineSlot,
    EngineUnavailable,
    TensorSpec,
    content_version,
)
from worker.engines.cuda import translate_gpu_error
from worker.errors import ConfigError, EngineDead, InferenceFailed
from worker.inference.preprocess import batch_shape


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
    return {"float32": torch.float32, "float16": torch.float16}[name]


def _numpy_dtype(torch: Any, dtype: Any, name: str) -> np.dtype[Any]:
    try:
        result: np.dtype[Any] = torch.empty((), dtype=dtype).numpy().dtype
    except TypeError as exc:
        raise ConfigError(f"torch output {name!r}: {dtype} has no NumPy equivalent") from exc
    return result


@dataclass
class _Context:
    stream: Any  # torch.cuda.ExternalStream over the slot's stream
    input: Any  # torch view of slot.engine_input
    outputs: dict[str, Any]  # torch views of slot.engine_outputs


class TorchEngine:
    def __init__(
        self,
        path: Path,
        cfg: ModelConfig,
        *,
        device: int = 0,
        max_batch_size: int = 64,
        output_names: Sequence[str] | None = None,
    ) -> None:
        torch = import_torch()
        self._torch = torch
        self.device = device
        self._device = torch.device("cuda", device)
        self._module = load_module(torch, path, self._device)
        pp = cfg.preprocess
        row = batch_shape(pp, 1)[1:]
        self.input = TensorSpec("input", np.dtype(pp.dtype), row)
        self.min_batch_size = 1
        self.max_batch_size = max_batch_size
        self.outputs = self._probe_outputs(cfg, output_names)
        self.info = EngineInfo(
            backend="torch",
            name=cfg.name,
            version=content_version(path),
            input_name=self.input.name,
            output_names=tuple(s.name for s in self.outputs),
            max_batch_size=max_batch_size,
        )
        self._closed = False

    def _probe_outputs(
        self, cfg: ModelConfig, output_names: Sequence[str] | None
    ) -> tuple[TensorSpec, ...]:
        """Run a zero batch once to learn the outputs' names, shapes and dtypes
        (a TorchScript file does not declare them). Start-up only."""
        torch = self._torch
        rows = min(2, self.max_batch_size)
        dtype = _torch_dtype(torch, self.input.dtype.name)
        try:
            with torch.inference_mode(), torch.cuda.device(self._device):
                x = torch.zeros((rows, *self.input.shape), dtype=dtype, device=self._device)
                values = self._flatten(self._module(x))
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
        torch = self._torch
        with torch.cuda.device(self._device):
            stream = torch.cuda.ExternalStream(int(slot.stream.ptr), device=self._device)
            inp = torch.from_dlpack(slot.engine_input)
            outs = {s.name: torch.from_dlpack(slot.engine_outputs[s.name]) for s in self.outputs}
        if inp.data_ptr() != int(slot.engine_input.data.ptr):
            raise ConfigError("torch: DLPack import of the slot input made a copy")
        return _Context(stream, inp, outs)

    def enqueue(self, slot: EngineSlot, batch_size: int) -> None:
        if self._closed:
            raise EngineDead("torch engine is closed")
        torch = self._torch
        c: _Context = slot.context
        n = batch_size
        try:
            with torch.cuda.stream(c.stream), torch.inference_mode():
                values = self._flatten(self._module(c.input[:n]))
                if len(values) != len(self.outputs):
                    raise InferenceFailed(
                        f"torch: model returned {len(values)} outputs, expected {len(self.outputs)}"
                    )
                for spec, (_, t) in zip(self.outputs, values, strict=True):
                    dst = c.outputs[spec.name][:n]
                    if tuple(t.shape) != tuple(dst.shape):
                        raise InferenceFailed(
                            f"torch: output {spec.name!r} has shape {tuple(t.shape)} "
                            f"for {n} rows, expected {tuple(dst.shape)}"
                        )
                    dst.copy_(t)  # device copy on the slot's stream, dtype-converting
        except (InferenceFailed, EngineDead):
            raise
        except Exception as exc:  # boundary: torch raises RuntimeError for CUDA failures
            raise translate_gpu_error(exc, "torch") from exc

    # --- CPU protocol (parity tests) -------------------------------------------------

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """Synchronous run of a host batch on torch's current stream; allocates."""
        if self._closed:
            raise EngineDead("torch engine is closed")
        torch = self._torch
        try:
            with torch.inference_mode(), torch.cuda.device(self._device):
                host = np.ascontiguousarray(batch, dtype=self.input.dtype)
                x = torch.from_numpy(host).to(self._device)
                values = self._flatten(self._module(x))
                return {
                    spec.name: t.detach().cpu().numpy()
                    for spec, (_, t) in zip(self.outputs, values, strict=True)
                }
        except (InferenceFailed, EngineDead):
            raise
        except Exception as exc:  # boundary
            raise translate_gpu_error(exc, "torch") from exc

    def close(self) -> None:
        self._closed = True
        self._module = None
