"""What the residency (``worker.app.demand``) holds of each model loaded by
demand: its stage as the residency drives it (``Resides``), what it decides by
(``Resident``: in use, last used, backlog, unloaded, its last failed load), the
memory the models share (``Pool``), and how a model's file is measured (its
stamp, to tell whether a failed load would fail again; its size, a GPU model's
weights)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from worker.compute.stage import Residence
from worker.config import Settings
from worker.model.files import resolve_model_path
from worker.model.io import EngineInfo

RETRY_S = 30.0  # a model whose load failed is tried again this often (or once its file changes)


class LoadFailed(Exception):
    """A model's load failed (now, or lately with the same file: ``Resident.failing``)."""


def file_stamp(s: Settings) -> tuple[int, int] | None:
    """The model file's size and modification time (None: not readable)."""
    try:
        st = resolve_model_path(s.model.path).stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def weights(s: Settings) -> int:
    """The model file's bytes: a GPU model's weights on the device, which its
    engine loads before its stage's start is measured."""
    stamp = file_stamp(s)
    return stamp[0] if stamp is not None else 0


class Resides(Protocol):
    """What the residency asks of a stage (``CpuStage``, ``GpuStage``)."""

    info: EngineInfo
    residence: Residence | None

    @property
    def loaded(self) -> bool: ...

    def evict(self) -> None: ...

    def load(self, engine: Any) -> int: ...  # the device bytes it took


@dataclass(eq=False)
class Resident:
    """One model loaded by demand: its stage, and what the residency decides by."""

    name: str
    stage: Resides
    settings: Settings  # the serving version's (a control record changes it)
    size: int  # bytes: the most any of its loads measured (device bytes on the GPU)
    device: bool = False  # a GPU model: its budget the device's
    pinned: bool = False
    last_used: float = 0.0  # monotonic: when its last batch ended
    in_use: int = 0  # its batches running now
    backlog: int = 0  # its topics' lag at the monitor's last poll
    refused: str | None = None  # why it is not served (a tombstone), or None
    loads: int = 0
    gate: asyncio.Future[None] | None = None  # the last batch to be let in (in order)
    # Its last load's failure: its file's stamp then, when, and why (None: none).
    failed: tuple[tuple[int, int] | None, float, str] | None = None

    def settled(self) -> bool:
        """Loaded, or not to be loaded (unloaded through the control topic)."""
        return self.loaded or self.refused is not None

    def failing(self) -> str | None:
        """Why its load failed, where trying again now would fail alike: the same
        file (its size and modification time) within ``RETRY_S`` of the failure.
        A model whose load fails must not evict the others again and again."""
        if self.failed is None:
            return None
        stamp, at, why = self.failed
        if stamp != file_stamp(self.settings) or time.monotonic() - at >= RETRY_S:
            return None
        return why

    @property
    def loaded(self) -> bool:
        return self.stage.loaded


@dataclass(frozen=True)
class Pool:
    """A memory the models share: the host's, or the GPU's on the worker's device."""

    budget: int  # bytes; 0: no budget (nothing is evicted for room)
    fixed: int  # what the models loaded for good hold of it
    name: str = "host"
