"""The torch model itself: loaded, described, converted and compiled.

Device-agnostic (the tests run it on CPU torch): what the torch engine
(``worker.compute.engines.torch``) runs, before any slot exists.

- A ``.pt2`` file is an exported program (``torch.export``): its inputs and
  outputs are read from the program (names, dtypes, and the symbols of its
  dynamic dimensions, which inputs and outputs share: how a per-token output is
  known to follow its input's length). A TorchScript file says nothing about
  its shapes: its one input is what ``[model.preprocess]`` produces, and its
  outputs are learnt by running it once.
- ``precision``: the module is converted to the compute dtype. An exported
  program whose ``forward`` casts itself (``.float()``, ``.to(dtype)``: export
  records them as fixed casts) fails once its weights are converted; such a
  program runs in float32 weights under ``torch.autocast`` instead, which
  computes the same layers in the reduced precision.
- ``compile``: ``torch.compile`` of an exported program, dynamic in the batch
  and the padded dimensions (marked when the warm-up first calls it), so one
  compilation serves every bucket; TorchScript runs as scripted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.compute.engines.base import EngineUnavailable
from worker.config import TorchConfig
from worker.flow.errors import ConfigError, InferenceFailed
from worker.model.io import Dim, ModelIO, TensorDesc


def import_torch(need_cuda: bool = True) -> Any:
    try:
        import torch
    except ImportError as exc:
        raise EngineUnavailable(
            "model.backend = 'torch' needs PyTorch with CUDA: pip install -e '.[torch]'"
        ) from exc
    if need_cuda and not torch.cuda.is_available():
        raise EngineUnavailable(
            f"PyTorch {torch.__version__} sees no CUDA device (a CPU-only build, or no driver)"
        )
    return torch


@dataclass
class Loaded:
    """A loaded model: the module to run, and its description when the file has one
    (an exported program); ``bounds``: each dynamic symbol's (min, max)."""

    module: Any
    io: ModelIO | None = None
    bounds: dict[str, tuple[int, int]] | None = None


def load_program(torch: Any, path: Path, device: Any) -> Loaded:
    """A TorchScript file, or an exported program when the suffix is ``.pt2``, on
    ``device`` and in eval mode, with what the file says of its inputs and outputs."""
    io: ModelIO | None = None
    bounds: dict[str, tuple[int, int]] | None = None
    try:
        if path.suffix == ".pt2":
            program = torch.export.load(str(path))
            io, bounds = describe_program(torch, program)
            try:
                from torch.export.passes import move_to_device_pass
            except ImportError:  # torch < 2.6: move the unlifted module instead
                module = program.module().to(device)
            else:
                module = move_to_device_pass(program, device).module()
        else:
            module = torch.jit.load(str(path), map_location=device)
    except ConfigError:
        raise
    except Exception as exc:  # boundary: torch raises RuntimeError for bad files
        raise ConfigError(f"model.path: cannot load {path} with torch: {exc}") from exc
    # Exported programs are fixed in the mode they were exported in, and some torch
    # versions refuse eval() on them; TorchScript modules need it (dropout, BN).
    with contextlib.suppress(NotImplementedError, RuntimeError):
        module.eval()
    return Loaded(module, io, bounds)


def load_module(torch: Any, path: Path, device: Any) -> Any:
    """``load_program``'s module alone."""
    return load_program(torch, path, device).module


def describe_program(torch: Any, program: Any) -> tuple[ModelIO, dict[str, tuple[int, int]]]:
    """The user inputs and outputs of an exported program, from its placeholders'
    and output's tensor metadata: a dimension is an int, or the name of its
    symbol (shared wherever export proved two dimensions equal). Outputs are named
    by a returned dict's keys, else ``output`` / ``output_0``, ``output_1``..."""
    signature = program.graph_signature
    user_inputs = list(signature.user_inputs)
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = [_desc(torch, name, nodes[name].meta["val"], "input") for name in user_inputs]
    (out_node,) = [n for n in program.graph.nodes if n.op == "output"]
    values = [a.meta.get("val") if hasattr(a, "meta") else None for a in out_node.args[0]]
    spec = program.call_spec.out_spec
    if spec is not None and spec.type is dict:
        names = [str(k) for k in spec.context]
    elif len(values) == 1:
        names = ["output"]
    else:
        names = [f"output_{i}" for i in range(len(values))]
    outputs = []
    for name, val in zip(names, values, strict=True):
        if val is None or not hasattr(val, "shape"):
            raise ConfigError(f"model.path: the program's output {name!r} is not a tensor")
        outputs.append(_desc(torch, name, val, "output"))
    bounds: dict[str, tuple[int, int]] = {}
    for symbol, ranges in getattr(program, "range_constraints", {}).items():
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            bounds[str(symbol)] = (int(ranges.lower), int(ranges.upper))
    return ModelIO(tuple(inputs), tuple(outputs)), bounds


def _desc(torch: Any, name: str, val: Any, where: str) -> TensorDesc:
    if val.dim() < 1:
        raise ConfigError(f"model.path: the program's {where} {name!r} has no batch dimension")
    dims: list[Dim] = [d if isinstance(d, int) else str(d) for d in val.shape]
    return TensorDesc(name, numpy_dtype(torch, val.dtype, name), tuple(dims[1:]))


def strip_dtype_asserts(torch: Any, module: Any) -> int:
    """Remove the dtype assertions export records before a program's own casts
    (``aten._assert_tensor_metadata``): they check the dtype the program was
    exported in, which autocast changes; they compute nothing. Returns how many."""
    graph = getattr(module, "graph", None)
    target = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    if graph is None or target is None:
        return 0
    removed = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is target.default and not node.users:
            graph.erase_node(node)
            removed += 1
    if removed:
        module.recompile()
    return removed


def torch_dtype(torch: Any, name: str) -> Any:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def compute_dtype(torch: Any, cfg: TorchConfig, input_dtype: str) -> Any:
    """The dtype the module computes in: ``precision``, or the input's for "auto"."""
    return torch_dtype(torch, input_dtype if cfg.precision == "auto" else cfg.precision)


def prepare_module(
    torch: Any, module: Any, cfg: TorchConfig, dtype: Any, max_shapes: int = 8
) -> tuple[Any, Any]:
    """``module`` in ``dtype`` and, with ``channels_last``, NHWC weights; and the
    callable to run: ``torch.compile`` of it for an exported program unless
    ``compile = "off"``. Compilation happens lazily, on the first calls: the
    warm-up's, which mark the batch and padded dimensions dynamic so one
    compilation serves the buckets (a size-1 bucket is its own specialisation);
    dynamo's recompile limit is raised to ``max_shapes`` + 1 all the same, so a
    guard that does fail falls back to a compilation, not to eager."""
    try:
        module = module.to(dtype=dtype)
        if cfg.channels_last:
            module = module.to(memory_format=torch.channels_last)
    except Exception as exc:  # boundary: a module whose parameters cannot convert
        raise ConfigError(f"model.torch: cannot convert the model to {dtype}: {exc}") from exc
    if cfg.compile == "off" or isinstance(module, torch.jit.ScriptModule):
        # TorchScript is compiled by its own profiling executor, not by dynamo.
        return module, module
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), max_shapes + 1))
    return module, torch.compile(module, mode=cfg.compile, fullgraph=False, dynamic=None)


def numpy_dtype(torch: Any, dtype: Any, name: str) -> np.dtype[Any]:
    if dtype == torch.bfloat16:
        # NumPy has no bfloat16: the slot's output buffer is float32, and the
        # device copy into it converts.
        return np.dtype(np.float32)
    try:
        result: np.dtype[Any] = torch.empty((), dtype=dtype).numpy().dtype
    except TypeError as exc:
        raise ConfigError(f"torch tensor {name!r}: {dtype} has no NumPy equivalent") from exc
    return result


def to_host(torch: Any, t: Any, dtype: np.dtype[Any]) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        t = t.float()  # NumPy has no bfloat16 (see numpy_dtype)
    return np.asarray(t.detach().cpu().numpy(), dtype=dtype)


def probe_outputs(
    torch: Any,
    call: Callable[[Any], list[tuple[str | None, Any]]],
    inp: TensorDesc,
    rows: int,
    device: Any,
    names: Sequence[str] | None = None,
) -> tuple[TensorDesc, ...]:
    """Run a zero batch once, eagerly (a probe must not compile a shape no batch
    will use), to learn a TorchScript model's outputs (it does not declare them):
    names (a returned dict's keys, else ``names``, else ``output`` / ``output_i``),
    shapes and dtypes. Start-up only."""
    from worker.flow.errors import InferenceFailed

    try:
        with torch.inference_mode():
            x = torch.zeros((rows, *inp.shape), dtype=torch_dtype(torch, inp.dtype.name),
                            device=device)  # fmt: skip
            values = call(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except InferenceFailed as exc:
        raise ConfigError(f"model.path: {exc}") from exc
    except Exception as exc:  # boundary: the model rejects its own input shape
        raise ConfigError(
            f"model.path: the torch model fails on a {inp.dtype}{[rows, *inp.shape]} batch: {exc}"
        ) from exc
    if all(name is not None for name, _ in values):
        found = [str(name) for name, _ in values]
    elif names is not None and len(names) == len(values):
        found = list(names)
    elif len(values) == 1:
        found = ["output"]
    else:
        found = [f"output_{i}" for i in range(len(values))]
    specs = []
    for name, (_, t) in zip(found, values, strict=True):
        if t.dim() < 1 or t.shape[0] != rows:
            raise ConfigError(f"torch output {name!r} has no batch dimension ({t.shape})")
        dtype = numpy_dtype(torch, t.dtype, name)
        specs.append(TensorDesc(name, dtype, tuple(int(d) for d in t.shape[1:])))
    return tuple(specs)


def flatten_outputs(torch: Any, value: Any) -> list[tuple[str | None, Any]]:
    """A module's return value as (name, tensor) pairs: a tensor, a dict of them
    (named), or a tuple or list of them."""
    if isinstance(value, torch.Tensor):
        return [(None, value)]
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, tuple | list):
        return [(None, v) for v in value]
    raise InferenceFailed(f"torch: unsupported model output type {type(value).__name__}")
