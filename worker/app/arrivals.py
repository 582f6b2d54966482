"""Models that come while serving (issue 68): a control record naming a model of
the repository this worker does not serve (added to the repository after
start-up, or left out by ``repository.models``) brings it, on every member alike.

The model is one more ``[models.NAME]`` of the configuration: the configuration
grown by it is checked as the start-up one is (``Settings``' own checks: its
topics answered by it alone, its name its own, what several models cannot do
refused by name), so a record can bring only what a configuration could have
started with. Its topics are the record's ``settings.topics``, else its
``model.toml``'s; without any it answers requests naming it on ``[model]``'s
topics (the shared ones). Its topics must exist; reading them grows the group's
subscription, which is a rebalance (every member's partitions revoked and
settled as in any rebalance: nothing lost, nothing answered twice).

It is loaded and measured (room made for it first where models share memory
by demand; without ``repository.on_demand``, refused where it does not fit
``limits.max_models_memory_mb`` beside the loaded models), bound and probed as
at start-up, its stages built and joined to the running ones
(``worker.app.stages.admit``), and from then on it is a model as any: the
control topic sets its version, unloads it, and loads it by demand.

Refused, the record logged with why and the worker serving on: a GPU backend
(versions swap on the CPU path), a changelog (``state_topic``: a stateful model's
restore is wired at start-up), a worker with ``schema_registry`` (the result
schema is registered at start-up), topics with ``kafka.lanes`` (a topic's lane is
the configuration's).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, cast

import structlog

from worker import __version__
from worker.app import cards
from worker.app.loading import LoadedModel, load_one, sized
from worker.app.memory import MIB
from worker.app.residents import Resident, Resides, weights
from worker.app.stages import ModelStages, Stages, admit, paused_apart
from worker.config import Settings
from worker.config.model import ModelConfig, is_gpu_backend
from worker.config.models import Routing, routing, served
from worker.config.repository import RepositoryModel
from worker.config.topics import NeededTopic
from worker.flow.errors import ConfigError
from worker.kafka.permissions import check_topics
from worker.obs import demand as demand_metrics
from worker.obs import metrics

if TYPE_CHECKING:
    from worker.app.demand import Residency

log = structlog.get_logger(__name__)


def grows(s: Settings) -> bool:
    """Whether the control topic may bring models to a worker configured by ``s``:
    its repository's (the bundled model is served only where no model is
    configured, a repository's either)."""
    return bool(s.kafka.control_topic and s.repository.path and s.models)


def answered(s: Settings, table: Routing) -> Settings:
    """``s`` with each ``[models.NAME]`` that names no topics given those it
    answers (a lone model answers every input topic): beside another model it
    answers the same ones."""
    models = {name: m if m.topics else dataclasses.replace(m, topics=table.topics_of(name))
              for name, m in s.models.items()}  # fmt: skip
    return dataclasses.replace(s, models=models)


def with_model(s: Settings, name: str, cfg: ModelConfig) -> Settings:
    """``s`` with ``cfg`` as its ``[models.NAME]`` (added, or replacing that
    one), its topics read too: checked as any configuration is (``ConfigError``)."""
    inputs = s.kafka.input_topics
    kafka = dataclasses.replace(s.kafka, input_topics=(
        *inputs, *(t for t in cfg.topics if t not in inputs)))  # fmt: skip
    return dataclasses.replace(s, kafka=kafka, models={**s.models, name: cfg})


@dataclasses.dataclass(frozen=True)
class Arrived:
    """A model brought: its settings as it runs, its inference stage, its version
    (content hash) and its topics."""

    settings: Settings
    stage: ModelStages
    version: str
    topics: tuple[str, ...]


class Arrivals:
    """The worker's side of the models the control topic brings."""

    def __init__(self, configured: Settings, models: Sequence[LoadedModel], stages: Stages,
                 residency: Residency, device_name: str) -> None:  # fmt: skip
        """``configured``: the worker's configuration (every model's, not one
        model's alone); ``models``: those loaded at start-up (their sizes)."""
        self.current = answered(configured, stages.routing)
        self._stages = stages
        self._residency = residency
        self._sizes = {m.name: m.size for m in models}
        self.device_name = device_name
        # Runs a brought model's batcher and inference stage, once the worker's run
        # (set by the worker then; before it, they run with the start-up ones).
        self.run: Callable[[ModelStages], None] | None = None

    async def arrive(self, cfg: RepositoryModel) -> Arrived:
        """``cfg`` (a version of a repository model, with a record's settings)
        loaded and served; ``ConfigError`` saying why not (nothing changed)."""
        name, s = cfg.name, self.current
        for refused, why in (
            (is_gpu_backend(cfg.backend), f"its backend {cfg.backend!r} is a GPU's: a model "
             "comes on the CPU path"),
            (bool(cfg.state_topic), "state_topic: a stateful model's changelog is wired at "
             "start-up"),
            (bool(s.schema_registry.url), "schema_registry: the result schema is registered at "
             "start-up, with the models served then"),
            (bool(cfg.topics and s.kafka.lanes), "topics: with kafka.lanes, a topic's lane is "
             "the configuration's (a model that comes may answer by name on the shared topics)"),
        ):  # fmt: skip
            if refused:
                raise ConfigError(f"{name!r} cannot come while serving: {why}")
        grown = with_model(s, name, cfg)
        table = self._only_adds(grown)
        await self._check_topics(grown, cfg.topics)
        model = next(m for m in served(grown) if m.name == name)
        loaded: list[LoadedModel] = []
        made: list[ModelStages] = []

        async def load() -> tuple[Resident, float]:
            started = time.monotonic()
            engine, size = await load_one(model)
            one = LoadedModel(name, model.key, model.topics, sized(model, engine), engine, size,
                              on_demand=grown.repository.on_demand)  # fmt: skip
            loaded.append(one)
            self._fits(grown, name, size)
            made.append(await admit(self._stages, one, table))
            if self.run is not None:  # at once (no await since it joined): stop() drains it
                self.run(made[0])
            r = Resident(name, cast(Resides, made[0].infer), one.settings, size)
            return r, time.monotonic() - started

        try:
            await self._residency.arrive(weights(model.settings), load)
        except BaseException:
            if not made:  # (joined, its engine is the residency's to close)
                for one in loaded:
                    one.engine.close()
            raise
        one, stage = loaded[0], made[0]
        self.current, self._sizes[name] = grown, one.size
        info = one.engine.info
        metrics.BUILD_INFO.labels(version=__version__, model=name, backend=info.backend,
                                  device=self.device_name,
                                  model_version=info.version).set(1)  # fmt: skip
        cards.publish(info)
        demand_metrics.declare([name])
        if model.topics:  # (outside the residency: the settling waits on its batches)
            await self._stages.consumer.subscribe_more(model.topics)
        log.info("model_arrived", model=name, version=info.version, topics=list(model.topics),
                 size_mib=round(one.size / MIB, 1))  # fmt: skip
        return Arrived(one.settings, stage, info.version, model.topics)

    async def more_topics(self, name: str, topics: tuple[str, ...]
                          ) -> Callable[[], Awaitable[None]]:  # fmt: skip
        """``topics`` for the served ``name`` (its own among them), checked as a
        configuration would be and existing; what reads them once called (its
        record's version applied): the routing table grown, the new topics
        paused on the model's counts, the subscription grown (a rebalance).
        ``ConfigError`` saying why not."""
        s = self.current
        cfg = s.models.get(name)
        if cfg is None:
            raise ConfigError(f"settings.topics: {name!r} is [model]: its topics are the "
                              "configuration's")  # fmt: skip
        if s.kafka.lanes:
            raise ConfigError("settings.topics: with kafka.lanes, a topic's lane is the "
                              "configuration's")  # fmt: skip
        new = tuple(t for t in topics if t not in cfg.topics)
        grown = with_model(s, name, dataclasses.replace(cfg, topics=topics))
        table = self._only_adds(grown)
        await self._check_topics(grown, new)
        stage = next(m for m in self._stages.models if m.name == name)

        async def read() -> None:
            paused_apart(self._stages, stage, new, like=next(iter(cfg.topics), None))
            self._stages.routing.admit(table)
            stage.topics, self.current = topics, grown
            log.info("model_topics_added", model=name, topics=list(new))
            await self._stages.consumer.subscribe_more(new)

        return read

    def _only_adds(self, grown: Settings) -> Routing:
        """``grown``'s routing table, where it only adds to the serving one: a
        topic another model answers (``[model]``'s too, which answers every input
        topic no other names) stays its (``ConfigError`` otherwise)."""
        table, now = routing(grown), self._stages.routing
        taken = {t: owner for t, owner in now.owners.items() if table.owners.get(t) != owner}
        if taken or table.shared != now.shared:
            raise ConfigError(f"topics: {sorted(taken or now.shared)} answered already "
                              f"({', '.join(f'{t}: {o!r}' for t, o in taken.items())}); a record "
                              "gives a model topics no model answers")  # fmt: skip
        return table

    async def _check_topics(self, grown: Settings, topics: Sequence[str]) -> None:
        """The model's topics exist, and this principal may read them."""
        if not topics:
            return
        writer = self._stages.writer
        existing = await writer.existing_topics()
        missing = [t for t in topics if t not in existing]
        if missing:
            raise ConfigError(f"topics: {missing} do not exist (create them, then write the "
                              "record again)")  # fmt: skip
        if grown.kafka.security_protocol != "PLAINTEXT" and writer.producer is not None:
            needed = [NeededTopic(t, "topics", 1, use="read") for t in topics]
            await check_topics(writer.producer.client, grown.kafka, needed)

    def _fits(self, s: Settings, name: str, size: int) -> None:
        """Without ``repository.on_demand``: the models loaded and this one within
        ``limits.max_models_memory_mb`` (by demand, the residency makes room)."""
        budget = s.limits.max_models_memory_mb * MIB
        held = sum(self._sizes.values())
        if s.repository.on_demand or not budget or held + size <= budget:
            return
        raise ConfigError(f"limits.max_models_memory_mb: {name!r} holds {size / MIB:.0f} MiB, "
                          f"over the budget of {budget / MIB:.0f} MiB beside the loaded models' "
                          f"{held / MIB:.0f} MiB (repository.on_demand = true shares "
                          "it)")  # fmt: skip

