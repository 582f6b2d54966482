"""The several-models guide's and README's configurations, taken from the pages
as written: each loads, and routes as the page says it does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.documentation import ROOT
from worker.config import Settings, load_settings
from worker.config.models import routing, served

_TOML = re.compile(r"```toml\n(.*?)```", re.S)


def _examples(page: str) -> list[str]:
    return _TOML.findall((ROOT / page).read_text())


def test_the_guide_s_models_sections_alone_route_by_topic(tmp_path: Path) -> None:
    example = _examples("docs/guides/models.md")[0]
    s = load_settings_from(tmp_path, example)
    assert [m.name for m in served(s)] == ["churn", "sentiment"]  # no bundled model
    assert routing(s).owners == {"scores.requests": "churn", "reviews.requests": "sentiment",
                                 "tickets.requests": "sentiment"}  # fmt: skip
    assert routing(s).shared == frozenset()


@pytest.mark.parametrize("index", [1, 2])
def test_readme_s_several_models_and_pipeline_examples_load(tmp_path: Path, index: int) -> None:
    example = _examples("README.md")[index]
    if index == 2:  # the pipeline: its models as its comment names them
        example = ('[kafka]\ninput_topics = ["audio.requests"]\n[model]\npath = '
                   '"/models/melspec.onnx"\n[models.embedding]\npath = '
                   '"/models/embedding.onnx"\n' + example)  # fmt: skip
    s = load_settings_from(tmp_path, example)
    table = routing(s)
    if index == 1:
        assert table.owners == {"scores.requests": "scorer", "reviews.requests": "sentiment"}
        assert table.shared == frozenset({"scores.requests"})
    else:
        assert table.owners == {"audio.requests": "wakeword"}


def load_settings_from(tmp_path: Path, text: str) -> Settings:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return load_settings(path, env={})


def test_the_pipelines_guide_s_configurations_load_as_written(tmp_path: Path) -> None:
    """The guide's wakeword pipeline as it stands, and its pipeline with a request
    of its own with the worker around it (its models and topics)."""
    first, declared, _ocr = _examples("docs/guides/pipelines.md")
    s = load_settings_from(tmp_path, first)
    assert routing(s).owners == {"audio.requests": "wakeword"}
    assert [step.name for step in s.pipelines["wakeword"].steps] == ["mel", "window", "embed"]
    around = ('[kafka]\ninput_topics = ["pages.requests"]\n[models.detector]\npath = '
              '"/models/det.onnx"\n[models.digits]\npath = "builtin:digits"\n')  # fmt: skip
    s = load_settings_from(tmp_path, around + declared)
    read = s.pipelines["read"]
    assert read.inputs == {"pixels": "uint8 [H, W, 1]"} and read.steps[0].function
    assert [step.op for step in read.steps] == ["", "", "", "crop_boxes", ""]


def test_the_guide_s_model_repository_serves_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The repository the guide lays out, its files as the page writes them (the
    models real ones: a tabular scorer and the bundled digits model): the worker's
    start-up checks pass (every model loaded, bound and probed), each topic goes
    to its model at the version the policy serves, and ``models list`` prints
    what the page shows."""
    import asyncio
    import shutil

    pytest.importorskip("onnx")
    from tests.onnx_models import tabular
    from worker.app.preflight import checked
    from worker.cli import main
    from worker.model.files import bundled_file

    worker_toml, *settings_files = _examples("docs/guides/models.md")[1:4]
    repo = tmp_path / "models"
    for version in (1, 2):
        (repo / "churn" / str(version)).mkdir(parents=True)
        tabular(repo / "churn" / str(version) / "model.onnx", seed=version)
    (repo / "digits" / "1").mkdir(parents=True)
    shutil.copy(bundled_file("digits.onnx"), repo / "digits" / "1" / "model.onnx")
    for text in settings_files:
        first, _, body = text.partition("\n")
        target = Path(first.removeprefix("# ").replace("/srv/models", str(repo)))
        target.write_text(body)
    s = load_settings_from(tmp_path, worker_toml.replace("/srv/models", str(repo)))
    assert routing(s).owners == {"scores.requests": "churn", "images.requests": "digits"}
    assert {m.name: m.config.path for m in served(s)} == {
        "churn": str(repo / "churn" / "2" / "model.onnx"),
        "digits": str(repo / "digits" / "1" / "model.onnx")}  # fmt: skip
    asyncio.run(checked(s))  # what run checks before Kafka: loads, binds, probes
    capsys.readouterr()  # what loading logged

    assert main(["models", "list", "--config", str(tmp_path / "worker.toml")]) == 0
    (listed,) = re.findall(r"```\n(MODEL .*?)```", (ROOT / "docs/guides/models.md").read_text(),
                           re.S)  # fmt: skip
    assert capsys.readouterr().out == listed.replace("/srv/models", str(repo))


def test_the_guide_s_memory_shared_by_demand_loads_as_written(tmp_path: Path) -> None:
    """The on-demand example with the repository its page describes: three models
    on their topics, churn pinned, a 2 GiB budget; then what run checks before
    Kafka (each loaded, bound, measured and kept while the budget holds it)."""
    import asyncio

    from tests.onnx_models import tabular
    from worker.app.preflight import checked

    example = _examples("docs/guides/models.md")[4]
    repo = tmp_path / "models"
    for name, topic in (("churn", "scores"), ("digits", "images"), ("sentiment", "reviews")):
        (repo / name / "1").mkdir(parents=True)
        tabular(repo / name / "1" / "model.onnx")
        (repo / name / "model.toml").write_text(f'topics = ["{topic}.requests"]\n')
    s = load_settings_from(tmp_path, example.replace("/srv/models", str(repo)))
    assert s.repository.on_demand and s.repository.pinned == ("churn",)
    assert s.limits.max_models_memory_mb == 2048 and s.kafka.control_topic == "models.control"
    assert routing(s).owners == {"scores.requests": "churn", "images.requests": "digits",
                                 "reviews.requests": "sentiment"}  # fmt: skip
    asyncio.run(checked(s))
