"""Repository models' versions set through the control topic (issue 68): every
member reads ``kafka.control_topic`` alike (``worker.kafka.control``) and serves
each model at the version its last record names (that it did not refuse),
swapped in while serving as a
reloaded file is (``worker.app.reload``: loaded beside the serving version,
bound, checked and run once, then swapped in between batches; no rebalance,
no partition paused, in-flight batches finish on the old version). A version
that fails any check is refused (``model_swap_refused``,
``infer_model_swaps_total{outcome="refused"}``) and the serving one goes on.

A record's value is ``{"version": N}``: N a version directory of the model in
the repository (``REPO/NAME/N/``, read again when the record comes: a version
added after start-up can be named). Refused, each logged with why: a record for
a model this worker does not serve from the repository on the CPU path (a
configured model, a GPU model, a model a pipeline's step runs: its step holds
its engine), a version the repository does not hold, a value that is not such
JSON.

A tombstone unloads the model (``worker.app.demand.Residency.unload``): its
batches already running finish, its memory is freed, and its requests are then
answered ``unknown_model`` saying it is unloaded; a record naming a version
loads it again (that version). With ``repository.on_demand`` the same models are
also loaded and evicted by demand, and a version swapped in is given room first.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import structlog

from worker import __version__
from worker.app.arrivals import Arrivals
from worker.app.demand import Residency, residency
from worker.app.desired import Desired, carried, checked_settings, desired_state, kept_topics
from worker.app.loading import LoadedModel
from worker.app.reload import swap, swap_refused, swapped
from worker.app.stages import Stages
from worker.compute.cpu import CpuStage
from worker.compute.stage import Stage
from worker.config import Settings
from worker.config.model import ModelConfig, is_gpu_backend
from worker.config.repository import RepositoryModel
from worker.config.repository_files import listing, load_version, scan
from worker.flow.errors import BrokerUnavailable, ConfigError
from worker.kafka.control import follow, write
from worker.model.files import content_version, resolve_model_path
from worker.obs import demand as demand_metrics
from worker.obs import metrics

log = structlog.get_logger(__name__)


@dataclass
class Controlled:
    """A repository model the control topic may set the version of."""

    settings: Settings  # the model's own (LoadedModel.settings)
    stage: CpuStage
    serving: str  # the content hash of the version serving
    labels: dict[str, str]  # its infer_build_info labels but the version
    # The serving version's configuration as the model runs it (its model.toml's
    # keys and a record's): a record naming the same is applied already.
    config: ModelConfig
    topics: tuple[str, ...] = ()  # the input topics it answers (set when it came)


class Control:
    """The worker's side of the control topic: records applied one at a time."""

    def __init__(self, s: Settings, models: Mapping[str, Controlled],
                 refused: Mapping[str, str]) -> None:  # fmt: skip
        """``models``: those the topic may set, by name; ``refused``: the other
        models the worker serves, each with why the topic may not."""
        self._s = s
        self._models = dict(models)
        self._refused = dict(refused)
        self.ready = asyncio.Event()  # the topic read to its end and applied
        self.topic = s.kafka.control_topic
        self._loop: asyncio.AbstractEventLoop | None = None
        # Where each model's memory is held (set by the worker before ``run``):
        # a tombstone unloads through it, a swap is given room by it.
        self.residency: Residency | None = None
        # Each model's version number serving (the policy's at start), for the index.
        held = listing(s.repository) if s.repository.path else ()
        self._numbers = {v.name: v.version for v in held if v.served}
        # Why each version a record named was refused (the index says so), by model.
        self._failed: dict[tuple[str, int], str] = {}
        # Brings a repository model this worker does not serve (set by the worker
        # where the control topic may: ``worker.app.arrivals``).
        self.arrivals: Arrivals | None = None
        self._last: dict[str, bytes | None] = {}  # each model's last record (an OIP load's base)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        await follow(self._s.kafka, self._applied, self.ready)

    async def _applied(self, name: str, value: bytes | None) -> bool:
        """``apply``, whatever a record holds: an unexpected failure refuses that
        record (every member replays the topic: one record must not stop them all)."""
        self._last[name] = value
        try:
            return await self.apply(name, value)
        except Exception as exc:  # the record's, refused; the worker goes on
            self._refuse(name, f"{type(exc).__name__}: {exc}")
            return False

    @property
    def names(self) -> tuple[str, ...]:
        """The models the topic may set."""
        return tuple(self._models)

    def serving(self) -> dict[str, str]:
        """Each model the topic may set: the version (content hash) serving."""
        return {name: m.serving for name, m in self._models.items()}

    def index(self) -> list[dict[str, Any]]:
        """The OIP repository index (``worker.obs.repository``): every version of
        every repository model, READY where this member serves it."""
        ready = metrics.is_ready()
        out = []
        try:
            versions = listing(self._s.repository)
        except ConfigError as exc:  # mid-upload, say: the index says so, per model unknown
            return [{"name": "", "version": "", "state": "UNAVAILABLE", "reason": str(exc)}]
        for v in versions:
            serving = self._numbers.get(v.name)
            resident = self.residency.get(v.name) if self.residency is not None else None
            if resident is not None and resident.refused is not None:
                state, reason = "UNAVAILABLE", "unloaded (a tombstone on the control topic)"
            elif serving == v.version:
                state, reason = ("READY" if ready else "UNAVAILABLE"), ""
            else:
                state = "UNAVAILABLE"
                reason = (f"version {serving} serves" if serving is not None
                          else "not served by this worker")  # fmt: skip
                if (failed := self._failed.get((v.name, v.version))) is not None:
                    reason = f"refused: {failed}; {reason}"
            out.append({"name": v.name, "version": str(v.version), "state": state,
                        "reason": reason})  # fmt: skip
        return out

    def load(self, name: str, version: int | None, settings: object = None) -> str | None:
        """An OIP load (``worker.obs.repository``, from the metrics port's
        thread): ``name``'s version (None: the latest the repository holds),
        with ``settings`` over its model.toml (None: none), written to the
        control topic for every member; why not, or None."""
        try:
            held = [v.version for v in listing(self._s.repository) if v.name == name]
        except ConfigError as exc:
            return str(exc)
        if not held:
            return f"{name!r} is not a model of the repository ({self._s.repository.path})"
        version = max(held) if version is None else version
        if version not in held:
            return f"{name!r} has no version {version} (it holds {', '.join(map(str, held))})"
        try:
            given = checked_settings(settings) if settings is not None else {}
            served = self._models.get(name)
            if served is not None and (moved := kept_topics(name, given, served.topics)):
                raise ValueError(moved)
            self._version(name, version, given)  # the keys build as a record's will
        except (ValueError, ConfigError) as exc:
            return f"parameters.{exc}" if str(exc).startswith("settings") else str(exc)
        return self._write(name, carried(Desired(version, given), self._last.get(name)).value())

    def unload(self, name: str) -> str | None:
        """An OIP unload (as ``load``): a tombstone for ``name`` written to the
        control topic for every member; why not, or None."""
        try:
            held = any(v.name == name for v in listing(self._s.repository))
        except ConfigError as exc:
            return str(exc)
        if not held:
            return f"{name!r} is not a model of the repository ({self._s.repository.path})"
        return self._write(name, None)

    def _write(self, name: str, state: dict[str, object] | None) -> str | None:
        """``state`` written for ``name`` from the metrics port's thread; why not, or None."""
        if name not in self._models and (name in self._refused or self.arrivals is None):
            return f"{name!r}: {self._refused.get(name, 'not a model this worker serves')}"
        if self._loop is None:
            return "the worker does not read its control topic yet"
        try:
            wrote = asyncio.run_coroutine_threadsafe(
                write(self._s.kafka, name, state), self._loop)  # fmt: skip
        except RuntimeError:  # the worker is stopping: its loop is closed
            return "the worker is stopping"
        try:
            wrote.result(timeout=self._s.kafka.request_timeout_s + 5.0)
        except Exception as exc:  # any: the caller is told, the worker goes on
            wrote.cancel()  # not written later, after the caller was told it was not
            return f"{self.topic!r} did not take the record: {exc!r}"
        return None

    async def apply(self, name: str, value: bytes | None) -> bool:
        """One record applied; whether it took effect (False: refused)."""
        try:
            desired = desired_state(value)
        except ValueError as exc:
            return self._refuse(name, str(exc))
        version, overrides = desired.version, desired.settings
        model = self._models.get(name)
        if model is None and name not in self._refused and self.arrivals is not None:
            return await self._arrive(name, version, overrides)
        if model is None:
            why = self._refused.get(name, "not a model this worker serves")
            return self._refuse(name, why)
        if (moved := kept_topics(name, overrides, model.topics)) is not None:
            return self._refused_version(name, version or 0, moved)
        resident = self.residency.get(name) if self.residency is not None else None
        assert self.residency is not None and resident is not None, "set before run()"
        if version is None:
            why = (f"model {name!r} is unloaded (a tombstone on {self.topic!r}); "
                   f"`infer-worker models load {name} --version N` loads it again")  # fmt: skip
            await self.residency.unload(name, why)
            log.info("model_control_unloaded", model=name, serving=model.serving)
            return True
        try:
            cfg = await asyncio.to_thread(self._version, name, version, overrides)
            hash_ = await asyncio.to_thread(content_version, resolve_model_path(cfg.path))
        except (ConfigError, OSError) as exc:
            return self._refused_version(name, version, str(exc))
        if is_gpu_backend(cfg.backend):
            return self._refused_version(name, version, f"its model.toml names the GPU backend "
                                         f"{cfg.backend!r}; a version swaps in on the CPU path "
                                         "only")  # fmt: skip
        more = tuple(overrides.get("topics", ()))
        grow = None  # more topics for it: checked now, read once the version is applied
        if set(more) - set(model.topics):
            try:
                if self.arrivals is None:
                    raise ConfigError("settings.topics: this worker's models take no more topics")
                grow = await self.arrivals.more_topics(name, more)
            except ConfigError as exc:
                return self._refused_version(name, version, str(exc))
        # As the model's own settings hold it (``worker.config.models.ServedModel``):
        # its topics and changelog are the worker's routing's, not its alone.
        alone = dataclasses.replace(cfg, topics=(), state_topic="")
        settings = dataclasses.replace(model.settings, model=alone)
        if alone == model.config:
            if resident.refused is not None:  # unloaded: loaded again, served again
                await self.residency.served(name)
            await self._read_more(model, more, grow)
            self._numbers[name] = version
            log.info("model_control_serving", model=name, version=version, serving=hash_)
            return True
        problem = await self.residency.swapping(
            name, lambda: swap(settings, model.stage, hash_), settings)  # fmt: skip
        if problem is not None:
            swap_refused(name, hash_, f"version {version}: {problem}", model.serving)
            self._failed[name, version] = problem
            return False
        await self._read_more(model, more, grow)
        resident.settings, resident.refused = settings, None  # loaded by demand at this version
        swapped(name, model.serving, hash_, model.labels)
        model.serving, model.config = hash_, alone
        self._numbers[name] = version
        self._failed.pop((name, version), None)
        log.info("model_control_applied", model=name, version=version, serving=hash_)
        return True

    @staticmethod
    async def _read_more(model: Controlled, topics: tuple[str, ...],
                         grow: Callable[[], Awaitable[None]] | None) -> None:  # fmt: skip
        if grow is not None:
            await grow()
            model.topics = topics

    async def _arrive(self, name: str, version: int | None, overrides: dict[str, Any]) -> bool:
        """A repository model this worker does not serve, brought by a record
        (``worker.app.arrivals``); a tombstone for one changes nothing."""
        assert self.arrivals is not None
        if version is None:
            log.info("model_control_unloaded", model=name, serving=None)
            return True
        try:
            cfg = await asyncio.to_thread(self._version, name, version, overrides)
            came = await self.arrivals.arrive(cfg)
        except Exception as exc:  # the record's (config, load, bind, probe): refused
            why = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            return self._refused_version(name, version, why)
        labels = {"version": __version__, "model": name, "backend": came.stage.infer.info.backend,
                  "device": self.arrivals.device_name}  # fmt: skip
        alone = dataclasses.replace(cfg, topics=(), state_topic="")
        self._models[name] = Controlled(came.settings, cast(CpuStage, came.stage.infer),
                                        came.version, labels, alone, came.topics)  # fmt: skip
        self._numbers[name] = version
        self._failed.pop((name, version), None)
        log.info("model_control_applied", model=name, version=version, serving=came.version,
                 came=True)  # fmt: skip
        return True

    def _version(self, name: str, version: int, overrides: dict[str, Any]) -> RepositoryModel:
        """The model's version ``version`` as the repository holds it now, with
        a record's settings over its model.toml's."""
        entry = next((e for e in scan(self._s.repository) if e.name == name), None)
        if entry is None:
            raise ConfigError(f"{name!r} is no longer in {self._s.repository.path}")
        if version not in entry.versions:
            raise ConfigError(f"not in {entry.directory} (it holds "
                              f"{', '.join(map(str, entry.versions))})")  # fmt: skip
        return load_version(entry, version, overrides)

    def _refused_version(self, name: str, version: int, why: str) -> bool:
        """A record's version refused: said as any refusal, and kept for the
        index (its status there says why: a load that failed is reported)."""
        self._failed[name, version] = why
        return self._refuse(name, f"version {version}: {why}")

    @staticmethod
    def _refuse(name: str, why: str) -> bool:
        log.error("model_control_refused", model=name, reason=why)
        metrics.MODEL_SWAPS.labels(outcome="refused").inc()
        return False


def controlled(s: Settings, models: Sequence[LoadedModel], stages: Mapping[str, Stage],
               device_name: str) -> Control:  # fmt: skip
    """The worker's side of the control topic: which of its models the topic
    may set the version of, and why not the others."""
    in_pipelines = {step.model for p in s.pipelines.values() for step in p.steps if step.model}
    ok: dict[str, Controlled] = {}
    refused: dict[str, str] = {}
    for m in models:
        stage = stages.get(m.name)
        if not isinstance(m.settings.model, RepositoryModel):
            refused[m.name] = "a configured model: its version is its file's (not the repository's)"
        elif m.name in in_pipelines:
            refused[m.name] = "a pipeline's step runs it (the step holds its engine)"
        elif is_gpu_backend(m.settings.model.backend) or stage is None:
            refused[m.name] = "on the GPU: its engines are compiled and captured per slot at start"
        else:  # the CPU path: its own stage a CpuStage (worker.app.inference)
            info = m.engine.info
            labels = {"version": __version__, "model": info.name, "backend": info.backend,
                      "device": device_name}  # fmt: skip
            ok[m.name] = Controlled(m.settings, cast(CpuStage, stage), info.version, labels,
                                    m.settings.model, m.topics)  # fmt: skip
    return Control(s, ok, refused)


def controls(s: Settings, configured: Settings, models: Sequence[LoadedModel], stages: Stages,
             device_name: str) -> tuple[Control | None, Residency | None]:  # fmt: skip
    """Before Kafka is contacted (``run`` and ``config`` alike): the control
    topic's side (with ``kafka.control_topic``) and the residency of the models
    it may unload and of those loaded by demand, settled (the GPU's budget:
    exit 2 where it cannot hold them). ``configured``: the worker's
    configuration, which models the control topic brings grow (where
    ``stages.grow``: ``worker.app.arrivals``)."""
    demand_metrics.declare(m.name for m in models)
    by_name = {m.name: m.infer for m in stages.models}
    control = controlled(s, models, by_name, device_name) if s.kafka.control_topic else None
    held = residency(s, models, by_name, control.names if control else (), stages.device_memory,
                     grows=stages.grow is not None)  # fmt: skip
    if held is not None:
        held.settle()
    if control is not None:
        control.residency = held
        if stages.grow is not None and held is not None:
            control.arrivals = Arrivals(configured, models, stages, held, device_name)
    return control, held


async def converged(control: Control, task: asyncio.Task[None], timeout_s: float) -> None:
    """Once the control topic is read to its end and applied (the worker then
    serves what the other members serve from its first answer); the reading
    task's failure raised, or BrokerUnavailable after ``timeout_s``."""
    ready = asyncio.ensure_future(control.ready.wait())
    try:
        await asyncio.wait({ready, task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ready.cancel()
    if task.done():
        task.result()  # its failure, raised here
    if not control.ready.is_set():
        raise BrokerUnavailable(f"kafka.control_topic: {control.topic!r} was not read to its "
                                f"end within {timeout_s:.0f} s")  # fmt: skip
