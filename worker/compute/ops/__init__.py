"""A pipeline's built-in operations (``op = "NAME"`` steps), in one registry:
adding one is a module here and a line in ``OPS``.

Each op says the inputs it takes, the step keys it reads (any other op key set
on its step is refused, naming it), whether it fans out, how its inputs are
checked once the models load (returning its outputs' dtypes and one request's
shapes, as a function step declares them), the NumPy function a step runs (one
request, or one region, at a time), and its GPU form where it has one (a
step's rows at once, by the CuPy kernels: ``device``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from worker.compute.ops.device import Batched, DeviceOps
from worker.config.pipelines import Spec, StepConfig
from worker.flow.errors import ConfigError

Desc = tuple[str, tuple[int | str | None, ...]]  # dtype name, one request's shape
# A per-region tensor's dtype and shape, a free dimension 0 (None: not known before it
# runs): what a request without regions is answered with, empty ([0, ...], its rank).
Regional = tuple[str, tuple[int, ...]] | None
# The step's checks once the models load: where it is configured, its settings, and
# each input's description (None: not known before it runs) -> its outputs.
Check = Callable[[str, StepConfig, Mapping[str, Desc | None]], dict[str, Spec]]
Run = Callable[..., dict[str, np.ndarray]]


@dataclass(frozen=True)
class Op:
    name: str
    inputs: tuple[str, ...]
    keys: tuple[str, ...]  # the step's keys it reads (besides name, op, inputs, topic)
    fan_out: bool
    check: Check
    bind: Callable[[StepConfig], Run]  # the function of one step's settings
    # Its GPU form (``worker.compute.ops.device``) of one step's settings, where a
    # pipeline runs a model on the GPU; None: the NumPy function alone.
    device: Callable[[StepConfig, DeviceOps], Batched] | None = None


# The step keys only ops read, with their defaults: one an op does not read, set on
# its step, is refused (it would be ignored).
OP_KEYS = ("size", "preprocess", "iou_threshold", "score_threshold", "max_boxes")


def _registry() -> dict[str, Op]:
    from worker.compute.ops import crops, nms, resize

    return {op.name: op for op in (crops.OP, resize.OP, nms.OP)}


def op_named(name: str, at: str) -> Op:
    """The op ``name``, or a ConfigError naming ``at`` and the ops there are."""
    ops = _registry()
    if name not in ops:
        raise ConfigError(f"{at}: {name!r} is not a built-in operation "
                          f"({', '.join(sorted(ops))})")  # fmt: skip
    return ops[name]


def shown(desc: Desc | None) -> str:
    """A tensor's description as messages say it (None: known only once it runs,
    a postprocessed output)."""
    if desc is None:
        return "a postprocessed output"
    dims = ", ".join("?" if d is None else str(d) for d in desc[1])
    return f"{desc[0]} [{dims}]"
