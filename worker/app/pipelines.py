"""A pipeline's steps checked against its models and built, once, at start-up
(``[pipelines.NAME]``; the settings' shape is checked as they load,
``worker.config.pipelines``).

Checked here, with the models loaded: the request is the first model's (the
first step) or the pipeline's declared tensors (then any step first); every
model step's request inputs not the pipeline's request are fed, each from a
tensor of the same dtype and rank whose fixed dimensions agree (an image input
from uint8 pixels, ``[H, W, C]`` or ``[H, W]``; a text input from nothing: no
step outputs text); every source names a tensor that exists (a request's tensor
input, a model's output as its stage returns it, a function's declared output).
A wrong pipeline stops start-up with exit 2 naming the step and the tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from worker.compute.ops import OP_KEYS, Desc, Regional, op_named, shown
from worker.compute.ops.device import DeviceOps
from worker.compute.stage import Stage
from worker.compute.steps import (
    SHAPES,
    FunctionStep,
    ModelStep,
    PipelinePlan,
    Step,
    import_function,
)
from worker.config import BatchingConfig, LimitsConfig
from worker.config.checks import check
from worker.config.model import TensorInput
from worker.config.pipelines import (
    REQUEST,
    PipelineConfig,
    Spec,
    StepConfig,
    parse_spec,
    source_of,
)
from worker.flow.errors import ConfigError
from worker.model.inputs import Binding, ModelInputs
from worker.model.inputs.image import BoundImage
from worker.model.inputs.tensor import BoundTensor
from worker.model.io import EngineInfo, ModelIO, TensorDesc


@dataclass(frozen=True)
class StepModel:
    """What a model step is built from: the model's engine and binding, and its
    stage for this pipeline (its own threads and buffers, or GPU slots)."""

    info: EngineInfo
    binding: Binding
    stage: Stage


def pipeline_info(name: str, request: ModelIO, cfg: PipelineConfig,
                  infos: Mapping[str, EngineInfo]) -> EngineInfo:  # fmt: skip
    """The pipeline as results name it: its name, its request (``request``), and a
    version that changes with any step's (the models' content hashes, the
    functions' names, the declared inputs)."""
    parts = [f"{s.name}={infos[s.model].version if s.model else s.function}" for s in cfg.steps]
    # Declared inputs only where there are some: a pipeline without keeps its version.
    parts += [f"request.{t}={spec}" for t, spec in cfg.inputs.items()]
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return EngineInfo("pipeline", name, f"pipeline:{digest}", request, None)


def build_plan(name: str, cfg: PipelineConfig, models: Mapping[str, StepModel],
               device: DeviceOps | None = None) -> PipelinePlan:  # fmt: skip
    """The pipeline's plan: its steps, checked (see the module docstring), the
    tensors that are per region, its answer as declared; ``models``: the model
    steps' by model name; ``device``: where its ops run their GPU forms (a
    pipeline running a model on the GPU), None: on the host."""
    at = f"pipelines.{name}"
    first = cfg.steps[0]
    takes_request = not cfg.inputs  # the first step's model takes the request as it is
    if takes_request:
        for tensor, text in first.inputs.items():
            check(text == f"{REQUEST}.{tensor}", f"{at}.steps[0].inputs.{tensor}",
                  f"{text!r}: the first step takes the request as it is (request.{tensor})")
        known = _request_tensors(models[first.model].binding)
    else:
        known = {f"{REQUEST}.{tensor}": (spec.dtype, spec.shape)
                 for tensor, spec in declared_specs(name, cfg).items()}  # fmt: skip
    steps: list[Step] = []
    spent = 0.0  # the deadline shares of the steps so far
    for i, step in enumerate(cfg.steps):
        where = f"{at}.steps[{i}]"
        spent += step.deadline_share
        until = spent if step.deadline_share > 0 else None
        if step.model:
            model = models[step.model]
            sources = _model_sources(where, step.inputs, model.binding, known,
                                     i == 0 and takes_request)  # fmt: skip
            produced = answer_outputs(model.binding)
            # As columns where its stage can, unless it takes the request as it is
            # (checked at intake as its model's, its stage's own jobs).
            columnar = model.stage.columnar and not (i == 0 and takes_request)
            steps.append(ModelStep(step.name, model.stage, sources, until, step.topic,
                                   tuple(produced), columnar=columnar))  # fmt: skip
            for out, desc in produced.items():
                known[f"{step.name}.{out}"] = desc
        elif step.op:
            steps.append(_op_step(where, step, known, until, device))
        else:
            for arg, text in step.inputs.items():
                _exists(f"{where}.inputs.{arg}", text, known)
            specs = {o: parse_spec(t, f"{where}.outputs.{o}") for o, t in step.outputs.items()}
            function = import_function(step.function, f"{where}.function")
            steps.append(FunctionStep(step.name, function, dict(step.inputs), specs, until,
                                      step.topic, step.fan_out,
                                      vectorized=step.vectorized))  # fmt: skip
        if step.when or step.optional:
            _check_when(where, step, known, first=i == 0 and takes_request)
            steps[-1] = dataclasses.replace(steps[-1], when=step.when, optional=step.optional)
        if isinstance(steps[-1], FunctionStep):
            for out, spec in steps[-1].outputs.items():
                known[f"{step.name}.{out}"] = (spec.dtype, spec.shape)
    for out, text in cfg.outputs.items():
        _exists(f"{at}.outputs.{out}", text, known)
    # Several fan-outs: each region fans out again (a cascade); the tensors of the
    # first fan-out and after are per leaf region, a parent's repeated for each of
    # its own regions.
    fans = [i for i, s in enumerate(steps) if isinstance(s, FunctionStep) and s.fan_out]
    fan_at = fans[0] if fans else None
    after = {s.name for s in cfg.steps[fan_at:]} if fan_at is not None else set()
    regional = {key: _empty(desc) for key, desc in known.items()
                if key.partition(".")[0] in after}  # fmt: skip
    described = {out: known[text] for out, text in cfg.outputs.items()}
    for out, text in cfg.outputs.items():  # a regional one: the regions' stacked
        desc = known[text]
        if out in cfg.ragged:
            check(text in regional, f"{at}.ragged", f"{out!r} ({text!r}) is one tensor a "
                  "request, not one a region: only a per-region output is answered ragged")
            rank = len(desc[1]) if desc is not None else None
            described[out] = None if desc is None else (desc[0], ("values",))
            described[out + SHAPES] = ("int64", ("regions", rank))
        elif text in regional and desc is not None:
            described[out] = (desc[0], ("regions", *desc[1]))
    return PipelinePlan(tuple(steps), dict(cfg.outputs), regional, described,
                        frozenset(cfg.ragged), first_takes_request=takes_request)


def _check_when(where: str, step: StepConfig, known: Mapping[str, Desc | None],
                first: bool) -> None:  # fmt: skip
    """A branch (``when``): an earlier tensor of one value a request (or, after a
    fan-out, one value a region: a branch per region); not on a first step that
    takes the request as it is."""
    if not step.when:
        return
    check(not first, f"{where}.when", "the first step takes the request as it is; a branch "
          "needs the pipeline's declared inputs ([pipelines.NAME.inputs])")  # fmt: skip
    desc = _exists(f"{where}.when", step.when, known)
    fixed = desc is not None and all(isinstance(d, int) for d in desc[1])
    count = 1
    for d in desc[1] if desc is not None else ():
        count *= d if isinstance(d, int) else 1
    check(desc is None or (fixed and count == 1), f"{where}.when", f"{step.when!r} is "
          f"{shown(desc)}: a branch reads one value a request, or a region (true where non-zero)")


def _request_tensors(binding: Binding) -> dict[str, Desc | None]:
    """A model's request as later steps read it: its tensors, and an image's
    pixels as sent (uint8 [H, W, C])."""
    known: dict[str, Desc | None] = {
        f"{REQUEST}.{k.name}": _desc(k.desc.dtype.name, k.desc.shape)
        for k in binding.inputs.kinds if isinstance(k, BoundTensor)
    }  # fmt: skip
    for k in binding.inputs.kinds:
        if isinstance(k, BoundImage):
            known[f"{REQUEST}.{k.name}"] = ("uint8", ("H", "W", "C"))
    return known


def declared_specs(name: str, cfg: PipelineConfig) -> dict[str, Spec]:
    """``[pipelines.NAME.inputs]``, parsed (checked as the settings loaded)."""
    return {tensor: parse_spec(text, f"pipelines.{name}.inputs.{tensor}")
            for tensor, text in cfg.inputs.items()}  # fmt: skip


def declared_io(name: str, cfg: PipelineConfig) -> ModelIO:
    """The declared request tensors as a model's inputs are described (each
    batched on its first axis; a named dimension free), for the intake's checks
    and the pipeline's card."""
    return ModelIO(tuple(
        TensorDesc(tensor, np.dtype(spec.dtype), spec.shape, 0)
        for tensor, spec in declared_specs(name, cfg).items()
    ), ())  # fmt: skip


def declared_inputs(name: str, cfg: PipelineConfig, limits: LimitsConfig,
                    batching: BatchingConfig) -> ModelInputs:  # fmt: skip
    """What a request of a pipeline with declared tensors is checked against at
    intake: each a tensor input, its free dimensions as a model's."""
    io = declared_io(name, cfg)
    kinds = [BoundTensor(d.name, TensorInput(), d, 0) for d in io.inputs]
    return ModelInputs(kinds, split_by_length=batching.split_by_length,
                       length_buckets=batching.length_buckets)  # fmt: skip


def _op_step(
    where: str, step: StepConfig, known: Mapping[str, Desc | None], until: float | None,
    device: DeviceOps | None,
) -> FunctionStep:
    """``op = "NAME"``: a built-in operation (``worker.compute.ops``), its inputs
    and settings checked, run as a function step is."""
    op = op_named(step.op, f"{where}.op")
    names = sorted(step.inputs)
    check(names == sorted(op.inputs), f"{where}.inputs", f"{op.name} takes "
          f"{', '.join(op.inputs)}, got {', '.join(names)}")  # fmt: skip
    defaults = {f.name: f.default for f in dataclasses.fields(StepConfig)}
    for key in OP_KEYS:
        check(key in op.keys or getattr(step, key) == defaults[key], f"{where}.{key}",
              f"{op.name} does not read it (it reads {', '.join(op.keys) or 'no key'})")
    descs = {name: _exists(f"{where}.inputs.{name}", step.inputs[name], known)
             for name in op.inputs}  # fmt: skip
    outputs = op.check(where, step, descs)
    batched = op.device(step, device) if device is not None and op.device is not None else None
    return FunctionStep(step.name, op.bind(step), dict(step.inputs), outputs, until, step.topic,
                        fan_out=op.fan_out, batched=batched)  # fmt: skip


def _empty(desc: Desc | None) -> Regional:
    """What a request without regions is answered with, empty: the declared
    dtype and rank, a free dimension 0 (known only from a region)."""
    if desc is None:
        return None
    return desc[0], tuple(d if isinstance(d, int) else 0 for d in desc[1])


def answer_outputs(binding: Binding) -> dict[str, Desc | None]:
    """What a model's stage answers a request with (the outputs passed as they
    are, and the postprocessed forms: ``OutputPlan.scatter``), each as declared."""
    plan = binding.outputs
    raw = plan.declared.get(plan.raw_name) if plan.raw_name else None

    def declared(name: str) -> Desc | None:
        d = plan.declared.get(name)
        return None if d is None else _desc(d.dtype.name, d.shape)

    out = {name: declared(name) for name in plan.passed}
    if not plan.active:
        return out
    cfg = plan.post.resolved(classifier=True)
    assert cfg.top_k is not None and plan.raw_name is not None
    if cfg.include_raw or cfg.normalize:
        out[plan.raw_name] = None if raw is None else _desc(
            "float32" if cfg.normalize else raw.dtype.name, raw.shape)  # fmt: skip
    if cfg.top_k > 0:
        # As many columns as the output has, where fewer than top_k (top_k clamps);
        # not known before a row of a free shape comes.
        k: int | str = cfg.top_k
        if raw is not None:
            k = min(k, raw.row_elements) if raw.fixed else "k"
        out["topk_indices"] = ("int64", (k,))
        out["topk_scores"] = ("float32", (k,))
    elif cfg.softmax:
        out["probabilities"] = None if raw is None else _desc("float32", raw.shape)
    return out


def _model_sources(
    where: str, given: Mapping[str, str], binding: Binding, known: Mapping[str, Desc | None],
    first: bool,
) -> dict[str, str]:  # fmt: skip
    """Each of the model's request inputs -> its source, every one checked."""
    names = [k.name for k in binding.inputs.kinds]
    extra = [t for t in given if t not in names]
    check(not extra, f"{where}.inputs.{extra[0] if extra else ''}",
          f"not an input of the model, which takes {', '.join(names)}")  # fmt: skip
    sources: dict[str, str] = {}
    for kind in binding.inputs.kinds:
        text = given.get(kind.name, f"{REQUEST}.{kind.name}")
        sources[kind.name] = text
        if first:
            continue
        at = f"{where}.inputs.{kind.name}"
        found = _exists(at, text, known)
        if isinstance(kind, BoundTensor):
            want = _desc(kind.desc.dtype.name, kind.desc.shape)
            if found is not None:
                _agrees(at, text, found, want)
        elif isinstance(kind, BoundImage):
            check(found is None or (found[0] == "uint8" and len(found[1]) in (2, 3)), at,
                  f"{text!r} is {shown(found)}: an image input takes uint8 pixels "
                  "[H, W, C] or [H, W]")  # fmt: skip
        else:
            raise ConfigError(f"{at}: a {kind.kind} input is fed by the request only; no step "
                              "returns one")  # fmt: skip
    return sources


def _exists(at: str, text: str, known: Mapping[str, Desc | None]) -> Desc | None:
    source, _ = source_of(text, at)
    if text not in known:
        have = sorted(k.partition(".")[2] for k in known if k.startswith(f"{source}."))
        what = "the request's tensor inputs" if source == REQUEST else f"step {source!r}'s outputs"
        raise ConfigError(f"{at}: {text!r} does not exist; {what}: {', '.join(have) or 'none'}")
    return known[text]


def _agrees(at: str, text: str, found: Desc, want: Desc) -> None:
    fixed = all(
        not (isinstance(a, int) and isinstance(b, int)) or a == b
        for a, b in zip(found[1], want[1], strict=False)
    )
    check(found[0] == want[0] and len(found[1]) == len(want[1]) and fixed, at,
          f"{text!r} is {shown(found)}, the model takes {shown(want)}")  # fmt: skip


def _desc(dtype: str, shape: tuple[int | str | None, ...]) -> Desc:
    return dtype, tuple(shape)
