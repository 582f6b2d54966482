"""Binding request inputs to model inputs at start-up: the rules, and the
refusals that name the setting (exit 2 before any record is read)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.models import model_inputs
from worker.config import LimitsConfig, ModelConfig, load_settings
from worker.config.model import ImageInput, TensorInput, TextInput
from worker.flow.errors import ConfigError
from worker.model.inputs import bind, is_classifier
from worker.model.inputs.image import BoundImage
from worker.model.inputs.tensor import BoundTensor
from worker.model.inputs.text import BoundText
from worker.model.io import ModelIO, TensorDesc

F32, I64 = np.dtype(np.float32), np.dtype(np.int64)
BERT = ModelIO(
    (
        TensorDesc("input_ids", I64, ("sequence",)),
        TensorDesc("attention_mask", I64, ("sequence",)),
        TensorDesc("token_type_ids", I64, ("sequence",)),
    ),
    (TensorDesc("last_hidden_state", F32, ("sequence", 8)),),
)
RANKER = ModelIO(
    (TensorDesc("features", F32, (4,)), TensorDesc("ids", I64, ("sequence",))),
    (TensorDesc("score", F32, (1,)), TensorDesc("token_scores", F32, ("sequence",))),
)
TOKENIZER = "builtin:sentiment"


def test_the_digits_model_binds_through_the_classifier_shorthand() -> None:
    inputs = model_inputs()
    (kind,) = inputs.kinds
    assert isinstance(kind, BoundImage) and kind.name == "image"
    assert kind.desc.name == "image" and kind.desc.shape == (1, 8, 8)
    assert is_classifier(inputs) and inputs.padded_symbols == frozenset()


def test_a_model_of_plain_tensors_needs_no_input_settings() -> None:
    inputs = bind(ModelConfig(), RANKER, LimitsConfig())
    assert [(k.name, type(k)) for k in inputs.kinds] == [
        ("features", BoundTensor),
        ("ids", BoundTensor),
    ]
    assert not is_classifier(inputs)
    assert inputs.symbols == {"sequence": ("ids",)}


def test_a_text_input_feeds_ids_mask_and_type_ids_when_the_model_has_them() -> None:
    cfg = ModelConfig(inputs={"query": TextInput(tokenizer=TOKENIZER, max_length=16)})
    inputs = bind(cfg, BERT, LimitsConfig())
    (kind,) = inputs.kinds
    assert isinstance(kind, BoundText)
    assert [f.name for f in kind.feeds] == ["input_ids", "attention_mask", "token_type_ids"]
    two = ModelIO(BERT.inputs[:2], BERT.outputs)
    assert [f.name for f in bind(cfg, two, LimitsConfig()).kinds[0].feeds] == [
        "input_ids",
        "attention_mask",
    ]


def test_an_image_entry_names_its_feed_and_keeps_its_preprocessing() -> None:
    io = ModelIO(
        (TensorDesc("pixel_values", F32, (3, 4, 4)), TensorDesc("features", F32, (4,))),
        (TensorDesc("logits", F32, (2,)),),
    )
    photo = ImageInput(size=(4, 4), channels=3, mean=(0.5,) * 3, std=(0.5,) * 3,
                       feed="pixel_values")  # fmt: skip
    inputs = bind(ModelConfig(inputs={"photo": photo}), io, LimitsConfig())
    assert [(k.name, type(k)) for k in inputs.kinds] == [
        ("photo", BoundImage),
        ("features", BoundTensor),
    ]
    # The shorthand also takes the one image-shaped input next to tensors.
    three = ImageInput(size=(4, 4), channels=3, mean=(0.5,) * 3, std=(0.5,) * 3)
    short = bind(ModelConfig(input="photo", preprocess=three), io, LimitsConfig())
    assert [k.name for k in short.kinds] == ["photo", "features"]


@pytest.mark.parametrize(
    ("cfg", "io", "message"),
    [
        (
            ModelConfig(inputs={"x": TensorInput(feed="nope")}),
            RANKER,
            r"model\.inputs\.x\.feed: the model has no input 'nope' \(its inputs: features, ids\)",
        ),
        (
            ModelConfig(inputs={"feats": TensorInput()}),
            RANKER,
            r"model\.inputs\.feats: the model has no input 'feats'.*set feed",
        ),
        (
            ModelConfig(inputs={"a": TensorInput(feed="ids"), "b": TensorInput(feed="ids")}),
            RANKER,
            r"model\.inputs\.b: the model input 'ids' is already fed by request input 'a'",
        ),
        (
            ModelConfig(inputs={"q": TextInput(tokenizer=TOKENIZER, ids="tokens")}),
            BERT,
            r"model\.inputs\.q\.ids: the model has no input 'tokens'",
        ),
        (
            ModelConfig(inputs={"q": TextInput(tokenizer=TOKENIZER)}),
            RANKER,
            r"model\.inputs\.q\.ids: the model has no input 'input_ids'",
        ),
        (
            ModelConfig(inputs={"q": TextInput(tokenizer="/no/such/tokenizer.json")}),
            BERT,
            r"model\.inputs\.q\.tokenizer: /no/such/tokenizer\.json is not a file",
        ),
        (
            ModelConfig(inputs={"q": TextInput(tokenizer=TOKENIZER, ids="features")}),
            RANKER,
            r"the model input 'features' is float32 \[4\]; a text feeds integer inputs",
        ),
        (
            ModelConfig(),
            ModelIO((TensorDesc("x", np.dtype(np.uint64), (2,)),), RANKER.outputs),
            r"model\.inputs\.x: the model input 'x' is uint64, which the wire contract cannot",
        ),
        (
            ModelConfig(preprocess=ImageInput(size=(8, 8))),
            ModelIO((TensorDesc("image", F32, (3, 224, 224)),), RANKER.outputs),
            r"model\.preprocess\.size: the model's input 'image' takes \[batch, 3, 224, 224\]",
        ),
        (
            ModelConfig(preprocess=ImageInput(dtype="float16")),
            ModelIO((TensorDesc("image", F32, (1, 8, 8)),), RANKER.outputs),
            r"model\.preprocess\.dtype: the model's input 'image' is float32",
        ),
    ],
)
def test_bad_bindings_stop_start_up_naming_the_setting(
    cfg: ModelConfig, io: ModelIO, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        bind(cfg, io, LimitsConfig())


def test_a_fixed_length_text_model_must_fit_max_length() -> None:
    io = ModelIO((TensorDesc("input_ids", I64, (8,)),), BERT.outputs)
    with pytest.raises(ConfigError, match=r"max_length: 16 tokens do not fit.*at most 8"):
        bind(ModelConfig(inputs={"q": TextInput(tokenizer=TOKENIZER, max_length=16)}), io,
             LimitsConfig())  # fmt: skip
    ok = bind(ModelConfig(inputs={"q": TextInput(tokenizer=TOKENIZER, max_length=8)}), io,
              LimitsConfig())  # fmt: skip
    assert ok.padded_symbols == frozenset()  # a fixed length: nothing per request


def test_inputs_from_the_config_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text(
        '[model]\npath = "m.onnx"\n'
        '[model.inputs.query]\nkind = "text"\ntokenizer = "tok.json"\nmax_length = 32\n'
        "[model.inputs.features]\npad_value = -1.0\n"
    )
    s = load_settings(path, env={"INFER_WORKER_MODEL__INPUTS__QUERY__MAX_LENGTH": "64"})
    assert s.model.inputs["query"] == TextInput(tokenizer="tok.json", max_length=64)
    assert s.model.inputs["features"] == TensorInput(pad_value=-1.0)
    assert s.model.name == "m"  # derived from the file's name
    path.write_text('[model.inputs.query]\nkind = "txt"\n')
    with pytest.raises(ConfigError, match=r"model\.inputs\.query\.kind: 'txt' is not one of"):
        load_settings(path, env={})
    path.write_text('[model.inputs.query]\nkind = "tensor"\ntokenizer = "t.json"\n')
    with pytest.raises(ConfigError, match=r"unknown key model\.inputs\.query\.tokenizer"):
        load_settings(path, env={})
    path.write_text('[model.inputs.photo]\nkind = "image"\nchannels = 2\n')
    with pytest.raises(ConfigError, match=r"model\.inputs\.photo\.channels: must be 1, 3 or 4"):
        load_settings(path, env={})


def test_postprocessing_defaults_follow_the_model() -> None:
    pp = ModelConfig().postprocess
    assert (pp.softmax, pp.top_k) == (None, None)
    assert pp.resolved(classifier=True).softmax is True
    assert pp.resolved(classifier=True).top_k == 3
    assert (pp.resolved(classifier=False).softmax, pp.resolved(classifier=False).top_k) == (
        False,
        0,
    )
