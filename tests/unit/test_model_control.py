"""The control topic's records as the worker reads them (``worker.app.control``):
a desired version from JSON, and the records it refuses, each named and
counted (``infer_model_swaps_total{outcome="refused"}``), the worker going on."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.onnx_models import tabular
from worker.app.control import Control
from worker.app.desired import Desired, carried, desired_state
from worker.app.stages import Stages
from worker.app.worker import Worker
from worker.config import KafkaConfig, Settings, load_settings
from worker.obs import metrics


@pytest.mark.parametrize(("value", "version"), [(b'{"version": 3}', 3), (b"", None), (None, None)])
def test_a_record_names_a_version_or_is_a_tombstone(value: bytes | None, version: int | None
                                                    ) -> None:  # fmt: skip
    assert desired_state(value) == Desired(version)


@pytest.mark.parametrize(
    ("value", "problem"),
    [(b"3", "expected {\"version\": N}"), (b'{"version": 0}', "a positive integer"),
     (b'{"version": true}', "expected"), (b'{"v": 3}', "expected"), (b"\xff", "not JSON")],
)  # fmt: skip
def test_a_value_that_is_not_a_desired_version_is_refused_saying_why(value: bytes, problem: str
                                                                      ) -> None:  # fmt: skip
    with pytest.raises(ValueError, match=problem.replace("{", r"\{").replace("}", r"\}")):
        desired_state(value)


def test_a_record_may_set_settings_over_the_version_s_model_toml() -> None:
    value = b'{"version": 2, "settings": {"outputs": ["score"], "intra_op_threads": 2}}'
    desired = desired_state(value)
    assert desired == Desired(2, {"outputs": ["score"], "intra_op_threads": 2})
    assert desired.value() == {"version": 2, "settings": {"outputs": ["score"],
                                                          "intra_op_threads": 2}}  # fmt: skip
    assert Desired(2).value() == {"version": 2} and Desired(None).value() is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [(b'{"version": 2, "settings": {"state_topic": "x"}}', "settings.state_topic: not settable"),
     (b'{"version": 2, "settings": {"backend": "torch"}}', "settings.backend: not settable"),
     (b'{"version": 2, "settings": ["outputs"]}', "settings: expected a table"),
     (b'{"version": 2, "topics": ["x"]}', "holds version and settings only")],
)  # fmt: skip
def test_settings_a_record_may_not_set_are_refused_naming_them(value: bytes, problem: str
                                                               ) -> None:  # fmt: skip
    with pytest.raises(ValueError, match=problem):
        desired_state(value)


async def test_records_for_models_it_may_not_set_are_refused_and_counted() -> None:
    s = Settings(kafka=KafkaConfig(input_topics=["in"]))
    control = Control(s, {}, {"fixed": "a configured model: its version is its file's"})
    refused = metrics.MODEL_SWAPS.labels(outcome="refused")
    before = refused._value.get()
    await control.apply("fixed", b'{"version": 2}')  # a configured model
    await control.apply("ghost", b'{"version": 2}')  # not served here
    await control.apply("fixed", b"not json")
    assert refused._value.get() == before + 3


@contextlib.asynccontextmanager
async def _prepared(repo: Path, **env: str) -> AsyncIterator[tuple[Control, Stages]]:
    """The worker over ``repo`` with a control topic, built as ``run`` builds it
    (``Worker.prepare``: no Kafka): its control topic's side and its stages."""
    worker = Worker(load_settings(env={"INFER_WORKER_REPOSITORY__PATH": str(repo),
                                       "INFER_WORKER_KAFKA__CONTROL_TOPIC": "models.control",
                                       **env}))  # fmt: skip
    stages = await worker.prepare()
    try:
        assert worker._control is not None
        yield worker._control, stages
    finally:
        await worker.stop()


# Only version 1 served at start-up (the others a record names).
FIRST = {"INFER_WORKER_REPOSITORY__VERSION_POLICY": "specific",
         "INFER_WORKER_REPOSITORY__VERSIONS": "[1]"}  # fmt: skip


async def test_a_version_that_fails_to_load_is_reported_in_the_index(tmp_path: Path) -> None:
    """A load that fails is reported where an operator looks (the OIP index's
    status says why) while the serving version goes on."""
    repo = tmp_path / "models"
    (repo / "scorer" / "1").mkdir(parents=True)
    tabular(repo / "scorer" / "1" / "model.onnx")
    (repo / "scorer" / "2").mkdir(parents=True)
    (repo / "scorer" / "2" / "model.onnx").write_bytes(b"not a model")
    async with _prepared(repo, **FIRST) as (control, _):
        assert await control.apply("scorer", b'{"version": 2}') is False
        index = {v["version"]: v for v in control.index()}
        assert index["2"]["state"] == "UNAVAILABLE"
        assert index["2"]["reason"].startswith("refused: cannot load"), index["2"]
        assert "version 1 serves" in index["2"]["reason"]
        assert index["1"]["reason"] == ""  # still the one serving
        assert await control.apply("scorer", b'{"version": 1}') is True


async def test_a_record_s_settings_are_swapped_in_over_the_same_file(tmp_path: Path) -> None:
    """The same version with other settings (an output added) is swapped in as a
    new version would be; settings that do not build or drop an output the
    serving one returns are refused naming why, and the serving one goes on."""
    repo = tmp_path / "models"
    (repo / "scorer" / "1").mkdir(parents=True)
    tabular(repo / "scorer" / "1" / "model.onnx")
    (repo / "scorer" / "model.toml").write_text('outputs = ["score"]\n')
    async with _prepared(repo) as (control, stages):
        stage = stages.models[0].infer
        assert list(stage.binding.outputs.used) == ["score"]
        wider = b'{"version": 1, "settings": {"outputs": ["score", "probabilities"]}}'
        assert await control.apply("scorer", wider) is True
        assert sorted(stage.binding.outputs.used) == ["probabilities", "score"]
        assert await control.apply("scorer", wider) is True  # the same state: nothing to do
        refused = metrics.MODEL_SWAPS.labels(outcome="refused")
        before = refused._value.get()
        assert await control.apply("scorer", b'{"version": 1, "settings": '
                                             b'{"outputs": ["nope"]}}') is False  # fmt: skip
        assert await control.apply("scorer", b'{"version": 1}') is False  # drops probabilities
        assert refused._value.get() == before + 2
        assert sorted(stage.binding.outputs.used) == ["probabilities", "score"]


async def test_a_version_of_the_same_file_with_another_model_toml_is_swapped_in(
    tmp_path: Path,
) -> None:
    """What a record names is compared as it would run (its file and settings),
    not by its file alone: version 2, the same file with another output in its
    model.toml, is swapped in and the index says version 2 serves."""
    repo = tmp_path / "models"
    for version in (1, 2):
        (repo / "scorer" / str(version)).mkdir(parents=True)
    tabular(repo / "scorer" / "1" / "model.onnx")
    shutil.copy(repo / "scorer" / "1" / "model.onnx", repo / "scorer" / "2" / "model.onnx")
    (repo / "scorer" / "1" / "model.toml").write_text('outputs = ["score"]\n')
    (repo / "scorer" / "2" / "model.toml").write_text('outputs = ["score", "probabilities"]\n')
    async with _prepared(repo, **FIRST) as (control, stages):
        assert await control.apply("scorer", b'{"version": 2}') is True
        assert sorted(stages.models[0].infer.binding.outputs.used) == ["probabilities", "score"]
        index = {v["version"]: v["reason"] for v in control.index()}
        assert index["1"] == "version 2 serves" and index["2"] == ""


def test_a_record_without_topics_carries_the_last_record_s() -> None:
    """A record is a model's whole desired state: ``models load`` and the OIP
    load keep the topics the model's last record gave it where they name none."""
    last = b'{"version": 1, "settings": {"topics": ["a", "b"]}}'
    assert carried(Desired(2), last) == Desired(2, {"topics": ["a", "b"]})
    assert carried(Desired(2, {"topics": ["a"]}), last) == Desired(2, {"topics": ["a"]})
    assert carried(Desired(2), b'{"version": 1}') == Desired(2)
    assert carried(Desired(2), None) == Desired(2) and carried(Desired(None), last).version is None
