"""``[repository]``: a directory of models, read at start-up, each served as a
``[models.NAME]`` would be (docs/guides/models.md, "A model repository").

The layout is Triton's: ``REPO/NAME/VERSION/`` (VERSION a positive integer)
holding the model file, with an optional settings file ``model.toml`` of the keys
a ``[models.NAME]`` takes, in the model's directory (every version's) or in a
version's (that version's alone). The version policy is Triton's too: the latest
N, all, or specific versions. This module is the section and the policy, pure;
``worker.config.repository_files`` reads the directory.

A worker serves one version of a model: a request names a model by name, and
the routing table holds one answerer per name (``worker.config.models``). A
policy naming several versions of one model is refused at start-up, naming the
setting, rather than serving one of them silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from worker.config.checks import check
from worker.config.model import ModelConfig
from worker.flow.errors import ConfigError


@dataclass(frozen=True)
class RepositoryConfig:
    """Where the repository is, which of its models and versions are served."""

    # A model repository: a directory of REPO/NAME/VERSION/ (VERSION a positive integer)
    # holding a model file and an optional model.toml of a [models.NAME]'s keys, each model
    # served as a [models.NAME] named by its directory (docs/guides/models.md); read at
    # start-up. "" = no repository.
    path: str = ""
    # Which versions of each model are served, as Triton's version_policy: "latest" (the
    # highest `latest` version numbers), "all", or "specific" (those in `versions`). A worker
    # serves one version of a model: a policy naming several of one model stops start-up.
    version_policy: Literal["latest", "all", "specific"] = "latest"
    latest: int = 1  # version_policy "latest": how many of the highest versions
    # version_policy "specific": the version numbers served (each model must have one of them).
    versions: tuple[int, ...] = ()
    # The repository's models served, by directory name; () = every one it holds. With
    # kafka.control_topic, a record brings any other one while serving.
    models: tuple[str, ...] = ()
    # Memory shared by demand: each repository model is loaded (bound, probed, measured) once
    # at start-up and kept while limits.max_models_memory_mb holds it beside the others; one not
    # loaded is loaded when its requests come or its topics have a backlog, the least recently
    # used model without a backlog evicted to make room (docs/guides/models.md). CPU models,
    # each answering requests of its own (not a pipeline's step). false = all loaded at start-up.
    on_demand: bool = False
    # on_demand: the repository models never evicted (loaded at start-up and kept).
    pinned: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(self.latest >= 1, "repository.latest", "must be >= 1")
        check(self.latest == 1 or self.version_policy == "latest", "repository.latest",
              "counts versions under version_policy 'latest' only")  # fmt: skip
        specific = self.version_policy == "specific"
        check(bool(self.versions) == specific, "repository.versions", "lists the versions "
              "served under version_policy 'specific' (and only there)")  # fmt: skip
        check(all(v >= 1 for v in self.versions), "repository.versions",
              "version numbers are positive integers")  # fmt: skip
        check(len(set(self.versions)) == len(self.versions), "repository.versions", "repeats")
        check(len(set(self.models)) == len(self.models), "repository.models", "names repeat")
        check(len(set(self.pinned)) == len(self.pinned), "repository.pinned", "names repeat")
        check(self.on_demand or not self.pinned, "repository.pinned",
              "names models never evicted under on_demand = true (and only there)")  # fmt: skip
        others = (self.version_policy != "latest", self.latest != 1, self.versions, self.models,
                  self.on_demand)  # fmt: skip
        check(bool(self.path) or not any(others), "repository.path",
              "names the repository's directory ([repository] has other keys set)")  # fmt: skip

    def named(self, versions: Sequence[int]) -> tuple[int, ...]:
        """The versions of one model (its directories' numbers) the policy names, ascending."""
        ordered = sorted(versions)
        if self.version_policy == "latest":
            return tuple(ordered[-self.latest :])
        if self.version_policy == "all":
            return tuple(ordered)
        return tuple(v for v in ordered if v in self.versions)

    def served_version(self, name: str, versions: Sequence[int]) -> int:
        """The one version of model ``name`` the worker serves; raises where the
        policy names none or several (the module's docstring)."""
        named = self.named(versions)
        have = ", ".join(str(v) for v in sorted(versions))
        check(bool(named), "repository.versions", f"{name!r} has none of the versions "
              f"{list(self.versions)} (it has {have})")  # fmt: skip
        if len(named) > 1:
            key = {"latest": "repository.latest", "all": "repository.version_policy"}.get(
                self.version_policy, "repository.versions"
            )
            raise ConfigError(
                f"{key}: names {len(named)} versions of {name!r} ({', '.join(map(str, named))}); "
                "a worker serves one version of a model (version_policy 'latest' with latest = "
                "1, or 'specific' with one version)"
            )
        return named[0]


class RepositoryModel(ModelConfig):
    """A model read from the repository, not from a ``[models.NAME]`` section:
    otherwise the same value, served alike. A type of its own (as ``BundledModel``)
    so errors can name where it came from (``repository.NAME.KEY``: the KEY of its
    model.toml), and the mark survives copies and pickling."""


def repository_key(name: str) -> str:
    """How errors name a repository model's settings (``repository.NAME.KEY``)."""
    return f"repository.{name}"
