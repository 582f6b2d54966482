"""Repository models' versions set through the control topic (issue 68): every
member reads ``kafka.control_topic`` alike (``worker.kafka.control``) and serves
each model at the version its last record names, swapped in while serving as a
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
JSON. A tombstone is logged: unloading a model is not built; it keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import structlog

from worker.app.loading import LoadedModel
from worker.app.reload import swap, swap_refused, swapped
from worker.compute.cpu import CpuStage
from worker.compute.stage import Stage
from worker.config import Settings
from worker.config.model import is_gpu_backend
from worker.config.repository import RepositoryModel
from worker.config.repository_files import load_version, scan
from worker.flow.errors import BrokerUnavailable, ConfigError
from worker.kafka.control import follow
from worker.model.files import content_version, resolve_model_path
from worker.obs import metrics

log = structlog.get_logger(__name__)


@dataclass
class Controlled:
    """A repository model the control topic may set the version of."""

    settings: Settings  # the model's own (LoadedModel.settings)
    stage: CpuStage
    serving: str  # the content hash of the version serving
    labels: dict[str, str]  # its infer_build_info labels but the version


def desired_version(value: bytes | None) -> int | None:
    """A record's version (None: a tombstone); ValueError saying why not one."""
    if not value:
        return None
    try:
        state = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    version = state.get("version") if isinstance(state, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f'{value[:80]!r}: expected {{"version": N}}, N a version directory '
                         "(a positive integer)")  # fmt: skip
    return version


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

    async def run(self) -> None:
        await follow(self._s.kafka, self.apply, self.ready)

    async def apply(self, name: str, value: bytes | None) -> None:
        try:
            version = desired_version(value)
        except ValueError as exc:
            return self._refuse(name, str(exc))
        model = self._models.get(name)
        if model is None:
            why = self._refused.get(name, "not a model this worker serves")
            return self._refuse(name, why)
        if version is None:
            log.warning("model_control_tombstone", model=name, serving=model.serving,
                        reason="unloading a model is not built: it keeps serving")  # fmt: skip
            return None
        try:
            cfg = await asyncio.to_thread(self._version, name, version)
            hash_ = await asyncio.to_thread(content_version, resolve_model_path(cfg.path))
        except (ConfigError, OSError) as exc:
            return self._refuse(name, f"version {version}: {exc}")
        if hash_ == model.serving:
            log.info("model_control_serving", model=name, version=version, serving=hash_)
            return None
        problem = await swap(dataclasses.replace(model.settings, model=cfg), model.stage, hash_)
        if problem is not None:
            swap_refused(name, hash_, f"version {version}: {problem}", model.serving)
            return None
        swapped(name, model.serving, hash_, model.labels)
        model.serving = hash_
        log.info("model_control_applied", model=name, version=version, serving=hash_)
        return None

    def _version(self, name: str, version: int) -> RepositoryModel:
        """The model's version ``version`` as the repository holds it now."""
        entry = next((e for e in scan(self._s.repository) if e.name == name), None)
        if entry is None:
            raise ConfigError(f"{name!r} is no longer in {self._s.repository.path}")
        if version not in entry.versions:
            raise ConfigError(f"not in {entry.directory} (it holds "
                              f"{', '.join(map(str, entry.versions))})")  # fmt: skip
        return load_version(entry, version)

    @staticmethod
    def _refuse(name: str, why: str) -> None:
        log.error("model_control_refused", model=name, reason=why)
        metrics.MODEL_SWAPS.labels(outcome="refused").inc()


def controlled(s: Settings, models: Sequence[LoadedModel], stages: Mapping[str, Stage],
               device_name: str) -> Control:  # fmt: skip
    """The worker's side of the control topic: which of its models the topic
    may set the version of, and why not the others."""
    from worker import __version__

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
            ok[m.name] = Controlled(m.settings, cast(CpuStage, stage), info.version, labels)
    return Control(s, ok, refused)


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
