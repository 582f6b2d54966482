"""A pipeline's steps (``[[pipelines.NAME.steps]]``), and what runs one for one
request's tensors: a model step's job built from them, a function called on
them (once, or fanned out into one set of tensors per region).

A request's tensors so far are a dict by ``request.NAME`` and ``STEP.OUTPUT``;
after a fan-out step a request has one such dict per region (a *unit*), and the
steps after it run once per unit.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import structlog

from worker.compute.ops import Desc, Regional
from worker.compute.ops.device import Batched
from worker.compute.stage import Stage
from worker.config.pipelines import REQUEST, Spec
from worker.flow.errors import ConfigError, InvalidRequest
from worker.flow.messages import Job

log = structlog.get_logger(__name__)

Tensors = dict[str, np.ndarray]  # one unit's tensors, by "STEP.OUTPUT" / "request.NAME"
Function = Callable[..., object]  # returns a dict of arrays (checked: a user's code)


@dataclass(frozen=True)
class ModelStep:
    name: str
    stage: Stage  # the model's own stage for this pipeline (its threads and buffers, or slots)
    sources: Mapping[str, str]  # the model's request input -> "STEP.OUTPUT" / "request.NAME"
    # The share of a request's deadline spent once this step may no longer start (the
    # steps' deadline_share summed up to it); None: the request's deadline alone.
    until: float | None = None
    topic: str = ""  # its outputs also written there, per request answered ok
    produces: tuple[str, ...] = ()  # its outputs' names (what its model answers with)
    when: str = ""  # a request's tensor that must be true for the step to run ("": always)
    optional: bool = False  # a failure leaves the request's answer partial, not failed
    # Its rows run as whole-batch arrays of its model's engine (worker.compute.columns),
    # with the functions and columnar steps beside it on one thread.
    columnar: bool = False


@dataclass(frozen=True)
class FunctionStep:
    name: str
    function: Function
    sources: Mapping[str, str]  # keyword argument -> source
    outputs: Mapping[str, Spec]  # declared (per region, when fanning out): checked
    until: float | None = None
    topic: str = ""
    fan_out: bool = False  # its outputs hold one row per region: a unit each
    when: str = ""  # as ModelStep's
    optional: bool = False
    columnar: bool = True  # a function runs on whichever thread its batch is on
    # Called once per batch with its rows stacked (worker.compute.columns), or, where they
    # cannot be, once per unit with a leading axis of one.
    vectorized: bool = False
    # A built-in op's GPU form: every chosen unit of a batch at once (where the pipeline
    # runs a model on the GPU); it raising, ``function`` runs on each unit instead.
    batched: Batched | None = None


Step = ModelStep | FunctionStep

SHAPES = ".shapes"  # a ragged output's companion: each region's shape


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline as it runs, built once from its configuration on its models'
    own tensor descriptions and checked there (``worker.app.pipelines``): what
    the pipeline's stage reads, and nothing else."""

    steps: tuple[Step, ...]
    # The answer's outputs, each name -> its source ("STEP.OUTPUT").
    answer: Mapping[str, str]
    # The sources that are per region (a fan-out's and after), each with its dtype and
    # fixed shape where it has one (a request without regions gets an empty one).
    regional: Mapping[str, Regional]
    # The answer's outputs as declared, for the pipeline's card and the result schemas
    # (a per-region one with a leading "regions" axis; a ragged one as its values and
    # NAME.shapes).
    described: Mapping[str, Desc | None]
    # The answer's outputs in the ragged layout: each region's values flat, one after
    # another, and NAME.shapes (int64 [regions, rank]) each region's shape.
    ragged: frozenset[str] = frozenset()
    # The first step is a model whose request is the pipeline's (checked at intake as
    # that model's); else the request's tensors are declared and every step reads them.
    first_takes_request: bool = True


def import_function(path: str, at: str) -> Function:
    """``module:function``, imported (a ConfigError naming ``at`` when it cannot be)."""
    module, _, attr = path.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{at}: {path!r} cannot be imported: {exc}") from exc
    if not callable(found):
        raise ConfigError(f"{at}: {path!r} is not a function")
    return found  # type: ignore[no-any-return]


def unpinned(job: Job) -> Job:
    """``job`` for a step's model: the version a request pins is the pipeline's."""
    if job.request is None or job.request.model is None:
        return job
    return msgspec.structs.replace(job, request=msgspec.structs.replace(job.request, model=None))


def request_tensors(job: Job) -> Tensors:
    """A request's tensors as the steps read them (``request.NAME``); an image
    sent as a file has none here (its first model decodes it)."""
    return {f"{REQUEST}.{k}": v for k, v in job.inputs.items() if isinstance(v, np.ndarray)}


def fed(job: Job, step: ModelStep, unit: Tensors) -> Job:
    """``job`` as the step's model takes it: its inputs from one unit's tensors,
    checked as that model checks a request's, the arrays themselves (no wire
    tensor made and read back)."""
    arrays = {name: _source(unit, source) for name, source in step.sources.items()}
    rid = job.request.id if job.request else ""
    checked, lengths = step.stage.binding.inputs.check_arrays(arrays, rid)
    return msgspec.structs.replace(unpinned(job), inputs=checked, lengths=lengths)


def _source(unit: Tensors, source: str) -> np.ndarray:
    """A unit's tensor; an image the request sent as a file has no pixels here
    (only the model decodes it)."""
    found = unit.get(source)
    if found is None:
        raise InvalidRequest(f"{source}: an image sent as a file reaches the first model only; "
                             "send its pixels (uint8 [H, W, C]) for later steps to read it")
    return found


def arguments(step: FunctionStep, unit: Tensors) -> dict[str, np.ndarray]:
    """A function step's keyword arguments from one unit (InvalidRequest where a
    source has no pixels here)."""
    return {arg: _source(unit, source) for arg, source in step.sources.items()}


def call(step: FunctionStep, unit: Tensors) -> list[Tensors] | str:
    """Run a function step on one unit: the units after it (the same one, its
    outputs added; for a fan-out, one per region, possibly none), or why it
    failed (anything it raises, or an output not as declared)."""
    try:
        args = arguments(step, unit)
    except InvalidRequest as exc:
        return str(exc)
    try:
        if step.vectorized:  # a batch of one: the leading axis added, then taken off
            got = _one_row(step, step.function(**{k: v[None] for k, v in args.items()}))
        else:
            got = step.function(**args)
    except Exception as exc:  # the user's code: any failure is this request's answer
        return f"{type(exc).__name__}: {exc}"
    return outputs_of(step, unit, got)


def _one_row(step: FunctionStep, got: object) -> object:
    """A vectorized function's answer for a batch of one, as one unit's (what
    is not a dict of one-row arrays is left for ``outputs_of`` to name)."""
    if not isinstance(got, Mapping):
        return got
    out = dict(got)
    for name in step.outputs:
        value = out.get(name)
        if isinstance(value, np.ndarray):
            if value.ndim == 0 or value.shape[0] != 1:
                raise ValueError(f"output {name!r}: {list(value.shape)}, one row for each row "
                                 "given (1)")  # fmt: skip
            out[name] = value[0]
    return out


def outputs_of(step: FunctionStep, unit: Tensors, got: object) -> list[Tensors] | str:
    """What a function step returned for one unit, held to its declaration: the
    units after it, or why not."""
    if not isinstance(got, Mapping):
        return f"returned {type(got).__name__}, not a dict of arrays"
    regions: int | None = None
    for name, spec in step.outputs.items():
        value = got.get(name)
        if not isinstance(value, np.ndarray):
            return f"output {name!r}: missing or not a numpy array"
        row = value.shape[1:] if step.fan_out else value.shape
        if step.fan_out:
            if value.ndim == 0 or (regions is not None and value.shape[0] != regions):
                return (f"output {name!r}: {list(value.shape)}, one row per region ("
                        f"{regions if regions is not None else 'a leading axis'})")  # fmt: skip
            regions = value.shape[0]
        if value.dtype != declared_dtype(spec.dtype) or len(row) != len(spec.shape) or any(
            isinstance(d, int) and d != n for d, n in zip(spec.shape, row, strict=True)
        ):
            shape = list(value.shape)
            per = " a region" if step.fan_out else ""
            return (f"output {name!r}: {value.dtype.name} {shape}, declared {spec.dtype} "
                    f"{list(spec.shape)}{per}")  # fmt: skip
    keys = {name: f"{step.name}.{name}" for name in step.outputs}
    if not step.fan_out:
        unit.update({keys[name]: read_only(got[name]) for name in step.outputs})
        return [unit]
    frozen = {n: read_only(got[n]) for n in step.outputs}
    return [{**unit, **{keys[n]: frozen[n][k] for n in step.outputs}}
            for k in range(regions or 0)]  # fmt: skip


def read_only(array: np.ndarray) -> np.ndarray:
    """A step's output as the steps after it read it: a read-only view, so a
    function writing into its input fails (and is named) instead of changing
    what an earlier step answered (a request's own tensors are read-only too)."""
    view = array.view()
    view.flags.writeable = False
    return view


@functools.cache
def declared_dtype(name: str) -> np.dtype[Any]:
    """A declared dtype (numpy parses a name, and names a dtype, anew each time:
    about 2 us, per output per request)."""
    return np.dtype(name)


def stacked(units: list[Tensors], source: str, spec: Regional) -> np.ndarray:
    """A per-region tensor of a request's units as one tensor, regions first: the
    units that have it (a branch per region runs for some), in region order (none:
    an empty one of the declared dtype and rank, ``[0, ...]``). A ValueError where
    their shapes differ (an output to answer ragged)."""
    rows = [u[source] for u in units if source in u]
    if rows:
        return np.stack(rows)
    dtype, shape = spec if spec is not None else ("float32", ())
    return np.zeros((0, *shape), dtype=dtype)


def ragged(units: list[Tensors], source: str, spec: Regional) -> tuple[np.ndarray, np.ndarray]:
    """A per-region tensor of a request's units in the ragged layout: every
    region's values, flat, one region after another, and each region's shape
    (int64 ``[regions, rank]``); regions may differ in shape. ``spec``: the
    source's per-region dtype and shape, for a request without regions (and
    without: float32, rank 0). A ValueError where the regions differ in rank."""
    rows = [u[source] for u in units if source in u]
    dtype, shape = spec if spec is not None else ("float32", ())
    rank = rows[0].ndim if rows else len(shape)
    if any(r.ndim != rank for r in rows):
        raise ValueError(f"its regions differ in rank ({sorted({r.ndim for r in rows})})")
    shapes = np.array([r.shape for r in rows], dtype=np.int64).reshape(len(rows), rank)
    values = np.concatenate([r.ravel() for r in rows]) if rows else np.zeros(0, dtype)
    return values, shapes


def call_each(
    step: FunctionStep, requests: list[tuple[list[Tensors], list[bool]]]
) -> list[list[Tensors] | str]:
    """``call`` on each request's chosen units in turn, on one stage thread; an
    op on the device on all of them at once (``worker.compute.ops.device``), or,
    where its batch cannot run there, as a function."""
    if step.batched is not None:
        done = _call_batched(step, step.batched, requests)
        if done is not None:
            return done
    return [call_units(step, units, keep) for units, keep in requests]


def _call_batched(
    step: FunctionStep, batched: Batched, requests: list[tuple[list[Tensors], list[bool]]]
) -> list[list[Tensors] | str] | None:
    """An op's device form on every chosen unit of ``requests`` at once: each
    request's units after it, or None where the batch cannot run there."""
    try:
        args = [arguments(step, unit) for units, keep in requests
                for unit, k in zip(units, keep, strict=True) if k]  # fmt: skip
        results = iter(batched(args))
    except Exception as exc:  # any: the NumPy operation names the request at fault
        log.debug("pipeline_op_on_host", step=step.name, reason=str(exc))
        return None
    out: list[list[Tensors] | str] = []
    for units, keep in requests:
        after: list[Tensors] = []
        failed = ""
        for unit, k in zip(units, keep, strict=True):
            got = outputs_of(step, unit, next(results)) if k else [unit]
            if isinstance(got, str):
                failed = failed or got
            else:
                after += got
        out.append(failed or after)
    return out


def call_units(step: FunctionStep, units: list[Tensors], keep: list[bool]) -> list[Tensors] | str:
    """One request's units after the step (a unit it does not run on as it
    was), or why it failed (its first unit that did)."""
    after: list[Tensors] = []
    for unit, k in zip(units, keep, strict=True):
        if not k:
            after.append(unit)
            continue
        got = call(step, unit)
        if isinstance(got, str):
            return got
        after += got
    return after


def differing(units: list[Tensors], source: str) -> str:
    """How a request's regions of ``source`` differ, as messages say it."""
    shapes = list(dict.fromkeys(tuple(u[source].shape) for u in units if source in u))
    shown = ", ".join(str(list(sh)) for sh in shapes[:3])
    return f"its regions differ in shape ({shown}{', ...' if len(shapes) > 3 else ''})"
