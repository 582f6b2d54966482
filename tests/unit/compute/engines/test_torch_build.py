"""``build-engine --backend torch`` and the torch engine's model preparation, on CPU torch.

Export and ``torch.compile`` need no GPU, so what the torch engine does before
it touches CUDA (the exported program with its dynamic batch, the precision and
memory-format conversion, compilation per bucket) is checked here wherever torch
is installed (``pip install -e '.[torch]'``; CI has no torch and skips those
tests). The CUDA part (slots, warm-up per slot, CUDA graphs) is in
``tests/gpu/test_gpu_torch.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from worker.config import TorchConfig
from worker.flow.errors import ConfigError
from worker.model.shapes import bucket_sizes
from worker.ops import build_engine
from worker.ops.build_torch import ProgramKey, resolve_source

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.usefixtures("torch_installed")

TINY = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


def build():
    return Net()


def not_a_module():
    return 42
"""
SHAPE = (3, 12, 12)


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_engine.add_arguments(parser)
    return parser.parse_args(argv)


def test_sources_that_name_nothing_are_refused(tmp_path: Path) -> None:
    for source in ("resnet50", "x.py:", ":build", "json:not an identifier"):
        with pytest.raises(ConfigError, match="expected torchvision:NAME"):
            resolve_source(source)
    with pytest.raises(ConfigError, match="is not a file"):
        resolve_source(f"{tmp_path}/missing.py:build")
    with pytest.raises(ConfigError, match="cannot import"):
        resolve_source("no_such_package_here:build")
    with pytest.raises(ConfigError, match="not a callable"):
        resolve_source("json:JSONDecodeErrorX")


def test_the_cache_key_changes_with_every_component() -> None:
    base = ProgramKey("torchvision:resnet50", "torchvision 0.29", "2.14", (3, 224, 224), 64)
    others = [
        ProgramKey("torchvision:resnet18", "torchvision 0.29", "2.14", (3, 224, 224), 64),
        ProgramKey("torchvision:resnet50", "torchvision 0.30", "2.14", (3, 224, 224), 64),
        ProgramKey("torchvision:resnet50", "torchvision 0.29", "2.15", (3, 224, 224), 64),
        ProgramKey("torchvision:resnet50", "torchvision 0.29", "2.14", (3, 256, 256), 64),
        ProgramKey("torchvision:resnet50", "torchvision 0.29", "2.14", (3, 224, 224), 32),
    ]
    digests = {base.digest(), *(k.digest() for k in others)}
    assert len(digests) == 6
    assert base.digest() == ProgramKey(*vars(base).values()).digest()


def test_cli_torch_arguments() -> None:
    args = _parse(["torchvision:resnet50", "--backend", "torch", "--input-shape", "3,224,224"])
    assert (args.backend, args.model, args.input_shape) == (
        "torch",
        "torchvision:resnet50",
        (3, 224, 224),
    )
    with pytest.raises(SystemExit):
        _parse(["m", "--backend", "torch", "--input-shape", "3,x"])
    with pytest.raises(SystemExit):
        _parse(["m", "--backend", "onnx"])


def test_cli_torch_needs_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code = build_engine.run(_parse(["torchvision:resnet50", "--backend", "torch"]))
    err = capsys.readouterr().err
    if HAS_TORCH:
        assert code == 1 and "--input-shape or --config" in err
    else:
        assert code == 2 and "needs PyTorch" in err


def test_cli_without_torch_explains(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("torch", "torchvision"):  # imports fail as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    argv = ["torchvision:resnet50", "--backend", "torch", "--input-shape", "3,8,8"]
    code = build_engine.run(_parse([*argv, "--out-dir", str(tmp_path)]))
    assert code == 2 and "needs PyTorch" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@needs_torch
def test_export_caches_and_matches_the_module(
    factory_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from worker.compute.engines.torch import load_module

    out = tmp_path / "engines"
    argv = [f"{factory_file}:build", "--backend", "torch", "--input-shape", "3,12,12"]
    assert build_engine.run(_parse([*argv, "--max-batch", "16", "--out-dir", str(out)])) == 0
    path = Path(capsys.readouterr().out.splitlines()[-1])
    assert path.suffix == ".pt2" and path.with_suffix(".json").is_file()
    stamp = path.stat().st_mtime_ns
    # Same inputs: the cached file, untouched. Another batch range: another file.
    assert build_engine.run(_parse([*argv, "--max-batch", "16", "--out-dir", str(out)])) == 0
    assert (
        Path(capsys.readouterr().out.splitlines()[-1]) == path and path.stat().st_mtime_ns == stamp
    )
    assert build_engine.run(_parse([*argv, "--max-batch", "8", "--out-dir", str(out)])) == 0
    assert Path(capsys.readouterr().out.splitlines()[-1]) != path

    # The program runs every batch size 1..max (the dynamic batch) and computes
    # what the seeded module computes.
    torch.manual_seed(0)
    spec = importlib.util.spec_from_file_location("tiny_ref", factory_file)
    assert spec is not None and spec.loader is not None
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    model = ref.build().eval()
    program = load_module(torch, path, torch.device("cpu"))
    for rows in (1, 5, 16):
        x = torch.randn(rows, *SHAPE)
        with torch.no_grad():
            torch.testing.assert_close(program(x), model(x), rtol=1e-4, atol=1e-5)


@needs_torch
def test_a_factory_must_return_a_module(factory_file: Path, tmp_path: Path) -> None:
    from worker.ops.build_torch import build_torch_program

    with pytest.raises(ConfigError, match=r"not a torch\.nn\.Module"):
        build_torch_program(
            f"{factory_file}:not_a_module", tmp_path, max_batch_size=4, input_shape=SHAPE
        )
    with pytest.raises(ConfigError, match="could not export"):
        build_torch_program(
            f"{factory_file}:build", tmp_path, max_batch_size=4, input_shape=(1, 12, 12)
        )
    assert not list(tmp_path.glob("*.pt2"))


@needs_torch
@pytest.mark.parametrize("compile_mode", ["off", "default"])
def test_prepared_module_agrees_with_eager_on_every_bucket(
    factory_file: Path, tmp_path: Path, compile_mode: Any
) -> None:
    """What the engine runs (converted, channels_last, compiled) against the module
    as exported, on each bucket shape the warm-up visits."""
    import torch

    from worker.compute.engines.torch import compute_dtype, load_module, prepare_module
    from worker.ops.build_torch import build_torch_program

    path = build_torch_program(
        f"{factory_file}:build", tmp_path, max_batch_size=8, input_shape=SHAPE
    )
    reference = load_module(torch, path, torch.device("cpu"))
    cfg = TorchConfig(compile=compile_mode, precision="auto", channels_last=True)
    dtype = compute_dtype(torch, cfg, "float32")
    eager, run = prepare_module(
        torch, load_module(torch, path, torch.device("cpu")), cfg, dtype, max_shapes=12
    )
    assert (run is eager) == (compile_mode == "off")
    if compile_mode != "off":  # one compilation per bucket must fit dynamo's limit
        config = torch._dynamo.config
        limit = getattr(config, "recompile_limit", None) or config.cache_size_limit
        assert limit >= 13
    kernels = [p for p in eager.parameters() if p.dim() == 4]
    assert kernels and all(p.is_contiguous(memory_format=torch.channels_last) for p in kernels)
    for rows in reversed(bucket_sizes(8)):
        x = torch.randn(rows, *SHAPE)
        with torch.inference_mode():
            got = run(x.contiguous(memory_format=torch.channels_last))
            want = reference(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_torch
def test_precision_and_torchscript(tmp_path: Path) -> None:
    import torch

    from worker.compute.engines.torch import compute_dtype, prepare_module

    assert compute_dtype(torch, TorchConfig(), "float16") == torch.float16
    assert compute_dtype(torch, TorchConfig(precision="bfloat16"), "float32") == torch.bfloat16
    mlp = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(4, 3)).eval()
    _, run = prepare_module(torch, mlp, TorchConfig(), torch.bfloat16)
    assert next(mlp.parameters()).dtype == torch.bfloat16
    with torch.inference_mode():
        assert run(torch.ones(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    # TorchScript is not handed to dynamo: it runs as scripted.
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 3)).eval())
    eager, run = prepare_module(torch, scripted, TorchConfig(compile="default"), torch.float32)
    assert run is eager
