"""``[repository]``: a directory of models read as the settings load. Its layout
(REPO/NAME/VERSION/, a model file, an optional model.toml), its version policy
(Triton's: latest N, all, specific) and what a worker of one version per model
refuses; a repository model is served and routed as the same ``[models.NAME]``
is, and every mistake is refused naming the path and the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from worker.cli import main
from worker.config import RepositoryConfig, Settings, load_settings
from worker.config.models import routing, served
from worker.config.repository import RepositoryModel
from worker.config.repository_files import listing, scan
from worker.flow.errors import ConfigError

KAFKA = '[kafka]\ninput_topics = ["a", "b"]\n'


def _model(repo: Path, name: str, version: int | str, file: str = "model.onnx") -> Path:
    """A version directory with a model file (its bytes are never read here)."""
    directory = repo / name / str(version)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / file).write_bytes(b"onnx")
    return directory


def _repo(tmp_path: Path) -> Path:
    """Two models: scorer (versions 1 and 3, its settings beside its versions) and
    reader (version 2, settings in the version)."""
    repo = tmp_path / "repo"
    _model(repo, "scorer", 1)
    _model(repo, "scorer", 3)
    (repo / "scorer" / "model.toml").write_text('topics = ["a"]\noutputs = ["score"]\n')
    _model(repo, "reader", 2)
    (repo / "reader" / "2" / "model.toml").write_text('topics = ["b"]\nintra_op_threads = 2\n')
    return repo


def _load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Settings:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return load_settings(path, env=env or {})


def _with_repo(repo: Path, extra: str = "") -> str:
    return f'{KAFKA}[repository]\npath = "{repo}"\n{extra}'


# --- the version policy, pure ----------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        ({}, (7,)),
        ({"latest": 2}, (3, 7)),
        ({"latest": 9}, (1, 3, 7)),
        ({"version_policy": "all"}, (1, 3, 7)),
        ({"version_policy": "specific", "versions": (3, 1, 4)}, (1, 3)),
    ],
)
def test_the_policy_names_versions_as_triton_s(
    policy: dict[str, object], named: tuple[int]
) -> None:
    repo = RepositoryConfig(path="r", **policy)  # type: ignore[arg-type]
    assert repo.named([3, 7, 1]) == named


def test_one_version_of_a_model_is_served_and_several_are_refused_naming_the_key() -> None:
    assert RepositoryConfig(path="r").served_version("m", [1, 3, 2]) == 3
    assert RepositoryConfig(path="r", version_policy="specific", versions=(2,)).served_version(
        "m", [1, 2, 3]
    ) == 2  # fmt: skip
    assert RepositoryConfig(path="r", version_policy="all").served_version("m", [5]) == 5
    cases = [
        (RepositoryConfig(path="r", latest=2), "repository.latest: names 2 versions of 'm' (2, 3)"),
        (RepositoryConfig(path="r", version_policy="all"), "repository.version_policy: names 3"),
        (RepositoryConfig(path="r", version_policy="specific", versions=(1, 2)),
         "repository.versions: names 2 versions of 'm' (1, 2)"),
        (RepositoryConfig(path="r", version_policy="specific", versions=(9,)),
         "repository.versions: 'm' has none of the versions [9] (it has 1, 2, 3)"),
    ]  # fmt: skip
    for repo, message in cases:
        with pytest.raises(ConfigError, match=r"a worker serves one version|has none") as err:
            repo.served_version("m", [1, 2, 3])
        assert str(err.value).startswith(message), err.value


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"latest": 0}, "repository.latest: must be >= 1"),
        ({"version_policy": "all", "latest": 2}, "repository.latest: counts versions under"),
        ({"versions": (1,)}, "repository.versions: lists the versions served under"),
        ({"version_policy": "specific"}, "repository.versions: lists the versions"),
        ({"version_policy": "specific", "versions": (0,)}, "repository.versions: version numbers"),
        ({"version_policy": "specific", "versions": (2, 2)}, "repository.versions: repeats"),
        ({"models": ("a", "a")}, "repository.models: names repeat"),
    ],
)
def test_the_section_s_own_mistakes(keys: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        RepositoryConfig(path="r", **keys)  # type: ignore[arg-type]


def test_keys_without_a_path_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^repository.path: names the repository's directory"):
        _load(tmp_path, KAFKA + '[repository]\nmodels = ["x"]\n')


# --- the layout, and a repository model served as a [models.NAME] ---------------------


def test_each_model_is_served_at_the_latest_version_with_its_settings(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "README.md").write_text("models")  # files beside the models: ignored
    (repo / ".cache").mkdir()  # hidden entries: ignored
    s = _load(tmp_path, _with_repo(repo))
    models = served(s)
    assert [(m.name, m.key, m.topics) for m in models] == [
        ("reader", "repository.reader", ("b",)),
        ("scorer", "repository.scorer", ("a",)),
    ]
    reader, scorer = (m.config for m in models)
    assert isinstance(scorer, RepositoryModel) and isinstance(reader, RepositoryModel)
    assert scorer.path == str(repo / "scorer" / "3" / "model.onnx")  # the latest
    assert scorer.outputs == ("score",)  # the model's own settings, for every version
    assert (reader.path, reader.intra_op_threads) == (str(repo / "reader/2/model.onnx"), 2)
    assert routing(s).owners == {"a": "scorer", "b": "reader"}


def test_a_repository_model_is_the_same_value_as_its_models_section(tmp_path: Path) -> None:
    """Same settings, same routing: only where it came from differs."""
    repo = _repo(tmp_path)
    from_repo = _load(tmp_path, _with_repo(repo))
    configured = _load(tmp_path, KAFKA + (
        f'[models.reader]\npath = "{repo}/reader/2/model.onnx"\ntopics = ["b"]\n'
        "intra_op_threads = 2\n"
        f'[models.scorer]\npath = "{repo}/scorer/3/model.onnx"\ntopics = ["a"]\n'
        'outputs = ["score"]\n'))  # fmt: skip
    assert routing(from_repo) == routing(configured)
    for ours, theirs in zip(served(from_repo), served(configured), strict=True):
        assert dataclasses.asdict(ours.config) == dataclasses.asdict(theirs.config)
        assert (ours.name, ours.topics) == (theirs.name, theirs.topics)


def test_a_lone_repository_model_answers_every_input_topic(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _model(repo, "only", 1)
    s = _load(tmp_path, _with_repo(repo))
    assert [(m.name, m.topics) for m in served(s)] == [("only", ("a", "b"))]


def test_repository_models_follow_the_configured_ones_and_the_shared_topic(
    tmp_path: Path,
) -> None:
    """Beside [model] (which keeps the topics nobody names) and a [models.NAME]; a
    repository model without topics is answered by name on [model]'s topic."""
    repo = tmp_path / "repo"
    _model(repo, "byname", 1)
    s = _load(tmp_path, '[kafka]\ninput_topics = ["a", "b"]\n[model]\npath = "builtin:digits"\n'
              '[models.other]\npath = "builtin:sentiment"\ntopics = ["b"]\n'
              f'[repository]\npath = "{repo}"\n')  # fmt: skip
    assert [m.key for m in served(s)] == ["model", "models.other", "repository.byname"]
    table = routing(s)
    assert table.answerer("a", "byname") == "byname"


def test_the_version_s_settings_win_over_the_model_s_and_are_not_merged(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "scorer" / "3" / "model.toml").write_text('topics = ["a"]\n')
    (scorer,) = (m.config for m in served(_load(tmp_path, _with_repo(repo)))
                 if m.name == "scorer")  # fmt: skip
    assert scorer.outputs == ()


def test_the_model_file_is_model_onnx_or_the_one_of_a_known_kind(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _model(repo, "plan", 1, file="engine.plan")
    (repo / "plan" / "1" / "notes.txt").write_text("not a model")
    _model(repo, "both", 1, file="other.onnx")
    _model(repo, "both", 1, file="model.onnx")  # model.onnx where there is one
    _model(repo, "named", 1, file="a.pt2")
    _model(repo, "named", 1, file="b.pt2")
    (repo / "named" / "model.toml").write_text('path = "b.pt2"\n')
    s = _load(tmp_path, '[kafka]\ninput_topics = ["a"]\n'
              f'[repository]\npath = "{repo}"\n[model]\npath = "builtin:digits"\n')  # fmt: skip
    assert {n: Path(m.path).name for n, m in s.models.items()} == {
        "both": "model.onnx", "named": "b.pt2", "plan": "engine.plan"}  # fmt: skip


def test_only_the_models_named_are_served(tmp_path: Path) -> None:
    s = _load(tmp_path, _with_repo(_repo(tmp_path), 'models = ["scorer"]\n').replace(
        '["a", "b"]', '["a"]'))  # fmt: skip
    assert [m.name for m in served(s)] == ["scorer"]


def test_the_repository_path_from_the_environment(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    s = _load(tmp_path, KAFKA, env={"INFER_WORKER_REPOSITORY__PATH": str(repo)})
    assert [m.name for m in served(s)] == ["reader", "scorer"]


def test_a_stateful_repository_model_s_changelog_is_a_needed_topic(tmp_path: Path) -> None:
    from worker.config.topics import needed_topics

    repo = _repo(tmp_path)
    (repo / "reader" / "2" / "model.toml").write_text('topics = ["b"]\nstate_topic = "b.states"\n')
    needed = {t.name: t for t in needed_topics(_load(tmp_path, _with_repo(repo)))}
    assert needed["b.states"].setting == "repository.reader.state_topic"
    assert needed["b.states"].co_partitioned == "b"


# --- refusals: the path and the key ------------------------------------------------


def _refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    return str(err.value)


def test_a_missing_or_empty_repository(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    refused = _refused(tmp_path, _with_repo(missing))
    assert refused == f"repository.path: {missing} is not a directory"
    (tmp_path / "empty").mkdir()
    assert _refused(tmp_path, _with_repo(tmp_path / "empty")).startswith(
        f"repository.path: {tmp_path / 'empty'} holds no model")


@pytest.mark.parametrize("version", ["v2", "01", "0", "latest"])
def test_a_version_that_is_not_a_positive_integer(tmp_path: Path, version: str) -> None:
    repo = _repo(tmp_path)
    (repo / "scorer" / version).mkdir()
    assert _refused(tmp_path, _with_repo(repo)) == (
        f"repository.path: {repo / 'scorer' / version}: a model's directories are its versions, "
        "each a positive integer (1, 2, ...)")  # fmt: skip


def test_a_version_without_a_model_file_and_a_model_without_versions(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "scorer" / "4").mkdir()  # the latest, being copied in
    (repo / "scorer" / "4" / "model.toml").write_text('topics = ["a"]\n')
    assert _refused(tmp_path, _with_repo(repo)) == (
        f"repository.path: {repo / 'scorer' / '4'}: no model file (model.onnx, or one file of "
        ".onnx, .plan, .pt, .pt2)")  # fmt: skip
    (repo / "scorer" / "4" / "a.onnx").write_bytes(b"x")
    (repo / "scorer" / "4" / "b.plan").write_bytes(b"x")
    assert "several model files (a.onnx, b.plan): name the one served, path = " in _refused(
        tmp_path, _with_repo(repo))  # fmt: skip
    (repo / "lonely").mkdir()
    assert _refused(tmp_path, _with_repo(repo, 'models = ["lonely"]\n')) == (
        f"repository.path: {repo / 'lonely'}: no version directory (the model file goes in "
        f"{repo / 'lonely'}/1/)")  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('topics = ["a"]\nbatch = 4\n', "unknown key batch (known: backend, input,"),
        ('topics = ["a"]\n[inputs.x]\nkind = "text"\n', "inputs.x.tokenizer: a text input needs"),
        ('topics = ["a"]\n[preprocess]\nsizes = [8, 8]\n', "unknown key preprocess.sizes"),
        ("intra_op_threads = -1\n", "intra_op_threads: must be >= 0"),
        ('topics = "a"\n', "topics: expected a list"),
        ('name = "other"\n', "name: 'other': a repository model is named by its directory"),
        ('path = "builtin:digits"\n', "path: 'builtin:digits': the model file's name in the "
         "version directory"),
        ('path = "gone.onnx"\n', "path: {dir}/gone.onnx is not a file"),
        ("topics = [\n", "invalid TOML"),
    ],
)
def test_a_settings_file_s_mistake_names_the_file_and_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    repo = _repo(tmp_path)
    settings = repo / "scorer" / "model.toml"
    settings.write_text(text)
    got = _refused(tmp_path, _with_repo(repo))
    assert got.startswith(f"{settings}: {message.format(dir=repo / 'scorer' / '3')}"), got


def test_a_name_configured_twice_is_refused_by_name(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    both = _with_repo(repo) + '[models.scorer]\npath = "builtin:digits"\ntopics = ["a"]\n'
    assert _refused(tmp_path, both) == (
        f"models.scorer: 'scorer' is also a model of the repository ({repo / 'scorer'}): a "
        "model is configured once (remove [models.scorer], or leave 'scorer' out of "
        "repository.models)")  # fmt: skip
    # [model] named as a repository model (from its path) is refused as a duplicate too.
    shorthand = _with_repo(repo).replace('["a", "b"]', '["a", "b", "c"]') + (
        '[model]\npath = "/models/reader.onnx"\ntopics = ["c"]\n')  # fmt: skip
    assert _refused(tmp_path, shorthand).startswith(
        "model.name: 'reader' is also a model of the repository")


def test_the_models_checks_name_a_repository_model_so(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "reader" / "2" / "model.toml").write_text('topics = ["elsewhere"]\n')
    assert _refused(tmp_path, _with_repo(repo)).startswith(
        "repository.reader.topics: ['elsewhere'] not in kafka.input_topics")
    (repo / "reader" / "2" / "model.toml").write_text('topics = ["a"]\n')
    assert _refused(tmp_path, _with_repo(repo)).startswith(
        "repository.scorer.topics: 'a' is also repository.reader's")


def test_a_model_left_out_is_refused_unknown(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert _refused(tmp_path, _with_repo(repo, 'models = ["scorer", "ghost"]\n')) == (
        f"repository.models: ['ghost'] not in {repo} (it holds reader, scorer)")


def test_only_the_served_versions_are_read(tmp_path: Path) -> None:
    """An older version's broken settings do not stop the latest from serving."""
    repo = _repo(tmp_path)
    (repo / "scorer" / "1" / "model.toml").write_text("nonsense = true\n")
    assert [m.name for m in served(_load(tmp_path, _with_repo(repo)))] == ["reader", "scorer"]


# --- infer-worker models list --------------------------------------------------------


def test_models_list_shows_every_version_and_the_one_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = _repo(tmp_path)
    path = tmp_path / "worker.toml"
    path.write_text(_with_repo(repo, 'models = ["scorer"]\n').replace(
        '["a", "b"]', '["a", "b"]') + '[models.texts]\npath = "builtin:sentiment"\n'
        'topics = ["b"]\n')  # fmt: skip
    assert main(["models", "list", "--config", str(path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows == [
        ["MODEL", "VERSION", "SERVED", "FROM"],
        ["texts", "-", "yes", "[models.texts]", "builtin:sentiment"],
        ["scorer", "1", "no", str(repo / "scorer" / "1")],
        ["scorer", "3", "yes", str(repo / "scorer" / "3" / "model.onnx")],
        ["reader", "2", "no", str(repo / "reader" / "2")],  # left out: repository.models
    ]
    assert [(v.name, v.version, v.served) for v in listing(load_settings(path).repository)] == [
        ("reader", 2, False), ("scorer", 1, False), ("scorer", 3, True)]  # fmt: skip
    assert [e.name for e in scan(load_settings(path).repository)] == ["reader", "scorer"]


def test_models_list_refuses_what_run_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "worker.toml"
    path.write_text(_with_repo(_repo(tmp_path), "latest = 2\n"))
    assert main(["models", "list", "--config", str(path)]) == 2
    assert "repository.latest: names 2 versions of 'scorer' (1, 3)" in capsys.readouterr().err


def test_models_list_says_when_the_control_topic_cannot_be_read(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With kafka.control_topic, the desired states follow the table; a broker
    that cannot be reached is said once, naming the setting, the table printed."""
    repo = _repo(tmp_path)
    path = tmp_path / "worker.toml"
    path.write_text(_with_repo(repo, 'models = ["scorer"]\n').replace(
        '["a", "b"]', '["a"]').replace("[kafka]\n", '[kafka]\nbootstrap_servers = "127.0.0.1:1"\n'
        'control_topic = "models.control"\nrequest_timeout_ms = 2000\n'))  # fmt: skip
    assert main(["models", "list", "--config", str(path)]) != 0
    out, err = capfd.readouterr()
    assert out.splitlines()[0].split() == ["MODEL", "VERSION", "SERVED", "FROM"]
    assert "kafka.control_topic: 'models.control' not read within" in err
    assert "Traceback" not in err
