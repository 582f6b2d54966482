"""The torch engine on CPU torch, through a slot made of host arrays (no stream, no
CUDA graphs): loading an exported program with two inputs and a dynamic
sequence, its description, precision (a model whose forward calls ``.float()``
included), compilation, warming every shape of the slot, padding and the
outputs written densely per run, equal to the module run eagerly on each
request alone. After the warm-up nothing recompiles (dynamo's
``error_on_recompile``), so a guard that would miss on live traffic fails here.

torch is not installed in CI (a CUDA build of several GB; see README,
Development): these tests run wherever it is (``pip install -e '.[torch]'``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.compute.gpu.plan import slot_shapes
from worker.config import LimitsConfig, ModelConfig, TorchConfig
from worker.config.model import TensorInput
from worker.model.inputs import bind
from worker.model.shapes import SlotShapes, dense

pytestmark = pytest.mark.usefixtures("torch_installed")

VOCAB, WIDTH, MAX_LEN = 40, 8, 16

RANKER = """
import torch


class Ranker(torch.nn.Module):
    '''Two inputs (a feature row and token ids), a score and per-token scores.
    The ``.float()`` casts are what export fixes in the graph: they break a
    conversion of the weights to bfloat16 (the engine falls back to autocast).'''

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 8, padding_idx=0)
        self.dense = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, features, ids):
        mask = (ids != 0).unsqueeze(-1).float()
        tokens = self.emb(ids) * mask
        pooled = tokens.sum(1) + self.dense(features)
        return {"score": self.out(pooled).float(), "token_scores": self.out(tokens).squeeze(-1)}
"""


def export(tmp_path: Path) -> tuple[Path, Any]:
    import torch

    spec = importlib.util.spec_from_file_location("ranker_src", _write(tmp_path, RANKER))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.Ranker().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("sequence", min=1, max=MAX_LEN)
    example = (torch.randn(3, 4), torch.randint(1, VOCAB, (3, 5)))
    program = torch.export.export(
        model, example, dynamic_shapes={"features": {0: batch}, "ids": {0: batch, 1: seq}}
    )
    path = tmp_path / "ranker.pt2"
    torch.export.save(program, str(path))
    return path, model


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ranker_src.py"
    path.write_text(text)
    return path


@dataclass
class HostSlot:
    """What an engine sees of a slot, in host memory (``EngineSlot``)."""

    index: int
    engine_inputs: dict[str, np.ndarray]
    engine_outputs: dict[str, np.ndarray]
    device: int = 0
    stream: Any = None
    context: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def host_slot(engine: Any, rows: int) -> HostSlot:
    return HostSlot(
        0,
        {s.name: np.zeros((rows, *s.shape), s.dtype) for s in engine.inputs},
        {s.name: np.zeros((rows, *s.shape), s.dtype) for s in engine.outputs},
    )


def make_engine(path: Path, precision: str = "float32", compile_mode: str = "default") -> Any:
    from worker.compute.engines.torch import TorchEngine

    cfg = ModelConfig(
        path=str(path),
        backend="torch",
        torch=TorchConfig(compile=compile_mode, precision=precision, cuda_graphs=False),  # type: ignore[arg-type]
    )
    return TorchEngine(path, cfg, device="cpu", max_batch_size=8), cfg


@pytest.mark.parametrize(
    ("precision", "compile_mode", "rtol"),
    [("float32", "default", 1e-5), ("bfloat16", "off", 3e-2), ("bfloat16", "default", 3e-2)],
)
def test_a_two_input_program_runs_through_a_host_slot(
    tmp_path: Path, precision: str, compile_mode: str, rtol: float
) -> None:
    import torch

    path, model = export(tmp_path)
    engine, cfg = make_engine(path, precision, compile_mode)
    io = engine.info.io
    assert [t.name for t in io.inputs] == ["features", "ids"]
    assert [t.name for t in io.outputs] == ["score", "token_scores"]
    seq = io.inputs[1].shape[0]
    assert isinstance(seq, str) and io.outputs[1].shape == (seq,)  # the symbol is shared
    cfg = ModelConfig(**{**cfg.__dict__, "inputs": {"ids": TensorInput(max_length=MAX_LEN)}})
    inputs = bind(cfg, io, LimitsConfig())
    shapes = slot_shapes(inputs, 8, length_buckets=(4, 8))
    assert shapes == SlotShapes((1, 2, 4, 8), ((seq, (4, 8, MAX_LEN)),))
    engine.prepare(shapes)
    slot = host_slot(engine, 8)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    slot.context = engine.create_context(slot)  # warms all 12 shapes
    if compile_mode != "off":  # one compilation for the buckets, one for batch 1
        assert counters["stats"]["unique_graphs"] == 2
    rng = np.random.default_rng(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        # (3, 5) and (2, 11): lengths no bucket has, as rows of one exact length run
        # where the dimension is not padded: no recompilation, uncaptured.
        for n, length in [(3, 4), (8, 16), (1, 8), (5, 16), (2, 4), (3, 5), (2, 11)]:
            features = rng.normal(size=(n, 4)).astype(np.float32)
            ids = np.zeros((n, length), np.int64)
            lengths = rng.integers(1, length + 1, n)
            for i, k in enumerate(lengths):
                ids[i, :k] = rng.integers(1, VOCAB, k)
            dense(slot.engine_inputs["features"], n, (4,))[:] = features
            dense(slot.engine_inputs["ids"], n, (length,))[:] = ids
            out = engine.enqueue(slot, n, {seq: length})
            assert out == {"score": (1,), "token_scores": (length,)}
            scores = dense(slot.engine_outputs["score"], n, (1,))
            tokens = dense(slot.engine_outputs["token_scores"], n, (length,))
            for i, k in enumerate(lengths):  # each request alone, unpadded
                with torch.no_grad():
                    want = model(torch.from_numpy(features[i : i + 1]),
                                 torch.from_numpy(ids[i : i + 1, :k]))  # fmt: skip
                np.testing.assert_allclose(scores[i], want["score"][0].numpy(), rtol=rtol,
                                           atol=rtol)  # fmt: skip
                np.testing.assert_allclose(tokens[i, :k], want["token_scores"][0].numpy(),
                                           rtol=rtol, atol=rtol)  # fmt: skip
    engine.close()


def test_precision_falls_back_to_autocast_for_a_program_that_casts_itself(
    tmp_path: Path,
) -> None:
    path, _ = export(tmp_path)
    engine, _ = make_engine(path, "bfloat16", "off")
    assert engine._autocast  # converted weights fail on the program's own .float()
    engine.close()


CNN = """
import torch


class Cnn(torch.nn.Module):
    '''A small image classifier: convolutions, batch norm, pooling, a linear head.'''

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.head = torch.nn.Linear(16, 10)

    def forward(self, image):
        return self.head(self.features(image).flatten(1))
"""


def cnn(tmp_path: Path) -> tuple[Any, tuple[Any, ...]]:
    """The small classifier with seeded weights, and an example batch."""
    import torch

    src = tmp_path / "cnn_src.py"
    src.write_text(CNN)
    spec = importlib.util.spec_from_file_location("cnn_src", src)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.Cnn().eval()
    with torch.no_grad():  # batch norm statistics that are not the identity
        model.features[1].running_mean.uniform_(-0.5, 0.5)
        model.features[1].running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 16, 16),)


def export_cnn(model: Any, example: tuple[Any, ...], tmp_path: Path) -> Path:
    import torch

    batch = torch.export.Dim("batch", min=1, max=64)
    pt2 = tmp_path / "cnn.pt2"
    torch.export.save(torch.export.export(model, example, dynamic_shapes=({0: batch},)), str(pt2))
    return pt2


def test_an_image_model_in_channels_last_answers_as_onnx_runtime_does(tmp_path: Path) -> None:
    """The same weights exported twice, as a .pt2 for the torch engine (channels_last,
    compiled, every batch bucket warmed) and as ONNX for ONNX Runtime: each padded
    batch's logits equal ONNX Runtime's on the same pixels."""
    import onnxruntime as ort
    import torch

    model, example = cnn(tmp_path)
    pt2 = export_cnn(model, example, tmp_path)
    onnx_path = tmp_path / "cnn.onnx"
    torch.onnx.export(model, example, str(onnx_path), input_names=["image"],
                      output_names=["logits"], dynamic_axes={"image": {0: "batch"}},
                      dynamo=False)  # fmt: skip
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])

    from worker.compute.engines.torch import TorchEngine

    torch_cfg = TorchConfig(precision="float32", channels_last=True, cuda_graphs=False)
    cfg = ModelConfig(path=str(pt2), backend="torch", torch=torch_cfg)
    engine = TorchEngine(pt2, cfg, device="cpu", max_batch_size=8)
    (image,) = engine.inputs
    assert image.shape == (3, 16, 16)
    convs = [w for w in engine._eager.parameters() if w.dim() == 4]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    engine.prepare(SlotShapes((1, 2, 4, 8)))
    slot = host_slot(engine, 8)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    slot.context = engine.create_context(slot)
    # Compiled twice in the warm-up: dynamic in the batch from the first bucket (8:
    # its mark survives the cast to channels_last), and the size-1 specialisation.
    assert counters["stats"]["unique_graphs"] == 2
    rng = np.random.default_rng(1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (3, 8, 1, 6):  # 3 and 6 run padded to the buckets 4 and 8
            pixels = rng.normal(size=(n, 3, 16, 16)).astype(np.float32)
            dense(slot.engine_inputs[image.name], n, (3, 16, 16))[:] = pixels
            shapes = engine.enqueue(slot, n, {})
            (out,) = engine.outputs
            got = dense(slot.engine_outputs[out.name], n, shapes[out.name])
            (want,) = session.run(None, {"image": pixels})
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    engine.close()


@pytest.mark.parametrize("form", ["torchscript", "pt2-bfloat16"])
def test_an_image_model_loads_in_channels_last_in_every_form(tmp_path: Path, form: str) -> None:
    """Loading runs the module once before the first slot (a TorchScript file's
    outputs are probed; a converted program is checked to run at all): with
    channels_last on, for an image model as a TorchScript file and as a bfloat16
    program, which then answers close to the module in float32."""
    import torch

    from worker.compute.engines.torch import TorchEngine
    from worker.config import PreprocessConfig

    model, example = cnn(tmp_path)
    if form == "torchscript":
        path = tmp_path / "cnn.pt"
        torch.jit.save(torch.jit.trace(model, example), str(path))
        precision, rtol = "float32", 1e-4
    else:
        path = export_cnn(model, example, tmp_path)
        precision, rtol = "bfloat16", 5e-2
    torch_cfg = TorchConfig(precision=precision, channels_last=True, cuda_graphs=False)  # type: ignore[arg-type]
    pp = PreprocessConfig(size=(16, 16), channels=3, mean=(0.0,) * 3, std=(1.0,) * 3)
    cfg = ModelConfig(path=str(path), backend="torch", torch=torch_cfg, preprocess=pp)
    engine = TorchEngine(path, cfg, device="cpu", max_batch_size=4)
    assert not engine._autocast  # the program converts: no fallback was needed
    (image,) = engine.inputs
    engine.prepare(SlotShapes((1, 2, 4)))
    slot = host_slot(engine, 4)
    slot.context = engine.create_context(slot)
    pixels = np.random.default_rng(2).normal(size=(3, 3, 16, 16)).astype(np.float32)
    dense(slot.engine_inputs[image.name], 3, (3, 16, 16))[:] = pixels
    shapes = engine.enqueue(slot, 3, {})
    (out,) = engine.outputs
    with torch.no_grad():
        want = model(torch.from_numpy(pixels)).numpy()
    got = dense(slot.engine_outputs[out.name], 3, shapes[out.name]).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    engine.close()
