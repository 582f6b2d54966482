"""Several models in one worker: ``[model]`` is the default, each ``[models.NAME]``
another model with every key ``[model]`` has, routed by input topic.

A topic belongs to one model, as a topic belongs to one lane: ``models.NAME.topics``
names a model's topics, and ``[model]`` answers the input topics no other model
names (or those its own ``topics`` lists). Every input topic is answered by
exactly one model, decided here once, before anything loads.

What several models cannot do yet is refused by name (priority lanes, durable
states in a changelog, a model reloaded while serving, the GPU engines): each
would need its own design for models that share one consumer, and a refusal is
better than a worker that half does it. A stateful model keeps its states in
memory, per model: each model's sequences are its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from worker.config.checks import as_written, check
from worker.config.model import name_of
from worker.config.pipelines import check_pipelines
from worker.flow.errors import ConfigError

if TYPE_CHECKING:
    from worker.config import Settings
    from worker.config.model import ModelConfig

#: Backends the CPU stage runs: several models are served on the CPU path only.
_CPU_BACKENDS = ("onnxruntime",)


@dataclasses.dataclass(frozen=True)
class Served:
    """One model of the worker and the input topics it answers."""

    key: str  # where it is configured: "model", or "models.NAME"
    model: ModelConfig
    topics: tuple[str, ...]


def served(s: Settings) -> tuple[Served, ...]:
    """The worker's models, the default (``[model]``) first, each with its topics
    (a model only a pipeline runs has none)."""
    named = {t for m in s.models.values() for t in m.topics}
    named |= {t for p in s.pipelines.values() for t in p.topics}
    default_topics = s.model.topics or tuple(t for t in s.kafka.input_topics if t not in named)
    out = [Served("model", s.model, default_topics)]
    for name, m in s.models.items():
        out.append(Served(f"models.{name}", m, m.topics))
    return tuple(out)


def check_models(s: Settings) -> None:
    """Every input topic answered by exactly one model; a model's name is its
    table's; several models only where the worker can serve them (see the
    module's docstring)."""
    inputs = s.kafka.input_topics
    if not s.models and not s.pipelines:
        if s.model.topics:
            _within("model.topics", s.model.topics, inputs)
            left = [t for t in inputs if t not in s.model.topics]
            check(not left, "model.topics", f"{left} in kafka.input_topics but served by no "
                  "model (leave model.topics empty to serve every input topic)")  # fmt: skip
        return
    _check_names(s.model, s.models)
    check_pipelines(s, {m.model.name if m.key == "model" else m.key.removeprefix("models."):
                        m.key for m in served(s)})  # fmt: skip
    in_pipelines = {step.model for p in s.pipelines.values() for step in p.steps}
    owner: dict[str, str] = {}
    owners = [(m.key, m.topics) for m in served(s)]
    owners += [(f"pipelines.{name}", p.topics) for name, p in s.pipelines.items()]
    for key, topics in owners:
        at = f"{key}.topics"
        if key.startswith("models.") and key.removeprefix("models.") not in in_pipelines:
            check(bool(topics), at, "names the input topics this model answers (a model only "
                  "a pipeline runs needs none)")  # fmt: skip
        elif key == "model" and s.model.topics:
            check(bool(topics), at, "names the input topics this model answers")
        _within(at, topics, inputs)
        for topic in topics:
            check(topic not in owner, at, f"{topic!r} is also {owner.get(topic)}'s: a topic "
                  "belongs to one model or pipeline")  # fmt: skip
            owner[topic] = key
    left = [t for t in inputs if t not in owner]
    check(not left, "kafka.input_topics", f"{left} answered by no model (name them in a "
          "model's topics)")  # fmt: skip
    check(bool(served(s)[0].topics) or s.model.name in in_pipelines, "model.topics",
          "[model] answers no input topic: "
          "every one is named by a [models.NAME] (give [model] one, or make one of them "
          "[model])")  # fmt: skip
    _refuse_unsupported(s)


def _within(at: str, topics: tuple[str, ...], inputs: tuple[str, ...]) -> None:
    missing = [t for t in topics if t not in inputs]
    check(not missing, at, f"{missing} not in kafka.input_topics (add them there too)")


def _check_names(default: ModelConfig, models: Mapping[str, ModelConfig]) -> None:
    for name, m in models.items():
        check(m.name == name or m.name == name_of(m.path), f"models.{name}.name",
              f"{m.name!r}: a [models.NAME] model is named by its table ({name!r})")  # fmt: skip
    check(default.name not in models, "model.name", f"{default.name!r} is also a "
          "[models.NAME]: every model needs a name of its own")  # fmt: skip


def named(s: Settings) -> tuple[tuple[Served, Settings], ...]:
    """Each model with the worker's settings as that model would run them alone
    (``[model]`` replaced, its name the table's): what its stages are built from."""
    out = []
    for model in served(s):
        name = model.key.removeprefix("models.") if model.key != "model" else model.model.name
        m = dataclasses.replace(model.model, name=name, topics=())
        out.append((model, dataclasses.replace(s, model=m, models={}, pipelines={})))
    return tuple(out)


def _refuse_unsupported(s: Settings) -> None:
    k = s.kafka
    for model in served(s):
        m = model.model
        check(m.backend in _CPU_BACKENDS, f"{model.key}.backend",
              f"{m.backend!r}: several models in one worker run on the CPU path "
              "(onnxruntime) for now")  # fmt: skip
        check(m.reload_interval_s == 0, f"{model.key}.reload_interval_s",
              "a model swapped while serving is served alone for now")  # fmt: skip
    check(not k.lanes, "kafka.lanes", "priority lanes and several models in one worker do "
          "not go together yet (one model per worker with lanes)")  # fmt: skip
    check(not k.state_topic, "kafka.state_topic", "durable states need a worker of one "
          "model and one input topic (the changelog is co-partitioned with it); with several "
          "models a stateful model keeps its states in memory")  # fmt: skip


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

