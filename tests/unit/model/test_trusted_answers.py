"""Start-up rules that keep answers the model's own (issue 26): a model input is a
tensor unless configured; image settings come from the model; padding only
where every returned output can be cut back; constants and inputs without a
batch dimension; batch axes and fixed batches read from the whole shapes."""

from __future__ import annotations

import numpy as np
import pytest
from structlog.testing import capture_logs

from worker.config import LimitsConfig, ModelConfig
from worker.config.model import ConstantInput, ImageInput, PreprocessConfig, TensorInput, TextInput
from worker.flow.errors import ConfigError
from worker.model.inputs import bind
from worker.model.inputs.binding import fit_limits
from worker.model.inputs.constant import BoundConstant
from worker.model.inputs.image import BoundImage
from worker.model.inputs.tensor import BoundTensor
from worker.model.io import ModelIO, TensorDesc, batched_io, dim

F32, I64 = np.dtype(np.float32), np.dtype(np.int64)
YOLO = ModelIO(
    (TensorDesc("images", F32, (3, "height", "width")),),
    (TensorDesc("output0", F32, (22, "floor(height/2 - 1/2)*(floor(width/2 - 1/2))")),),
)
LIMITS = LimitsConfig()


def test_a_detector_with_one_float_input_is_a_tensor_by_default() -> None:
    inputs = bind(ModelConfig(path="yolo.onnx"), YOLO, LIMITS)
    (kind,) = inputs.kinds
    assert isinstance(kind, BoundTensor) and kind.name == "images"
    # Its free spatial dimensions group rows by exact size: nothing is padded.
    assert inputs.symbols == {"height": ("images",), "width": ("images",)}
    assert inputs.padded_symbols == frozenset()


def test_the_image_shorthand_applies_where_the_configuration_asks_for_it() -> None:
    io = ModelIO((TensorDesc("x", F32, (3, 32, 32)),), (TensorDesc("logits", F32, (10,)),))
    assert isinstance(bind(ModelConfig(path="m.onnx"), io, LIMITS).kinds[0], BoundTensor)
    for cfg in (
        ModelConfig(path="m.onnx", input="photo"),
        ModelConfig(path="m.onnx", preprocess=PreprocessConfig(mean=(0.4,))),
    ):
        (kind,) = bind(cfg, io, LIMITS).kinds
        assert isinstance(kind, BoundImage)
        # Everything unset comes from the model: 32x32, 3 channels, NCHW, float32.
        assert (kind.cfg.size, kind.cfg.channels, kind.cfg.layout) == ((32, 32), 3, "NCHW")
        assert kind.cfg.dtype == "float32" and len(kind.cfg.mean) == 3


def test_image_settings_come_from_the_model_and_a_free_size_must_be_given() -> None:
    nhwc = ModelIO((TensorDesc("px", F32, (64, 48, 3)),), (TensorDesc("y", F32, (2,)),))
    (kind,) = bind(ModelConfig(inputs={"px": ImageInput()}), nhwc, LIMITS).kinds
    assert isinstance(kind, BoundImage)
    assert (kind.cfg.layout, kind.cfg.size, kind.cfg.channels) == ("NHWC", (64, 48), 3)
    free = ModelIO((TensorDesc("px", F32, (3, "h", "w")),), (TensorDesc("y", F32, (2,)),))
    with pytest.raises(ConfigError, match=r"model\.inputs\.px\.size: .*any height and width"):
        bind(ModelConfig(inputs={"px": ImageInput()}), free, LIMITS)
    (sized,) = bind(ModelConfig(inputs={"px": ImageInput(size=(40, 30))}), free, LIMITS).kinds
    assert isinstance(sized, BoundImage) and sized.produced_shape == (3, 40, 30)
    uint8 = ModelIO((TensorDesc("px", np.dtype(np.uint8), (8, 8, 3)),), nhwc.outputs)
    with pytest.raises(ConfigError, match=r"model\.inputs\.px: an image is normalised into"):
        bind(ModelConfig(inputs={"px": ImageInput()}), uint8, LIMITS)


def test_a_conflict_names_only_the_keys_the_configuration_set() -> None:
    io = ModelIO((TensorDesc("x", F32, (3, 32, 32)),), (TensorDesc("y", F32, (2,)),))
    with pytest.raises(ConfigError, match=r"^model\.preprocess\.channels: the model's input"):
        bind(ModelConfig(path="m.onnx", preprocess=PreprocessConfig(channels=1)), io, LIMITS)


def test_padding_is_refused_where_an_output_cannot_be_cut_back() -> None:
    io = ModelIO(
        (TensorDesc("x", F32, ("length",)),),
        (TensorDesc("half", F32, ("half",)), TensorDesc("score", F32, (1,))),
    )
    with pytest.raises(
        ConfigError,
        match=r"model\.inputs\.x\.pad: the output 'half' \(float32 \[half\]\) has a dimension "
        r"'half' that no input's dimension names, so a run padded on 'length'",
    ):
        bind(ModelConfig(inputs={"x": TensorInput(pad=True)}), io, LIMITS)
    # Leaving the output out makes padding safe again; without pad, equal lengths.
    only = bind(ModelConfig(outputs=("score",), inputs={"x": TensorInput(pad=True)}), io, LIMITS)
    assert only.padded_symbols == frozenset({"length"})
    assert bind(ModelConfig(), io, LIMITS).padded_symbols == frozenset()


def test_a_padded_dimension_shared_with_an_unpadded_input_is_refused() -> None:
    io = ModelIO(
        (TensorDesc("ids", I64, ("seq",)), TensorDesc("mask", I64, ("seq",))),
        (TensorDesc("y", F32, ("seq",)),),
    )
    with pytest.raises(ConfigError, match=r"ids\.pad: .*'seq' is shared with inputs\.mask"):
        bind(ModelConfig(inputs={"ids": TensorInput(pad=True)}), io, LIMITS)
    both = {"ids": TensorInput(pad=True), "mask": TensorInput(pad_value=0)}
    assert bind(ModelConfig(inputs=both), io, LIMITS).padded_symbols == frozenset({"seq"})


def test_a_text_model_with_an_untied_output_runs_equal_lengths_and_says_so() -> None:
    io = ModelIO(
        (TensorDesc("input_ids", I64, ("sequence",)), TensorDesc("attention_mask", I64,
                                                                 ("sequence",))),
        (TensorDesc("tokens", F32, ("unk__7", 4)),),
    )  # fmt: skip
    cfg = ModelConfig(inputs={"q": TextInput(tokenizer="builtin:sentiment", max_length=16)})
    with capture_logs() as logs:
        inputs = bind(cfg, io, LIMITS)
    assert inputs.padded_symbols == frozenset()
    (event,) = [e for e in logs if e["event"] == "padding_off"]
    assert event["output"] == "tokens" and event["dimensions"] == ["sequence"]
    tied = ModelIO(io.inputs, (TensorDesc("tokens", F32, ("sequence", 4)),))
    assert bind(cfg, tied, LIMITS).padded_symbols == frozenset({"sequence"})


def test_an_input_without_a_batch_dimension_needs_a_value() -> None:
    io = batched_io(
        [("audio", F32, ("batch", "samples")), ("sr", I64, ())],
        [("prob", F32, ("batch", 1))],
    )
    with pytest.raises(
        ConfigError, match=r"model\.inputs\.sr\.value: the model input 'sr' \(int64 \[\]\) has no"
    ):
        bind(ModelConfig(), io, LIMITS)
    inputs = bind(ModelConfig(inputs={"sr": ConstantInput(value=16000)}), io, LIMITS)  # type: ignore[arg-type]
    (constant,) = inputs.constants
    assert isinstance(constant, BoundConstant)
    assert constant.value.dtype == I64 and constant.value.shape == () and constant.value == 16000
    assert [k.name for k in inputs.kinds] == ["audio"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0.5, r"model\.inputs\.sr\.value: 0\.5 does not fit the int64 input 'sr'"),
        ((1, 2), r"model\.inputs\.sr\.value: a value of shape \[2\] does not fit"),
    ],
)
def test_a_constant_that_does_not_fit_is_refused(value: object, message: str) -> None:
    io = batched_io([("a", F32, ("b", 2)), ("sr", I64, ())], [("y", F32, ("b", 1))])
    with pytest.raises(ConfigError, match=message):
        bind(ModelConfig(inputs={"sr": ConstantInput(value=value)}), io, LIMITS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("inputs", "outputs", "axes", "out_axes", "batch"),
    [
        # A voice-activity detector: state batched on axis 1, the rate shared.
        ([("input", ("batch", "sequence")), ("state", (2, "batch", 128)), ("sr", ())],
         [("output", ("batch", 1)), ("stateN", ("AddstateN_dim_0", "batch", "d2"))],
         [0, 1, None], [0, 1], None),
        # Exporters that name the output's batch afresh (tf2onnx, paddle2onnx).
        ([("bytes", ("unk__214", 2048))], [("target", ("unk__215", 214))], [0], [0], None),
        # A fixed batch of 1, eight outputs.
        ([("image", (1, 3, 800, 608))], [("a", (1, 7600, 10)), ("b", (1, 130, 32))],
         [0], [0, 0], 1),
        # Unnamed dimensions: a fixed first dimension carries no batch.
        ([("input", (None, None)), ("state", (2, None, 128))], [("out", (None, 1))],
         [0, None], [0], None),
    ],
)  # fmt: skip
def test_batch_axes_are_read_from_the_whole_shapes(
    inputs: list, outputs: list, axes: list, out_axes: list, batch: int | None
) -> None:
    io = batched_io(
        [(n, F32, tuple(dim(d) for d in s)) for n, s in inputs],
        [(n, F32, tuple(dim(d) for d in s)) for n, s in outputs],
    )
    assert [t.batch_axis for t in io.inputs] == axes
    assert [t.batch_axis for t in io.outputs] == out_axes
    assert io.batch == batch


def test_placeholder_dimension_names_tie_nothing() -> None:
    # PaddleOCR's classifier writes '?' for both height and width, -1 for the batch.
    io = batched_io([("x", F32, (dim(-1), 3, dim("?"), dim("?")))], [("y", F32, (dim(-1), 2))])
    (x,) = io.inputs
    assert x.shape == (3, None, None) and x.symbols() == ("x[1]", "x[2]")


def test_limits_are_raised_to_one_row_of_a_large_fixed_input() -> None:
    big = ModelIO((TensorDesc("image", F32, (3, 800, 608)),), (TensorDesc("y", F32, (10,)),))
    limits = fit_limits(LIMITS, bind(ModelConfig(path="layout.onnx"), big, LIMITS))
    assert limits.max_tensor_bytes == 3 * 800 * 608 * 4  # 5.8 MB, past the 4 MiB default
    assert limits.max_record_bytes >= limits.max_tensor_bytes
    small = bind(ModelConfig(path="m.onnx"), YOLO, LIMITS)  # free dimensions: bounded as set
    assert fit_limits(LIMITS, small) == LIMITS
