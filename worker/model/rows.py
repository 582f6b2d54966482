"""One request as the inference stage works on it: a ``Row``.

The ``Job`` a stage receives is frozen; what the stage does to a request before
it has an ``Answer`` (its inputs prepared: files decoded, texts tokenized; the
lengths tokenizing tells; the engine runs it took part in; its outputs or its
error; the time each step took) is written here, by the stage alone, one step
after another (a worker thread's step is awaited before the next begins). A
row is never handed on: the stage turns it into the frozen ``Answer`` that goes
downstream (``answer``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from worker.flow.messages import Answer, Job, StateChange
from worker.flow.values import ErrorInfo


class Row(msgspec.Struct):
    """A msgspec Struct: one per request (0.5 us to make as a slotted dataclass)."""

    job: Job
    # The request's inputs by request input name, as the stage prepares them (an
    # image file until decoded, then its pixels; a text, then its tokens).
    values: dict[str, Any]
    # Lengths of the request's free dimensions, by symbol (a text's once tokenized).
    lengths: dict[str, int]
    timing_us: dict[str, int] = msgspec.field(default_factory=dict)
    outputs: dict[str, np.ndarray] | None = None
    error: ErrorInfo | None = None
    attempts: int = 0  # engine runs it took part in that failed
    state: StateChange | None = None  # a stateful model's sequence after this row ran

    @classmethod
    def of(cls, job: Job) -> Row:
        return cls(job, dict(job.inputs), dict(job.lengths))

    def answer(self) -> Answer:
        """What goes downstream: the outcome, frozen."""
        return Answer(self.job, self.outputs, self.error, self.timing_us, self.state)
