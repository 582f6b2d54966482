"""The model run once before it serves: at start-up and before a swap.

One run on zeros (a batch of the model's fixed batch size, or one row). An
engine that cannot run, or returns other outputs than it declares, fails a
swap's self-test (``worker.app.reload``). At start-up (CPU path) the run's
outputs are also held to the model's declaration, as every served run is
(``OutputPlan.check``): a model file whose output declaration does not hold is
refused before the worker joins its group, exit 2, naming the output and both
shapes (issue 37).

Free dimensions are tried at lengths 1, 2, 4, ... up to ``PROBE_LENGTHS[-1]``,
the first the model runs at is the probe's: a fully convolutional detector
whose receptive field is 12x12 fails at 1x1 and is checked at 16x16. A model
that runs at none of them is not refused (the per-run check still guards every
served run), but its declarations go unchecked before it serves: a warning
names the model (README says which models these are).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import structlog

from worker.compute.engines import Engine
from worker.flow.errors import ConfigError, InferenceFailed
from worker.model.io import ModelIO
from worker.model.outputs import OutputPlan

log = structlog.get_logger(__name__)


# The lengths free dimensions are probed at, the first the model runs at kept.
PROBE_LENGTHS: Final = tuple(2**i for i in range(10))  # 1 .. 512


def zero_feeds(io: ModelIO, length: int = 1) -> dict[str, np.ndarray]:
    """Zeros for every input: ``io.batch`` rows (one when the batch is free),
    free dimensions of ``length``."""
    rows = io.batch or 1
    feeds = {}
    for desc in io.inputs:
        row = tuple(d if isinstance(d, int) else length for d in desc.shape)
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


def check_declarations(engine: Engine, io: ModelIO, plan: OutputPlan, model: str = "") -> None:
    """Start-up: refuse (``ConfigError``, exit 2) a model whose run on zeros
    returns an output that breaks its declaration (``io``: as bound), at the
    first of ``PROBE_LENGTHS`` the model runs at; warn where it runs at none."""
    free = any(not isinstance(d, int) for desc in io.inputs for d in desc.shape)
    failure: Exception | None = None
    for length in PROBE_LENGTHS if free else (1,):
        try:
            outputs: dict[str, Any] = dict(engine.run(zero_feeds(io, length)))
        except Exception as exc:  # boundary: zeros of this length may not be a valid input
            failure = exc
            continue
        break
    else:
        log.warning(
            "startup_probe_skipped", model=model, reason=repr(failure)[:200],
            effect="its declared outputs are checked on every served run, not before it serves",
            tried=f"zeros, free dimensions of length {PROBE_LENGTHS[0]} to {PROBE_LENGTHS[-1]}"
            if free else "zeros",
        )  # fmt: skip
        return
    if length > 1:
        log.info("startup_probe", model=model, free_dimensions=length)
    for name in plan.used:
        if name in outputs:
            try:
                plan.check(name, outputs[name], io.batch or 1)
            except InferenceFailed as exc:
                at = f" (free dimensions of length {length})" if length > 1 else ""
                raise ConfigError(f"model.path: a run on zeros{at}: {exc}") from None
