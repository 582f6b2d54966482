"""The control topic's records as the worker reads them (``worker.app.control``):
a desired version from JSON, and the records it refuses, each named and
counted (``infer_model_swaps_total{outcome="refused"}``), the worker going on."""

from __future__ import annotations

import pytest

from worker.app.control import Control, desired_version
from worker.config import KafkaConfig, Settings
from worker.obs import metrics


@pytest.mark.parametrize(("value", "version"), [(b'{"version": 3}', 3), (b"", None), (None, None)])
def test_a_record_names_a_version_or_is_a_tombstone(value: bytes | None, version: int | None
                                                    ) -> None:  # fmt: skip
    assert desired_version(value) == version


@pytest.mark.parametrize(
    ("value", "problem"),
    [(b"3", "expected {\"version\": N}"), (b'{"version": 0}', "a positive integer"),
     (b'{"version": true}', "expected"), (b'{"v": 3}', "expected"), (b"\xff", "not JSON")],
)  # fmt: skip
def test_a_value_that_is_not_a_desired_version_is_refused_saying_why(value: bytes, problem: str
                                                                      ) -> None:  # fmt: skip
    with pytest.raises(ValueError, match=problem.replace("{", r"\{").replace("}", r"\}")):
        desired_version(value)


async def test_records_for_models_it_may_not_set_are_refused_and_counted() -> None:
    s = Settings(kafka=KafkaConfig(input_topics=["in"]))
    control = Control(s, {}, {"fixed": "a configured model: its version is its file's"})
    refused = metrics.MODEL_SWAPS.labels(outcome="refused")
    before = refused._value.get()
    await control.apply("fixed", b'{"version": 2}')  # a configured model
    await control.apply("ghost", b'{"version": 2}')  # not served here
    await control.apply("fixed", b"not json")
    assert refused._value.get() == before + 3


async def test_a_version_that_fails_to_load_is_reported_in_the_index(tmp_path: object) -> None:
    """A load that fails is reported where an operator looks (the OIP index's
    status says why) while the serving version goes on; built as ``run`` builds
    the worker (``Worker.prepare``: no Kafka)."""
    from pathlib import Path

    from tests.onnx_models import tabular
    from worker.app.worker import Worker
    from worker.config import load_settings

    repo = Path(str(tmp_path)) / "models"
    (repo / "scorer" / "1").mkdir(parents=True)
    tabular(repo / "scorer" / "1" / "model.onnx")
    (repo / "scorer" / "2").mkdir(parents=True)
    (repo / "scorer" / "2" / "model.onnx").write_bytes(b"not a model")
    s = load_settings(env={"INFER_WORKER_REPOSITORY__PATH": str(repo),
                           "INFER_WORKER_REPOSITORY__VERSION_POLICY": "specific",
                           "INFER_WORKER_REPOSITORY__VERSIONS": "[1]",
                           "INFER_WORKER_KAFKA__CONTROL_TOPIC": "models.control"})  # fmt: skip
    worker = Worker(s)
    await worker.prepare()
    try:
        control = worker._control
        assert control is not None
        assert await control.apply("scorer", b'{"version": 2}') is False
        index = {v["version"]: v for v in control.index()}
        assert index["2"]["state"] == "UNAVAILABLE"
        assert index["2"]["reason"].startswith("refused: cannot load"), index["2"]
        assert "version 1 serves" in index["2"]["reason"]
        assert index["1"]["reason"] == ""  # still the one serving
        assert await control.apply("scorer", b'{"version": 1}') is True
    finally:
        await worker.stop()
