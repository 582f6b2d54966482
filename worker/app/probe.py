"""The model run once before it serves: at start-up and before a swap.

One run on zeros (a batch of the model's fixed batch size, or one row; free
dimensions of length 1). An engine that cannot run, or returns other outputs
than it declares, fails a swap's self-test (``worker.app.reload``). At start-up
(CPU path) the run's outputs are also held to the model's declaration, as every
served run is (``OutputPlan.check``): a model file whose output declaration
does not hold is refused before the worker joins its group, exit 2, naming the
output and both shapes (issue 37). A start-up run that fails on zeros is not a
refusal (some models need inputs longer than one): the per-run check still
guards every served run, so it is logged, not fatal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import structlog

from worker.compute.engines import Engine
from worker.flow.errors import ConfigError, InferenceFailed
from worker.model.io import ModelIO
from worker.model.outputs import OutputPlan

log = structlog.get_logger(__name__)


def zero_feeds(io: ModelIO) -> dict[str, np.ndarray]:
    """Zeros for every input: ``io.batch`` rows (one when the batch is free),
    free dimensions of length 1."""
    rows = io.batch or 1
    feeds = {}
    for desc in io.inputs:
        row = tuple(d if isinstance(d, int) else 1 for d in desc.shape)
        shape = row if desc.batch_axis is None else (*row[: desc.batch_axis], rows,
                                                     *row[desc.batch_axis :])  # fmt: skip
        feeds[desc.name] = np.zeros(shape, desc.dtype)
    return feeds


def self_test(engine: Engine) -> str | None:
    """Why ``engine`` cannot serve (its run on zeros fails, or lacks a declared
    output), or None."""
    try:
        outputs = engine.run(zero_feeds(engine.info.io))
    except Exception as exc:  # boundary: whatever the runtime raises on a bad model
        return f"its self-test run failed: {exc!r}"[:500]
    missing = set(engine.info.output_names) - set(outputs)
    return f"its self-test run returned no {sorted(missing)}" if missing else None


def check_declarations(engine: Engine, io: ModelIO, plan: OutputPlan) -> None:
    """Start-up: refuse (``ConfigError``, exit 2) a model whose run on zeros
    returns an output that breaks its declaration (``io``: as bound)."""
    try:
        outputs: dict[str, Any] = dict(engine.run(zero_feeds(io)))
    except Exception as exc:  # boundary: zeros of length 1 may not be a valid input
        log.info("startup_probe_skipped", reason=repr(exc)[:200])
        return
    for name in plan.used:
        if name in outputs:
            try:
                plan.check(name, outputs[name], io.batch or 1)
            except InferenceFailed as exc:
                raise ConfigError(f"model.path: a run on zeros: {exc}") from None
