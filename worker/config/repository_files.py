"""Reading a model repository's directory, once, as the settings load: its
models and their versions (``scan``), and each served model's version as a
``RepositoryModel`` (``repository_models``), added to the settings' models so
that every check, the routing table and the stages treat it as a
``[models.NAME]``. A mistake in the layout or a settings file is a
``ConfigError`` naming the path and the key; no model file is opened here (the
worker loads them as it loads every model).

Layout (Triton's): ``REPO/NAME/VERSION/`` with VERSION a positive integer
without leading zeros; entries whose names start with a dot are ignored (editors'
and sync tools' files), as are plain files beside the models and versions (a
README, labels). The settings file ``model.toml`` of a version wins over the
model's own; they are not merged: a version that needs other settings carries
all of them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.config.checks import check
from worker.config.kafka import KafkaConfig
from worker.config.loading import build_table, read_toml
from worker.config.repository import RepositoryConfig, RepositoryModel
from worker.flow.errors import ConfigError

SETTINGS_FILE = "model.toml"
DEFAULT_FILE = "model.onnx"
# The model files the engines take: ONNX (onnxruntime, gpu-twin), TensorRT plans,
# TorchScript and exported torch programs.
MODEL_SUFFIXES = (".onnx", ".plan", ".pt", ".pt2")
_VERSION = re.compile(r"[1-9][0-9]*")


@dataclass(frozen=True)
class RepositoryEntry:
    """One model directory of the repository and the versions it holds."""

    name: str
    directory: Path
    versions: tuple[int, ...]  # ascending


@dataclass(frozen=True)
class ListedVersion:
    """One version of a repository model, and whether the worker serves it."""

    name: str
    version: int
    directory: Path
    served: bool


def scan(repo: RepositoryConfig) -> tuple[RepositoryEntry, ...]:
    """Every model of the repository with its versions, by name."""
    root = Path(repo.path)
    check(root.is_dir(), "repository.path", f"{repo.path} is not a directory")
    entries = tuple(RepositoryEntry(d.name, d, _versions(d)) for d in _visible(root) if d.is_dir())
    check(bool(entries), "repository.path", f"{repo.path} holds no model (a directory "
          "REPO/NAME/VERSION/ per model)")  # fmt: skip
    names = [e.name for e in entries]
    missing = [n for n in repo.models if n not in names]
    check(not missing, "repository.models", f"{missing} not in {repo.path} (it holds "
          f"{', '.join(names)})")  # fmt: skip
    return entries


def served_entries(repo: RepositoryConfig) -> tuple[RepositoryEntry, ...]:
    """The repository's models the worker serves (``repository.models``, else all),
    in the order ``repository.models`` names them, else by name."""
    entries = {e.name: e for e in scan(repo)}
    return tuple(entries[n] for n in repo.models) if repo.models else tuple(entries.values())


def repository_models(repo: RepositoryConfig) -> dict[str, RepositoryModel]:
    """Each served model at the version the policy names, as the worker serves it."""
    return {
        e.name: load_version(e, repo.served_version(e.name, e.versions))
        for e in served_entries(repo)
    }


def listing(repo: RepositoryConfig) -> tuple[ListedVersion, ...]:
    """Every version of every model in the repository, marked where served."""
    served = {e.name: repo.served_version(e.name, e.versions) for e in served_entries(repo)}
    return tuple(
        ListedVersion(e.name, v, e.directory / str(v), served.get(e.name) == v)
        for e in scan(repo)
        for v in e.versions
    )


def with_repository(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The settings' converted fields with the repository's models added to
    ``models`` after the configured ones (a name configured twice is refused)."""
    repo = fields.get("repository")
    if not isinstance(repo, RepositoryConfig) or not repo.path:
        return dict(fields)
    configured: Mapping[str, Any] = fields.get("models", {})
    found = repository_models(repo)
    for name in found:
        check(name not in configured, f"models.{name}", f"{name!r} is also a model of the "
              f"repository ({Path(repo.path) / name}): a model is configured once (remove "
              f"[models.{name}], or leave {name!r} out of repository.models)")  # fmt: skip
    out = {**fields, "models": {**configured, **found}}
    kafka = fields.get("kafka")
    if isinstance(kafka, KafkaConfig) and kafka.control_topic:
        # Models come and go through the control topic, each with its topics
        # (its model.toml's): they are read beside kafka.input_topics.
        inputs = kafka.input_topics
        more = tuple(dict.fromkeys(t for m in found.values() for t in m.topics if t not in inputs))
        if more:
            out["kafka"] = dataclasses.replace(kafka, input_topics=(*inputs, *more))
    return out


def load_version(entry: RepositoryEntry, version: int,
                 overrides: Mapping[str, Any] | None = None) -> RepositoryModel:  # fmt: skip
    """Version ``version`` of ``entry`` with its settings file's keys, named by
    its directory, its ``path`` the version's model file. ``overrides``: keys
    over the file's (a control record's settings), each replacing its value
    whole; a mistake in them is named as the record's (``settings.KEY``)."""
    directory = entry.directory / str(version)
    candidates = (directory / SETTINGS_FILE, entry.directory / SETTINGS_FILE)
    settings = next((f for f in candidates if f.is_file()), None)
    data = dict(read_toml(settings, f"{settings}: not found")) if settings else {}
    where = str(settings or directory)
    if overrides:
        data.update(overrides)
        where = f"{where} with the record's settings"
    if "name" in data and data["name"] != entry.name:
        raise ConfigError(f"{where}: name: {data['name']!r}: a repository model is named by its "
                          f"directory ({entry.name!r})")  # fmt: skip
    data["name"] = entry.name
    data["path"] = str(_model_file(directory, data.get("path"), where))
    try:
        return build_table(RepositoryModel, data)
    except ConfigError as exc:  # the section's checks say model.KEY: the file's KEY
        raise ConfigError(f"{where}: {re.sub(r'^model[.]', '', str(exc))}") from None


def _visible(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if not p.name.startswith("."))


def _versions(model: Path) -> tuple[int, ...]:
    versions: list[int] = []
    for d in _visible(model):
        if not d.is_dir():
            continue
        check(bool(_VERSION.fullmatch(d.name)), "repository.path", f"{d}: a model's "
              "directories are its versions, each a positive integer (1, 2, ...)")  # fmt: skip
        versions.append(int(d.name))
    check(bool(versions), "repository.path", f"{model}: no version directory (the model "
          f"file goes in {model}/1/)")  # fmt: skip
    return tuple(sorted(versions))


def _model_file(directory: Path, named: object, where: str) -> Path:
    """The model file of a version directory: the settings file's ``path`` (a
    file in the directory), else ``model.onnx``, else its one file of a kind the
    engines take."""
    if named is not None:
        ok = isinstance(named, str) and bool(named) and not Path(named).is_absolute()
        check(ok and ":" not in str(named), f"{where}: path", f"{named!r}: the model file's "
              "name in the version directory (a relative path)")  # fmt: skip
        file = directory / str(named)
        check(file.is_file(), f"{where}: path", f"{file} is not a file")
        return file
    if (directory / DEFAULT_FILE).is_file():
        return directory / DEFAULT_FILE
    found = [f for f in _visible(directory) if f.is_file() and f.suffix in MODEL_SUFFIXES]
    kinds = ", ".join(MODEL_SUFFIXES)
    check(bool(found), "repository.path", f"{directory}: no model file ({DEFAULT_FILE}, or "
          f"one file of {kinds})")  # fmt: skip
    check(len(found) == 1, "repository.path", f"{directory}: several model files "
          f"({', '.join(f.name for f in found)}): name the one served, path = \"...\" in "
          f"{SETTINGS_FILE}")  # fmt: skip
    return found[0]
