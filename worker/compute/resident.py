"""A pipeline's GPU steps with their intermediates left on the device.

Where a pipeline runs a model as device columns (its GPU stage's
``device_columnar``: ``worker.compute.gpu.columns``), its GPU steps (those
model steps, and its built-in ops' resident forms, ``worker.compute.ops.device``)
hand each other device arrays: a step's outputs stay on the device as one array
a step (``OnDevice``), each unit holding its row of it, and the next GPU step
takes the whole array as it is (a model: device to device into its slot; an op:
its kernels read it). An output is copied to the host, once, whole, only where
a host step reads it: a function, a model run as jobs or on the CPU, a branch's
value, what an op reads on the host (crops' boxes), the answer and the steps'
topic records (``host_reads``, decided once from the plan). detect -> crop_boxes
-> classify thus downloads the classifier's answer alone, where each step used
to cost a download and an upload.

A GPU step whose rows the device cannot run (an array not what the model takes,
a failing run, a box with no pixel) copies its inputs to the host and runs as
it did before: a model as a batch of jobs, an op as the NumPy operation, which
name the request at fault.

Verified on the CPU twin (``gpu-twin``: NumPy arrays stand in for device ones,
``is_device`` tells them apart): the answers, and which copies are made. That
another stream waits for an op's ``ready`` event before reading what it made,
and that CuPy's pool does not hand a block out again while a stream still reads
it, can only be verified on a GPU (the twin runs every stream at once).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import structlog

from worker.compute.columns import Kept, Rows, chosen_rows, keep, same_rows
from worker.compute.gpu.ops import download
from worker.compute.ops.device import DeviceOp
from worker.compute.steps import (
    FunctionStep,
    ModelStep,
    PipelinePlan,
    Step,
    Tensors,
    arguments,
    declared_dtype,
    read_only,
)
from worker.flow.errors import InferenceFailed

log = structlog.get_logger(__name__)

# Each "STEP.OUTPUT" a pipeline copied from the device to the host (process-wide:
# tests see an intermediate downloaded between two GPU steps here).
DOWNLOADED: Counter[str] = Counter()


@runtime_checkable
class DeviceColumns(Protocol):
    """What a pipeline asks of a GPU stage (``GpuStage``) for device columns."""

    device_columnar: bool
    cupy: Any
    device: int

    async def run_device_columns(
        self, arrays: Mapping[str, Any], ready: Sequence[Any] = ()
    ) -> dict[str, Any] | None: ...


def _on_gpu(step: Step) -> DeviceColumns | None:
    stage: object = step.stage if isinstance(step, ModelStep) else None
    return stage if isinstance(stage, DeviceColumns) and stage.device_columnar else None


def device_steps(plan: PipelinePlan) -> tuple[bool, ...]:
    """Per step: whether it runs as a GPU step (a model as device columns, an op
    by its resident form), where the pipeline runs a model so; none otherwise
    (its ops keep their host form: nothing on the device to keep)."""
    steps = plan.steps
    models = [_on_gpu(s) is not None and not (i == 0 and plan.first_takes_request)
              for i, s in enumerate(steps)]  # fmt: skip
    if not any(models):
        return (False,) * len(steps)
    ops = [isinstance(s, FunctionStep) and isinstance(s.batched, DeviceOp) for s in steps]
    return tuple(m or o for m, o in zip(models, ops, strict=True))


def host_reads(plan: PipelinePlan, on_device: Sequence[bool]) -> tuple[tuple[str, ...], ...]:
    """Per step: the tensors it reads on the host (copied there before it runs)."""
    out = []
    for step, gpu in zip(plan.steps, on_device, strict=True):
        when = (step.when,) if step.when else ()
        if not gpu:
            out.append((*step.sources.values(), *when))
        elif isinstance(step, FunctionStep) and isinstance(step.batched, DeviceOp):
            out.append((*(step.sources[a] for a in step.batched.host_reads), *when))
        else:
            out.append(when)
    return tuple(out)


def answer_reads(plan: PipelinePlan) -> tuple[str, ...]:
    """The tensors a request's answer and its steps' topic records read."""
    reads = list(plan.answer.values())
    for step in plan.steps:
        if step.topic:
            names = step.outputs if isinstance(step, FunctionStep) else step.produces
            reads += [f"{step.name}.{n}" for n in names]
    return tuple(dict.fromkeys(reads))


def together(steps: Sequence[Step], on_device: Sequence[bool]) -> list[bool]:
    """Per step: whether it runs on one thread with its neighbours (functions
    and columnar model steps in a row, where one at least is a model step: a
    run of functions alone keeps splitting its requests among threads); a GPU
    step runs on its own (its model awaits a slot)."""
    out = [False] * len(steps)
    start = 0
    while start < len(steps):
        end = start
        while end < len(steps) and not on_device[end] and (
                isinstance(steps[end], FunctionStep) or steps[end].columnar):  # fmt: skip
            end += 1
        if any(isinstance(steps[k], ModelStep) for k in range(start, end)):
            out[start:end] = [True] * (end - start)
        start = end + 1
    return out


class Home:
    """Where a pipeline's device columns live: its GPU models' CuPy and device,
    and a stream of its own for the copies to the host."""

    def __init__(self, cupy: Any, device: int) -> None:
        self.cupy = cupy
        self.device = device
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def of(cls, plan: PipelinePlan, on_device: Sequence[bool]) -> Home | None:
        stages = [g for s, on in zip(plan.steps, on_device, strict=True)
                  if on and (g := _on_gpu(s)) is not None]  # fmt: skip
        return cls(stages[0].cupy, stages[0].device) if stages else None


class OnDevice:
    """One batch's step outputs on the device, by "STEP.OUTPUT": the rows (units)
    each was made for, the whole array (each unit holds its row), and the event
    it is complete at (None: complete)."""

    def __init__(self, home: Home) -> None:
        self._home = home
        self.pending: dict[str, tuple[Rows, Any, Any]] = {}

    def keep(self, step: str, out: Mapping[str, Any], rows: Rows, ready: Any) -> None:
        for name, column in out.items():
            key = f"{step}.{name}"
            self.pending[key] = (rows, column, ready)
            for k, (_, unit) in enumerate(rows):
                unit[key] = column[k]

    def to_host(self, keys: Iterable[str], kept: Kept) -> None:
        """``keys`` that are on the device copied to the host, each whole at once,
        the units' rows then views of it (and it a column for host steps)."""
        found = [(key, self.pending.pop(key)) for key in keys if key in self.pending]
        if not found:
            return
        home = self._home
        copies = []
        with home.cupy.cuda.Device(home.device):
            for key, (rows, column, ready) in found:
                if ready is not None:
                    home.stream.wait_event(ready)
                host = np.empty(column.shape, column.dtype)
                download(home.cupy, column, host, home.stream)
                copies.append((key, rows, host))
                DOWNLOADED[key] += 1
            home.stream.synchronize()  # one wait, for every copy
        for key, rows, host in copies:
            step, _, name = key.partition(".")
            keep(step, {name: host}, rows, kept)

    def column(self, source: str, rows: Rows, kept: Kept) -> tuple[Any, Any]:
        """``source`` for ``rows`` as one array, and the event it is complete at:
        the array on the device where it was made for these rows, else their rows
        gathered there; on the host, an earlier host column or the rows stacked."""
        made = self.pending.get(source)
        if made is None:
            host = same_rows(kept.get(source), rows)
            return (host if host is not None else np.stack([u[source] for _, u in rows])), None
        if len(made[0]) == len(rows) and all(a[1] is b[1] for a, b in zip(made[0], rows,
                                                                          strict=True)):
            return made[1], made[2]
        home = self._home  # a subset (a branch, a request answered): gathered on the device
        with home.cupy.cuda.Device(home.device), home.stream:
            if made[2] is not None:
                home.stream.wait_event(made[2])
            gathered = home.cupy.stack([u[source] for _, u in rows])
            ready = home.cupy.cuda.Event()
            ready.record(home.stream)
        return gathered, ready

    def ready(self, sources: Iterable[str]) -> list[Any]:
        return [self.pending[s][2] for s in sources
                if s in self.pending and self.pending[s][2] is not None]  # fmt: skip


async def run_model(step: ModelStep, rows: Rows, dev: OnDevice, kept: Kept) -> bool:
    """The step's rows through its GPU stage as device columns, its outputs left
    on the device; False, with no unit touched, where they must run as jobs."""
    stage = _on_gpu(step)
    assert stage is not None
    try:
        arrays, ready = {}, []
        for name, source in step.sources.items():
            arrays[name], event = dev.column(source, rows, kept)
            if event is not None:
                ready.append(event)
        out = await stage.run_device_columns(arrays, ready)
    except (KeyError, ValueError, InferenceFailed) as exc:
        log.debug("pipeline_step_as_jobs", step=step.name, reason=str(exc))
        return False
    if out is None:
        return False
    dev.keep(step.name, out, rows, None)
    return True


def run_op(step: FunctionStep, units: list[list[Tensors]], live: Mapping[int, list[bool]],
           dev: OnDevice) -> bool:  # fmt: skip
    """An op's resident form on the live requests' chosen units (on a stage
    thread): their units after it, its device outputs left there; False, with
    no unit touched, where its rows must run as the host runs them."""
    op = step.batched
    assert isinstance(op, DeviceOp)
    rows = chosen_rows(units, live)
    if not rows:
        return True
    try:
        made = op.resident([arguments(step, unit) for _, unit in rows])
    except Exception as exc:  # any: the NumPy operation names the request at fault
        log.debug("pipeline_op_on_host", step=step.name, reason=str(exc))
        return False
    count = sum(made.regions) if made.regions is not None else len(rows)
    for name, column in made.device.items():
        spec = step.outputs[name]
        if column.dtype != declared_dtype(spec.dtype) or len(column) != count or (
            column.ndim != len(spec.shape) + 1) or any(
                isinstance(d, int) and d != n for d, n in zip(spec.shape, column.shape[1:],
                                                              strict=True)):  # fmt: skip
            return False
    after: Rows = []
    k = 0
    for i, keep_unit in live.items():
        mine: list[Tensors] = []
        for unit, chosen in zip(units[i], keep_unit, strict=True):
            if not chosen:
                mine.append(unit)
                continue
            frozen = {f"{step.name}.{n}": read_only(v) for n, v in made.host[k].items()}
            if made.regions is None:
                unit.update(frozen)
                mine.append(unit)
                after.append((i, unit))
            else:  # a fan-out: a unit a region
                for j in range(made.regions[k]):
                    region = {**unit, **{key: v[j] for key, v in frozen.items()}}
                    mine.append(region)
                    after.append((i, region))
            k += 1
        units[i] = mine
    dev.keep(step.name, made.device, after, made.ready)
    return True


async def on_a_thread(pool: Any, step: FunctionStep, units: list[list[Tensors]],
                      live: Mapping[int, list[bool]], dev: OnDevice) -> bool:  # fmt: skip
    """``run_op`` on one of the stage's threads (its host work: tables, packing)."""
    return await asyncio.get_running_loop().run_in_executor(pool, run_op, step, units, live,
                                                            dev)  # fmt: skip
