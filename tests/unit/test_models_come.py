"""Models that come while serving (``worker.app.arrivals``), without a broker: a
worker built as ``run`` builds it (``Worker.prepare``) applies control records
naming repository models it does not serve. Refused, and nothing changed: what
a configuration could not have started with (a model answering no topic, a
topic another model answers). Brought: a model answering by name on the shared
topics, its requests routed to its own stages by the intake. A served model's
topics stay its own. (Models with topics of their own, and the answers: on both
brokers, ``tests/integration/test_models_come.py``.)"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from tests.onnx_models import tabular
from tests.serving import wire
from worker.app.control import Control
from worker.app.stages import Stages
from worker.app.worker import Worker
from worker.config import load_settings
from worker.contract import ModelRef, Tensor
from worker.flow.messages import TopicPartition
from worker.obs import metrics


def _repository(root: Path) -> Path:
    repo = root / "models"
    for seed, name in enumerate(("scorer", "ranker"), start=1):
        (repo / name / "1").mkdir(parents=True)
        tabular(repo / name / "1" / "model.onnx", seed=seed)
    return repo


@contextlib.asynccontextmanager
async def _worker(root: Path, **env: str) -> AsyncIterator[tuple[Control, Stages]]:
    """A worker serving the repository's scorer alone (``repository.models``),
    with a control topic, prepared as ``run`` prepares it (no Kafka)."""
    repo = _repository(root)
    worker = Worker(load_settings(env={
        "INFER_WORKER_KAFKA__INPUT_TOPICS": "in", "INFER_WORKER_REPOSITORY__PATH": str(repo),
        "INFER_WORKER_REPOSITORY__MODELS": "scorer",
        "INFER_WORKER_KAFKA__CONTROL_TOPIC": "models.control", **env}))  # fmt: skip
    stages = await worker.prepare()
    try:
        assert worker._control is not None
        yield worker._control, stages
    finally:
        await worker.stop()


def _refused() -> float:
    return metrics.MODEL_SWAPS.labels(outcome="refused")._value.get()


async def test_a_model_a_configuration_could_not_start_with_is_refused(tmp_path: Path) -> None:
    async with _worker(tmp_path) as (control, stages):
        before = _refused()
        # No topic, and no shared topics to be named on: it would answer nothing.
        assert await control.apply("ranker", b'{"version": 1}') is False
        # The scorer's topic: a topic belongs to one model.
        taken = b'{"version": 1, "settings": {"topics": ["in"]}}'
        assert await control.apply("ranker", taken) is False
        assert _refused() == before + 2
        assert [m.name for m in stages.models] == ["scorer"]
        assert stages.routing.names == ("scorer",)
        reason = {v["name"]: v["reason"] for v in control.index()}["ranker"]
        assert "is also" in reason and "a topic belongs to one model" in reason, reason


async def test_a_served_model_keeps_its_topics(tmp_path: Path) -> None:
    """A record may give a served model more topics, never take one away (more,
    through a broker: tests/integration/test_models_come.py)."""
    async with _worker(tmp_path) as (control, stages):
        before = _refused()
        elsewhere = b'{"version": 1, "settings": {"topics": ["other"]}}'
        assert await control.apply("scorer", elsewhere) is False
        assert _refused() == before + 1
        assert await control.apply("scorer", b'{"version": 1, "settings": {"topics": ["in"]}}')
        assert stages.topics_of("scorer") == ["in"]


async def test_a_model_named_on_the_shared_topics_comes_and_is_routed_to(tmp_path: Path) -> None:
    base = tabular(tmp_path / "base.onnx", seed=9)
    # [model] answers "in", the shared topic: a request there may name any model.
    async with _worker(tmp_path, INFER_WORKER_MODEL__PATH=str(base),
                       INFER_WORKER_MODEL__NAME="base") as (control, stages):  # fmt: skip
        g = stages.grow
        assert g is not None
        row = np.arange(4, dtype=np.float32)
        request = wire("r1", {"features": Tensor.from_numpy(row)}, model=ModelRef("ranker"))
        before = g.intake("in", 0, 0, None, request)
        assert before.model == "base" and before.failure is not None  # not served yet
        assert before.failure.code == "unknown_model"
        assert await control.apply("ranker", b'{"version": 1}') is True
        assert "ranker" in stages.routing.names and "ranker" in g.infos
        job = g.intake("in", 0, 1, None, request)
        assert (job.model, job.failure) == ("ranker", None)
        ranker = next(m for m in stages.models if m.name == "ranker")
        assert ranker.infer.info.name == "ranker"
        # (Not ready: the worker was prepared, never started.)
        assert {v["name"]: v["reason"] for v in control.index()}["ranker"] == ""


async def test_a_topic_another_model_answers_stays_its(tmp_path: Path) -> None:
    """``[model]`` answers every input topic no other model names: a record
    giving one of them to a model that comes is refused before anything joins
    (the configuration grown by it would pass the start-up checks: the topic
    would move)."""
    base = tabular(tmp_path / "base.onnx", seed=9)
    async with _worker(tmp_path, INFER_WORKER_KAFKA__INPUT_TOPICS='["in", "x"]',
                       INFER_WORKER_MODEL__PATH=str(base),
                       INFER_WORKER_MODEL__NAME="base") as (control, stages):  # fmt: skip
        pausing = stages.consumer.pausing
        ranks = {t: pausing.rank(TopicPartition(t, 0)) for t in ("in", "x")}
        taken = b'{"version": 1, "settings": {"topics": ["x"]}}'
        assert await control.apply("ranker", taken) is False
        assert stages.routing.owner("x") == "base" and "ranker" not in stages.routing.names
        assert [m.name for m in stages.models] == ["base", "scorer"]
        assert {t: pausing.rank(TopicPartition(t, 0)) for t in ("in", "x")} == ranks
        reason = {v["name"]: v["reason"] for v in control.index()}["ranker"]
        assert "answered already (x: 'base')" in reason, reason
