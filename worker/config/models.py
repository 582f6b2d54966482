"""The models a worker serves, and which model or pipeline answers each request:
decided here once, from the settings, before anything loads.

Every served model is one kind of value (``ServedModel``): a name, where it is
configured, the input topics it answers, and the worker's settings as that model
alone would run them. ``[models.NAME]`` sections alone are a complete
configuration; ``[model]`` is the shorthand for one model (named from its path)
and, beside ``[models.NAME]``, the model answering every input topic no other
model or pipeline names. The bundled model is served only where no model is
configured at all. A model of the ``[repository]`` is in ``Settings.models`` as
read from its directory (``RepositoryModel``), served as a ``[models.NAME]``.

The routing table (``Routing``, ``routing``) is the one place a request's
answerer is decided: its topic's model or pipeline, or on ``[model]``'s topics
(the shared ones) any model or pipeline the request names.

What several models cannot do yet is refused by name (a priority lane in a
process of its own, reloading a model a pipeline runs, a changelog for a
model without a topic of its own, the GPU's CPU twin beside a GPU):
docs/guides/models.md says why for each. One model, however configured, has
all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from worker.config.checks import as_written, check
from worker.config.model import BundledModel, is_gpu_backend, name_of
from worker.config.pipelines import check_pipelines
from worker.config.repository import RepositoryModel, repository_key
from worker.flow.errors import ConfigError, InvalidRequest, UnknownModel

if TYPE_CHECKING:
    from worker.config import Settings
    from worker.config.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model of the worker: its name (results and metrics say it), where it
    is configured (``model``, ``models.NAME``, or ``repository.NAME`` for a model
    of the repository, its model.toml's keys: errors name its keys so), the
    input topics whose requests it answers when they name none, and the worker's
    settings as this model alone would run them (its stages are built from them)."""

    name: str
    key: str
    topics: tuple[str, ...]
    settings: Settings

    @property
    def config(self) -> ModelConfig:
        return self.settings.model


def served(s: Settings) -> tuple[ServedModel, ...]:
    """The worker's models, ``[model]`` first where it is served."""
    claimed = {t for m in s.models.values() for t in m.topics}
    claimed |= {t for p in s.pipelines.values() for t in p.topics}
    out: list[ServedModel] = []
    if _model_served(s):
        m = s.model
        topics = m.topics or tuple(t for t in s.kafka.input_topics if t not in claimed)
        out.append(ServedModel(m.name, "model", topics, _alone(s, m, m.name, "model")))
    for name, m in s.models.items():
        topics = m.topics
        if not topics and not out and len(s.models) == 1 and not s.pipelines:
            topics = s.kafka.input_topics  # the one model: every input topic, as [model]'s
        key = repository_key(name) if isinstance(m, RepositoryModel) else f"models.{name}"
        out.append(ServedModel(name, key, topics, _alone(s, m, name, key)))
    return tuple(out)


def as_served(s: Settings) -> Settings:
    """``s`` as the worker runs it: a worker of one model, whichever section
    configured it, runs on the settings of that model alone (``[model]`` its
    section, named as its table names it), so everything one model has (lanes,
    durable states, reload, the GPU stage) is its; several models: ``s``."""
    models = served(s)
    return models[0].settings if len(models) == 1 and not s.pipelines else s


def _model_served(s: Settings) -> bool:
    """``[model]`` is served where it is given, or where no ``[models.NAME]`` is:
    the bundled model then, unless pipelines alone answer every topic without it."""
    if not isinstance(s.model, BundledModel):
        return True
    if s.models:
        return False
    claimed = {t for p in s.pipelines.values() for t in p.topics}
    in_steps = any(step.model == s.model.name for p in s.pipelines.values() for step in p.steps)
    return in_steps or any(t not in claimed for t in s.kafka.input_topics)


def _alone(s: Settings, m: ModelConfig, name: str, key: str) -> Settings:
    """The worker's settings as model ``m`` (configured at ``key``) alone runs
    them: its state changelog (``state_topic``) the run's ``kafka.state_topic``."""
    model = dataclasses.replace(m, name=name, topics=(), state_topic="")
    kafka = s.kafka
    if m.state_topic:
        try:
            kafka = dataclasses.replace(kafka, state_topic=m.state_topic)
        except ConfigError as exc:  # the kafka section's check: named as written
            message = str(exc).replace("kafka.state_topic", f"{key}.state_topic")
            raise ConfigError(message) from None
    return dataclasses.replace(s, kafka=kafka, model=model, models={}, pipelines={})


@dataclasses.dataclass
class Routing:
    """Which model or pipeline answers a request, built once (``routing``) and
    consulted by the intake alone; the decision travels with the request
    (``Job.model``) to the stages and the writer. A model the control topic
    brings while serving grows it in place (``admit``), so every holder sees
    the same table."""

    # Each input topic's model or pipeline: it answers the requests naming none.
    owners: Mapping[str, str]
    # The topics whose requests may name any model or pipeline in ``names``.
    shared: frozenset[str]
    # Every model and pipeline a request may name, in the worker's order.
    names: tuple[str, ...]
    # For a topic not in ``owners``: one model answering every topic (tools that
    # read requests as one model would).
    fallback: str | None = None
    # The models answered on their own topics only, even where named elsewhere: a
    # model keeping durable states (its changelog co-partitioned with its topic).
    own_only: frozenset[str] = frozenset()

    @classmethod
    def one(cls, name: str) -> Routing:
        return cls({}, frozenset(), (name,), fallback=name)

    @property
    def answerers(self) -> tuple[str, ...]:
        """The models and pipelines with stages of their own (every one a request
        may reach), in the worker's order: each one's place in the backpressure."""
        owned = set(self.owners.values())
        if self.fallback is not None:
            owned.add(self.fallback)
        return tuple(n for n in self.names if n in owned or self.shared)

    def admit(self, grown: Routing) -> None:
        """Take over ``grown``: the table of the configuration with a model the
        control topic brought (``routing`` of it), which only adds to this one."""
        assert set(self.owners.items()) <= set(grown.owners.items()), "a table only grows"
        assert grown.shared == self.shared, "the shared topics are the start-up's"
        self.owners, self.names, self.own_only = dict(grown.owners), grown.names, grown.own_only

    def owner(self, topic: str) -> str:
        """The model or pipeline answering ``topic``'s requests that name none."""
        owner = self.owners.get(topic, self.fallback)
        assert owner is not None, f"{topic}: an input topic the routing table lacks"
        return owner

    def topics_of(self, name: str) -> tuple[str, ...]:
        """The topics the table names ``name`` the owner of."""
        return tuple(t for t, owner in self.owners.items() if owner == name)

    def answerer(self, topic: str, named: str | None, **echo: Any) -> str:
        """The model or pipeline answering a request read from ``topic`` naming
        ``named`` (or none); ``echo``: the request's id and meta for the error."""
        owner = self.owner(topic)
        if named is None or named == owner:
            return owner
        if named in self.names:
            if topic in self.shared and named not in self.own_only:
                return named
            raise InvalidRequest(
                f"model: {named[:64]!r} is not answered on this topic, which carries "
                f"{owner!r}'s requests only; send it to a topic {named[:64]!r} answers",
                **echo,
            )  # fmt: skip
        raise UnknownModel(
            f"model: {named[:64]!r} is not served here; this worker serves "
            f"{', '.join(repr(n) for n in self.names)}", **echo,
        )  # fmt: skip


def routing(s: Settings) -> Routing:
    """The worker's routing table (the settings are checked: ``check_models``)."""
    models = served(s)
    owners = {t: m.name for m in models for t in m.topics}
    owners |= {t: name for name, p in s.pipelines.items() for t in p.topics}
    shared = frozenset(models[0].topics if models and models[0].key == "model" else ())
    own_only = frozenset(m.name for m in models if m.settings.kafka.state_topic)
    return Routing(owners, shared, (*(m.name for m in models), *s.pipelines), own_only=own_only)


def check_models(s: Settings) -> None:
    """Every input topic answered by exactly one model or pipeline; every model
    answering something; a model's name its table's; several models only where
    the worker can serve them (the module's docstring)."""
    inputs = s.kafka.input_topics
    check(not (s.kafka.state_topic and s.model.state_topic), "model.state_topic",
          "kafka.state_topic names the changelog already: say it once")  # fmt: skip
    if not s.models and not s.pipelines:  # one model: [model], given or bundled
        if s.model.topics:
            _within("model.topics", s.model.topics, inputs)
            left = [t for t in inputs if t not in s.model.topics]
            check(not left, "model.topics", f"{left} in kafka.input_topics but served by no "
                  "model (leave model.topics empty to serve every input topic)")  # fmt: skip
        return
    models = served(s)
    _check_names(s, models)
    check_pipelines(s, {m.name: m.key for m in models})
    in_pipelines = {step.model for p in s.pipelines.values() for step in p.steps}
    shared = routing(s).shared
    owner: dict[str, str] = {}
    owners = [(m.key, m.name, m.topics) for m in models]
    owners += [(f"pipelines.{name}", name, p.topics) for name, p in s.pipelines.items()]
    for key, name, topics in owners:
        at = f"{key}.topics"
        if key not in ("model", f"pipelines.{name}") and name not in in_pipelines and not shared:
            check(bool(topics), at, "names the input topics this model answers (a model a "
                  "pipeline runs, or requests name on [model]'s topics, needs none)")  # fmt: skip
        elif key == "model":
            check(bool(topics) or name in in_pipelines, at, "[model] answers no input topic: "
                  "every one is named by a [models.NAME] or a pipeline (give [model] one of "
                  "its own, or remove [model])")  # fmt: skip
        _within(at, topics, inputs)
        for topic in topics:
            check(topic not in owner, at, f"{topic!r} is also {owner.get(topic)}'s: a topic "
                  "belongs to one model or pipeline")  # fmt: skip
            owner[topic] = key
    left = [t for t in inputs if t not in owner]
    check(not left, "kafka.input_topics", f"{left} answered by no model or pipeline (name "
          "each in a models.NAME.topics or a pipelines.NAME.topics)")  # fmt: skip
    _check_on_demand(s, models, in_pipelines)
    for model in models:  # one owner of a repository model's version: the topic's
        check(not (s.kafka.control_topic and isinstance(model.config, RepositoryModel)
                   and model.config.reload_interval_s), f"{model.key}.reload_interval_s",
              "a repository model's version is set through kafka.control_topic, not by "
              "watching its file")  # fmt: skip
    if len(models) + len(s.pipelines) > 1:
        _refuse_unsupported(s, models, in_pipelines)


def _check_on_demand(s: Settings, models: tuple[ServedModel, ...], in_pipelines: set[str]) -> None:
    """``repository.on_demand``: what a model loaded and evicted while serving
    must be (``worker.app.demand``), and every pinned model one of them."""
    repo = s.repository
    if not repo.on_demand:
        return
    names = [m.name for m in models if isinstance(m.config, RepositoryModel)]
    missing = [n for n in repo.pinned if n not in names]
    check(not missing, "repository.pinned", f"{missing} not served from the repository "
          f"(it serves {', '.join(names) or 'none'})")  # fmt: skip
    for model in models:
        if not isinstance(model.config, RepositoryModel):
            continue
        m = model.config
        why = (f"{model.name!r} is run by a pipeline's step, which holds its engine"
               if model.name in in_pipelines else
               f"{model.name!r} sets reload_interval_s: its version is its file's (the control "
               "topic sets a repository model's)" if m.reload_interval_s else None)  # fmt: skip
        check(why is None, "repository.on_demand", str(why))


def _within(at: str, topics: tuple[str, ...], inputs: tuple[str, ...]) -> None:
    missing = [t for t in topics if t not in inputs]
    check(not missing, at, f"{missing} not in kafka.input_topics (add them there too)")


def _check_names(s: Settings, models: tuple[ServedModel, ...]) -> None:
    for name, m in s.models.items():
        check(m.name == name or m.name == name_of(m.path), f"models.{name}.name",
              f"{m.name!r}: a [models.NAME] model is named by its table ({name!r})")  # fmt: skip
    if models and models[0].key == "model":
        other = s.models.get(s.model.name)
        what = "a model of the repository" if isinstance(other, RepositoryModel) else (
            "a [models.NAME]")  # fmt: skip
        check(other is None, "model.name", f"{s.model.name!r} is also {what}: every model "
              "needs a name of its own")  # fmt: skip


def _refuse_unsupported(
    s: Settings, models: tuple[ServedModel, ...], in_pipelines: set[str]
) -> None:
    """``in_pipelines``: the models a pipeline runs."""
    k = s.kafka
    twins = {m.config.backend == "gpu-twin" for m in models if is_gpu_backend(m.config.backend)}
    for model in models:
        m = model.config
        check(len(twins) < 2 or m.backend != "gpu-twin", f"{model.key}.backend",
              "'gpu-twin' beside tensorrt or torch: the worker's one device is either a "
              "GPU or its CPU twin")  # fmt: skip
        check(m.reload_interval_s == 0 or model.name not in in_pipelines,
              f"{model.key}.reload_interval_s", "a model a pipeline runs is not swapped "
              "while serving yet (the pipeline's step holds its engine)")  # fmt: skip
    alone = [i for i, lane in enumerate(k.lanes) if lane.own_process]
    check(not alone, f"kafka.lanes[{alone[0] if alone else 0}].own_process", "a lane in a "
          "process of its own serves one model's topics only for now (with several models, "
          "keep the lanes in one process)")  # fmt: skip
    check(not k.state_topic, "kafka.state_topic", "with several models, name each stateful "
          "model's changelog as its own (models.NAME.state_topic)")  # fmt: skip
    changelogs: dict[str, str] = {}
    for model in models:
        topic = model.settings.kafka.state_topic
        if not topic:
            continue
        at = f"{model.key}.state_topic"
        check(len(model.topics) == 1 and model.name not in in_pipelines, at, "durable states "
              "need the model's one input topic of its own, which the changelog is "
              "co-partitioned with (a model a pipeline runs has none)")  # fmt: skip
        check(topic not in (*k.input_topics, k.output_topic, k.dlq_topic), at,
              "must be a topic of its own (compacted; states only)")  # fmt: skip
        check(topic not in changelogs, at, f"{topic!r} is also {changelogs.get(topic)}'s: "
              "each stateful model keeps a changelog of its own")  # fmt: skip
        changelogs[topic] = at


@contextlib.contextmanager
def settings_named(key: str) -> Iterator[None]:
    """A configuration error raised while ``[models.NAME]`` loads or binds names
    its keys as they are written (``models.NAME.inputs...``, not ``model.inputs...``):
    the checks of a model section say ``model.``, whichever table it came from."""
    try:
        yield
    except ConfigError as exc:
        if key == "model":
            raise
        raise ConfigError(as_written(str(exc), key)) from exc
