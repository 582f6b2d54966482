"""``infer-worker build-engine --backend torch``: a model -> an exported program (``.pt2``), cached.

The torch engine runs exported programs compiled (``torch.compile``), so what a
deployment pins is the exported program: the model's graph and weights with a
dynamic batch dimension (1..``max_batch_size``), saved with ``torch.export.save``.
Export runs on the CPU and needs no GPU; the worker moves the program to its
device, converts it to ``[model.torch] precision`` and compiles it at start-up,
warming every batch bucket before it joins the consumer group.

Sources:
- ``torchvision:NAME`` (e.g. ``torchvision:resnet50``): the torchvision model with
  random weights (seeded, so the same versions give the same file; nothing is
  downloaded). For benchmarks, and a template for your own.
- ``FILE.py:CALLABLE`` or ``package.module:CALLABLE``: a zero-argument callable
  returning your ``torch.nn.Module`` with its weights loaded.

Cache: ``<out_dir>/<key>.pt2`` with the key's components in ``<key>.json``. The key
is the source's identity (the torchvision version and name, or the SHA-256 of the
factory's file), the torch version, the input shape and the batch range, so
building again with the same inputs returns the existing file.

AOTInductor packages (``aoti_compile_and_package``) would move compilation out
of start-up, but loading one crashed the process (segmentation fault) on the
GPU machine's torch 2.11 image, twice (DESIGN.md): the worker compiles in
process, and the compilers' own on-disk caches (``TORCHINDUCTOR_CACHE_DIR``;
keep it on a volume) make a restart fast.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from worker.flow.errors import ConfigError
from worker.ops.files import atomic_write, file_sha256

log = structlog.get_logger(__name__)

TORCHVISION = "torchvision:"
SEED = 0  # random weights of torchvision models: the same file for the same versions


@dataclass(frozen=True)
class ProgramKey:
    """Everything an exported program depends on; its digest names the cached file."""

    source: str
    source_sha256: str  # the factory's file; the torchvision version for torchvision:
    torch_version: str
    input_shape: tuple[int, ...]  # one request, without the batch dimension
    max_batch_size: int

    def digest(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def import_torch_for_export() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ConfigError(
            "build-engine --backend torch needs PyTorch: pip install -e '.[torch]'"
        ) from exc
    return torch


def resolve_source(source: str) -> tuple[Callable[[], Any], str]:
    """The factory ``source`` names and its identity for the cache key."""
    if source.startswith(TORCHVISION):
        name = source.removeprefix(TORCHVISION)
        try:
            import torchvision
        except ImportError as exc:
            raise ConfigError(f"{source}: needs torchvision (pip install torchvision)") from exc
        if name not in torchvision.models.list_models():
            raise ConfigError(f"{source}: torchvision has no model {name!r}")
        return (lambda: torchvision.models.get_model(name, weights=None)), (
            f"torchvision {torchvision.__version__}"
        )
    where, sep, attr = source.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise ConfigError(
            f"model source {source!r}: expected torchvision:NAME, FILE.py:CALLABLE "
            "or package.module:CALLABLE"
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"model source {source!r}: {path} is not a file")
        spec = importlib.util.spec_from_file_location(f"_infer_model_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # boundary: the user's file
            raise ConfigError(f"model source {source!r}: importing {path} failed: {exc}") from exc
        identity = file_sha256(path)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"model source {source!r}: cannot import {where}: {exc}") from exc
        file = getattr(module, "__file__", None)
        identity = file_sha256(Path(file)) if file else where
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model source {source!r}: {attr} is not a callable in {where}")
    return factory, identity


def build_torch_program(
    source: str,
    out_dir: Path,
    *,
    max_batch_size: int,
    input_shape: tuple[int, ...],
    force: bool = False,
) -> Path:
    """Export (or reuse) the program for these inputs; returns its ``.pt2`` path."""
    if max_batch_size < 1:
        raise ConfigError(f"max batch must be >= 1, got {max_batch_size}")
    torch = import_torch_for_export()
    factory, identity = resolve_source(source)
    key = ProgramKey(source, identity, torch.__version__, tuple(input_shape), max_batch_size)
    path = out_dir / f"{key.digest()}.pt2"
    if path.is_file() and not force:
        log.info("program_cache_hit", program=str(path))
        return path
    torch.manual_seed(SEED)
    try:
        model = factory()
    except Exception as exc:  # boundary: the user's factory
        raise ConfigError(f"model source {source!r}: the factory failed: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model source {source!r}: the factory returned {type(model).__name__}, "
            "not a torch.nn.Module"
        )
    program = export(torch, model.eval(), input_shape, max_batch_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.pt2")  # torch wants .pt2
    try:
        torch.export.save(program, str(tmp))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {**asdict(key), "program": path.name}
    atomic_write(path.with_suffix(".json"), json.dumps(meta, indent=2).encode())
    log.info("program_exported", program=str(path), source=source)
    return path


def export(torch: Any, model: Any, input_shape: tuple[int, ...], max_batch_size: int) -> Any:
    """``model`` exported with a dynamic batch dimension, checked against eager."""
    rows = min(2, max_batch_size)
    example = torch.randn(rows, *input_shape)
    batch = torch.export.Dim("batch", min=1, max=max_batch_size) if max_batch_size > 1 else None
    try:
        with torch.no_grad():
            program = torch.export.export(
                model, (example,), dynamic_shapes=({0: batch},) if batch is not None else None
            )
    except Exception as exc:  # boundary: export refuses the model
        raise ConfigError(
            f"torch.export could not export the model for input [batch, "
            f"{', '.join(map(str, input_shape))}]: {exc}"
        ) from exc
    # The exported graph must compute what the module does (a data-dependent
    # branch traced one way would not).
    check = torch.randn(1, *input_shape)
    with torch.no_grad():
        want, got = model(check), program.module()(check)
    for w, g in zip(_tensors(torch, want), _tensors(torch, got), strict=True):
        if not torch.allclose(w, g, rtol=1e-4, atol=1e-5):
            raise ConfigError("the exported program's output differs from the model's")
    return program


def _tensors(torch: Any, value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return list(value.values())
    return list(value)


def input_shape_of(preprocess: Any) -> tuple[int, ...]:
    """One request's model input, as ``[model.preprocess]`` produces it."""
    from worker.model.inputs.image import resolve_declared

    pp = resolve_declared(preprocess, "the model is exported at the size it preprocesses to")
    return tuple(pp.batch_shape(1)[1:])


def torch_missing() -> bool:
    """True (and says so on stderr) when torch cannot be imported."""
    if importlib.util.find_spec("torch") is not None:
        return False
    print("build-engine --backend torch needs PyTorch: pip install -e '.[torch]'", file=sys.stderr)
    return True


def run_cli(
    source: str, out_dir: Path, max_batch: int, input_shape: tuple[int, ...], force: bool
) -> int:
    """The CLI's torch branch: prints the program's path."""
    path = build_torch_program(
        source,
        out_dir,
        max_batch_size=max_batch,
        input_shape=input_shape,
        force=force,
    )
    print(path)
    return 0
