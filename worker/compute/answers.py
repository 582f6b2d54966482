"""A pipeline request's answer once its steps ran: the pipeline's outputs (a
per-region one stacked, or ragged where the plan says) and its steps' records
for their topics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from worker.compute.steps import (
    SHAPES,
    FunctionStep,
    PipelinePlan,
    Tensors,
    differing,
    ragged,
    stacked,
)
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.messages import Answer, Job, StepOutputs


def answered(plan: PipelinePlan, pipeline: str, job: Job, base: Tensors, units: list[Tensors],
             ran: Callable[[str], bool], timing: dict[str, int],
             partial: Mapping[str, Any] | None) -> Answer:  # fmt: skip
    """A request's answer: its outputs from the steps that ran (``ran``), and
    its step records; ``inference_failed`` naming the output where its regions
    differ in shape and it is not answered ragged."""
    out: dict[str, np.ndarray] = {}
    for name, source in plan.answer.items():
        if not ran(source):
            continue
        if name in plan.ragged:
            try:
                out[name], out[name + SHAPES] = ragged(units, source, plan.regional.get(source))
            except ValueError as exc:
                return Answer(job, None, ErrorInfo(ErrorCode.INFERENCE_FAILED,
                                                   f"output {name!r}: {exc}"))  # fmt: skip
            continue
        try:
            out[name] = value(plan, base, units, source)
        except ValueError:
            return Answer(job, None, ErrorInfo(ErrorCode.INFERENCE_FAILED, (
                f"output {name!r}: {differing(units, source)}; a per-region output whose "
                f"regions differ in shape is answered ragged (pipelines.{pipeline}"
                f".ragged = [{name!r}])")))  # fmt: skip
    try:
        steps = tuple(_step_outputs(plan, pipeline, base, units, ran))
    except ValueError as exc:
        return Answer(job, None, ErrorInfo(ErrorCode.INFERENCE_FAILED, str(exc)))
    return Answer(job, out, None, timing, steps=steps, partial=partial)


def value(plan: PipelinePlan, base: Tensors, units: list[Tensors], source: str) -> np.ndarray:
    """A request's tensor: its own, or its regions' stacked (after a fan-out)."""
    if source in plan.regional:
        return stacked(units, source, plan.regional[source])
    return base[source]


def _step_outputs(plan: PipelinePlan, pipeline: str, base: Tensors, units: list[Tensors],
                  ran: Callable[[str], bool]) -> list[StepOutputs]:  # fmt: skip
    """The outputs of the steps that write them to a topic and ran, for one
    request (a per-region one stacked; a ValueError naming the step where its
    regions differ in shape)."""
    out = []
    for step in plan.steps:
        if step.topic and ran(f"{step.name}."):
            names = step.outputs if isinstance(step, FunctionStep) else step.produces
            mine = {}
            for n in names:
                source = f"{step.name}.{n}"
                try:
                    mine[n] = value(plan, base, units, source)
                except ValueError:
                    raise ValueError(f"step {step.name!r}'s record for {step.topic!r}: "
                                     f"{source!r} {differing(units, source)}") from None
            out.append(StepOutputs(step.topic, f"{pipeline}/{step.name}", mine))
    return out
