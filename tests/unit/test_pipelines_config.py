"""``[pipelines.NAME]``: a pipeline's shape refused as the settings load, and its
tensors refused once its models load, before Kafka is contacted; each refusal
names the step and the tensor (exit 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.wakeword import wakeword_toml
from worker.app.worker import Worker
from worker.config import Settings, load_settings
from worker.flow.errors import ConfigError

KAFKA = """
[kafka]
bootstrap_servers = "127.0.0.1:1"  # nothing listens: every refusal comes first
input_topics = ["audio"]
"""


def _load(tmp_path: Path, frames: str = "float32 [76, 32, 1]", source: str = "window.frames",
          extra: str = "") -> Settings:  # fmt: skip
    path = tmp_path / "worker.toml"
    path.write_text(KAFKA + wakeword_toml("audio", frames=frames, source=source) + extra)
    return load_settings(path, env={})


def test_a_pipeline_s_models_need_no_topics_of_their_own(tmp_path: Path) -> None:
    s = _load(tmp_path)
    assert [step.name for step in s.pipelines["wakeword"].steps] == ["mel", "window", "embed"]


@pytest.mark.parametrize(
    ("source", "extra", "message"),
    [
        ("mel.output", "", None),  # a tensor of the wrong shape: refused at start-up, below
        ("later.frames", "", "pipelines.wakeword.steps[2].inputs.input_1: 'later.frames': "
                             "'later' is not an earlier step (the steps before it: mel, window)"),
        ("frames", "", "pipelines.wakeword.steps[2].inputs.input_1: 'frames': expected "
                       "request.NAME or STEP.OUTPUT"),
        ("window.frames", '\n[pipelines.other]\ntopics = ["audio"]\noutputs = { x = "m.output" }'
         '\n[[pipelines.other.steps]]\nname = "m"\nmodel = "melspec"\n',
         "pipelines.other.topics: 'audio' is also pipelines.wakeword's: a topic belongs to one "
         "model or pipeline"),
        ("window.frames", '\n[pipelines.melspec]\ntopics = []\n',
         "pipelines.melspec: 'melspec' is also a model's name"),
        ("window.frames", '\n[pipelines.bad]\ntopics = ["audio"]\noutputs = { x = "m.output" }'
         '\n[[pipelines.bad.steps]]\nname = "m"\nmodel = "translator"\n',
         "pipelines.bad.steps[0].model: 'translator' is not a model this worker serves "
         "(melspec, embedding)"),
    ],
)  # fmt: skip
def test_a_wrong_shape_is_refused_as_the_settings_load(
    tmp_path: Path, source: str, extra: str, message: str | None
) -> None:
    if message is None:
        _load(tmp_path, source=source, extra=extra)
        return
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, source=source, extra=extra)
    assert message in str(refused.value)


def test_a_function_step_declares_its_outputs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pipelines\.wakeword\.steps\[1\]\.outputs\.frames: "
                                          r"'float32 76': expected a dtype and a shape"):
        _load(tmp_path, frames="float32 76")


@pytest.mark.parametrize(
    ("frames", "source", "message"),
    [
        ("float32 [75, 32, 1]", "window.frames",
         "pipelines.wakeword.steps[2].inputs.input_1: 'window.frames' is float32 [75, 32, 1], "
         "the model takes float32 [76, 32, 1]"),
        ("float16 [76, 32, 1]", "window.frames",
         "'window.frames' is float16 [76, 32, 1], the model takes float32 [76, 32, 1]"),
        ("float32 [76, 32, 1]", "mel.output",
         "pipelines.wakeword.steps[2].inputs.input_1: 'mel.output' is float32 [1, "
         "Clipoutput_dim_2, 32], the model takes float32 [76, 32, 1]"),
        ("float32 [76, 32, 1]", "mel.outputs",
         "pipelines.wakeword.steps[2].inputs.input_1: 'mel.outputs' does not exist; step "
         "'mel''s outputs: output"),
    ],
)  # fmt: skip
async def test_a_mismatched_tensor_stops_start_up_naming_step_and_tensor(
    tmp_path: Path, frames: str, source: str, message: str
) -> None:
    worker = Worker(_load(tmp_path, frames=frames, source=source))
    with pytest.raises(ConfigError) as refused:
        await worker.start()
    assert message in str(refused.value)


def test_the_steps_deadline_shares_add_up_to_one_at_most(tmp_path: Path) -> None:
    s = _load(tmp_path)
    assert [step.deadline_share for step in s.pipelines["wakeword"].steps] == [0.0, 0.0, 0.0]
    env = {"INFER_WORKER_PIPELINES__WAKEWORD__STEPS": '[{name = "mel", model = "melspec", '
           'deadline_share = 0.7}, {name = "m2", model = "melspec", deadline_share = 0.5}]',
           "INFER_WORKER_PIPELINES__WAKEWORD__OUTPUTS": '{mel = "mel.output"}'}  # fmt: skip
    path = tmp_path / "worker.toml"
    with pytest.raises(ConfigError, match=r"pipelines\.wakeword\.steps: deadline_share: each 0 "
                                          r"to 1, together at most 1, got \[0\.7, 0\.5\]"):
        load_settings(path, env=env)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ('[{name = "mel", model = "melspec", fan_out = true}]',
         "pipelines.wakeword.steps[0].fan_out: a function step fans out"),
        ('[{name = "mel", model = "melspec", vectorized = true}]',
         "pipelines.wakeword.steps[0].vectorized: a model step runs its rows as a batch"),
        ('[{name = "mel", model = "melspec"}, {name = "w", function = "m:f", fan_out = true, '
         'vectorized = true, inputs = {x = "mel.output"}, outputs = {y = "float32 [2]"}}]',
         "pipelines.wakeword.steps[1].vectorized: a vectorized function returns a row per row"),
    ],
)  # fmt: skip
def test_a_fan_out_is_a_function_s(
    tmp_path: Path, steps: str, message: str
) -> None:
    env = {"INFER_WORKER_PIPELINES__WAKEWORD__STEPS": steps,
           "INFER_WORKER_PIPELINES__WAKEWORD__OUTPUTS": '{mel = "mel.output"}'}  # fmt: skip
    _load(tmp_path)  # writes the file
    with pytest.raises(ConfigError) as refused:
        load_settings(tmp_path / "worker.toml", env=env)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ('{name = "c", op = "crop_boxes", size = [8, 8], inputs = {image = "request.input"}}',
         "pipelines.wakeword.steps[1].inputs: crop_boxes takes image, boxes, got image"),
        ('{name = "c", op = "crop_boxes", size = [8], inputs = {image = "mel.output", '
         'boxes = "mel.output"}}', "pipelines.wakeword.steps[1].size: [8]: the crops' height"),
        ('{name = "c", op = "rotate", size = [8, 8], inputs = {image = "request.input", '
         'boxes = "mel.output"}}', "pipelines.wakeword.steps[1].op: 'rotate' is not a built-in "
         "operation (crop_boxes, nms, resize)"),
        ('{name = "c", op = "crop_boxes", size = [8, 8], iou_threshold = 0.3, inputs = {image '
         '= "mel.output", boxes = "mel.output"}}', "pipelines.wakeword.steps[1].iou_threshold: "
         "crop_boxes does not read it (it reads size)"),
        ('{name = "c", op = "crop_boxes", size = [8, 8], inputs = {image = "mel.output", '
         'boxes = "mel.output"}}', "pipelines.wakeword.steps[1].inputs.image: 'mel.output' is "
         "float32 [1, Clipoutput_dim_2, 32]: crop_boxes takes uint8 pixels"),
    ],
)  # fmt: skip
async def test_an_operation_is_checked_once_the_models_load(
    tmp_path: Path, step: str, message: str
) -> None:
    """An operation's inputs and settings, from the registry (worker.compute.ops):
    refused before Kafka is contacted, by run and config alike (Worker.prepare).
    (The embedding step after it keeps that model the pipeline's.)"""
    env = {"INFER_WORKER_PIPELINES__WAKEWORD__STEPS": f'[{{name = "mel", model = "melspec"}}, '
           f'{step}, {{name = "e", model = "embedding"}}]',
           "INFER_WORKER_PIPELINES__WAKEWORD__OUTPUTS": '{mel = "mel.output"}'}
    _load(tmp_path)  # writes the file
    worker = Worker(load_settings(tmp_path / "worker.toml", env=env))
    with pytest.raises(ConfigError) as refused:
        await worker.prepare()
    await worker.stop()
    assert message in str(refused.value)


def test_a_step_is_one_of_model_function_or_operation(tmp_path: Path) -> None:
    step = '{name = "c", op = "crop_boxes", model = "melspec", size = [8, 8]}'
    env = {"INFER_WORKER_PIPELINES__WAKEWORD__STEPS": f'[{{name = "mel", model = "melspec"}}, '
           f'{step}]', "INFER_WORKER_PIPELINES__WAKEWORD__OUTPUTS": '{mel = "mel.output"}'}
    _load(tmp_path)  # writes the file
    with pytest.raises(ConfigError) as refused:
        load_settings(tmp_path / "worker.toml", env=env)
    message = "a step is a model (model = ...), a function (function = ...) or an operation"
    assert message in str(refused.value)


def test_a_model_step_s_top_k_is_described_as_it_is_answered() -> None:
    """top_k over an output of fewer columns answers that many (the stage clamps
    it): a pipeline's later steps and its card are told the same (they were told
    top_k, 5 here, where the model answers 2)."""
    from typing import cast

    from worker.app.pipelines import answer_outputs
    from worker.compute.engines import Engine, load_engine
    from worker.config import BatchingConfig, LimitsConfig, ModelConfig, PostprocessConfig
    from worker.model.inputs import bind_model
    from worker.model.postprocess import top_k

    cfg = ModelConfig(path="builtin:sentiment", postprocess=PostprocessConfig(top_k=5))
    engine = cast(Engine, load_engine(cfg))
    try:
        binding = bind_model(cfg, engine.info.io, LimitsConfig(), BatchingConfig())
    finally:
        engine.close()
    described = answer_outputs(binding)
    assert described["topk_indices"] == ("int64", (2,))
    assert top_k(np.zeros((1, 2), np.float32), 5)[0].shape == (1, 2)  # as the stage answers
