"""``[pipelines.NAME]``: models run one after another in the worker, each step fed
by the request or by the steps before it, one answer per request
(docs/guides/pipelines.md).

A pipeline answers its input topics as a model does (a topic belongs to one
model or one pipeline). Its steps are the worker's models (``[model]`` or a
``[models.NAME]``, which then need no topics of their own) and Python
functions between them (``module:function``: numpy arrays in, a dict of numpy
arrays out, one request at a time). Each step's inputs are mapped by name from
``request.NAME`` (an input of the request) or ``STEP.OUTPUT`` (an output of an
earlier step); the pipeline's outputs are named from any step. The request is
the first model's (which comes first), or the pipeline's own where it declares
its tensors (``[pipelines.NAME.inputs]``: then any step may come first). What
can be checked without the model files is checked here, as the settings load; the
tensors' dtypes and shapes are checked once the models are loaded
(``worker.app.pipelines``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.config.checks import check
from worker.config.model import PreprocessConfig

if TYPE_CHECKING:
    from worker.config import Settings

REQUEST = "request"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_SPEC = re.compile(r"\s*([a-z0-9]+)\s*\[([^\]]*)\]\s*")


@dataclass(frozen=True)
class StepPreprocess(PreprocessConfig):
    """An ``op = "resize"`` step's preprocessing: ``[model.preprocess]``'s keys."""

    def where(self) -> str:
        return "pipelines.*.steps[*].preprocess"


@dataclass(frozen=True)
class StepConfig:
    # The step's name: what later steps and the pipeline's outputs call its outputs by
    # (STEP.OUTPUT), and its label in metrics and errors.
    name: str = ""
    # A model the worker serves: [model]'s name, or the NAME of a [models.NAME].
    model: str = ""
    # Or a Python function, as module:function (importable by the worker): called once per
    # request with the step's inputs as keyword arguments (numpy arrays), returning a dict
    # of numpy arrays, its outputs.
    function: str = ""
    # The step's inputs: each input's name -> where it comes from, "request.NAME" or
    # "STEP.OUTPUT". A model step's inputs not named here come from the request input of
    # the same name.
    inputs: dict[str, str] = field(default_factory=dict)
    # A function step's outputs: each output's name -> its dtype and one request's shape,
    # as "float32 [76, 32, 1]" (a free dimension by a name: "float32 [frames, 32]"),
    # checked against the steps that read it at start-up and against what it returns.
    outputs: dict[str, str] = field(default_factory=dict)
    # This step's share of a request's deadline (0..1; 0 = none of its own): the step does
    # not start once the shares of the steps up to it are spent (arrival + their sum x the
    # time the request had), and the request is answered deadline_exceeded naming it.
    deadline_share: float = 0.0
    # Or a built-in operation (docs/guides/pipelines.md, "Built-in operations"): "crop_boxes"
    # (image and boxes in, a crop of size a box out: a fan-out), "resize" (an image resized
    # and normalised as a model's image input is, by preprocess), "nms" (boxes and scores
    # thinned by non-maximum suppression). Its inputs are named as the operation names them.
    op: str = ""
    # crop_boxes: the crops' height and width.
    size: tuple[int, ...] = ()
    # resize: the image's preprocessing, [model.preprocess]'s keys (size and channels required).
    preprocess: StepPreprocess | None = None
    # nms: a box overlapping a higher-scored one by more than this IoU is dropped.
    iou_threshold: float = 0.5
    # nms: a box scored under this is dropped.
    score_threshold: float = 0.0
    # nms: at most this many boxes kept, highest score first; 0 = all.
    max_boxes: int = 0
    # A function step only: its outputs hold one row per region of the request (a leading
    # axis of any length, 0 included; its declared shapes are a region's); the steps after
    # it run once per region, and an output of theirs is the regions' stacked per request.
    fan_out: bool = False
    # A function step only: called once per batch, each input stacked on a leading axis of
    # the batch's rows (every region's, after a fan-out) and each output returned so, a row
    # each (numpy code over arrays: no call and no copy per request); its rows then feed a
    # model step after it as they are. Not with fan_out. false = called once per request.
    vectorized: bool = False
    # A branch: the step runs for a request only where this earlier tensor ("STEP.OUTPUT" or
    # "request.NAME", one value a request) is true (non-zero); where it is not, the step is
    # skipped and so is every step reading its outputs: the answer leaves their outputs out
    # and names them (partial.skipped). "" = always.
    when: str = ""
    # A step whose failure for a request does not fail it: the answer carries every other
    # output and names the step and why (partial.failed); steps reading its outputs are
    # skipped. false = a failure answers the request inference_failed.
    optional: bool = False
    # A topic the step's outputs are also written to, one record per request the pipeline
    # answers ok (a result message named PIPELINE/STEP, keyed as the request): for audit
    # and replay; in the answer's transaction under exactly-once. "" = none.
    topic: str = ""


@dataclass(frozen=True)
class PipelineConfig:
    # The input topics the pipeline answers (each also in kafka.input_topics; a topic
    # belongs to one model or pipeline).
    topics: tuple[str, ...] = ()
    # The request's tensors, each name -> its dtype and one request's shape, as
    # "uint8 [H, W, 3]" (a free dimension by a name). Declared: a request is checked
    # against them at intake, any step may read them (request.NAME), and any step may
    # come first (a function or an op: preprocessing before the first model). Not
    # declared: the request is the first step's model's, which must come first.
    inputs: dict[str, str] = field(default_factory=dict)
    # The steps, in the order they run.
    steps: tuple[StepConfig, ...] = ()
    # The pipeline's outputs, the answer's: each output's name -> "STEP.OUTPUT".
    outputs: dict[str, str] = field(default_factory=dict)
    # Outputs answered in the ragged layout, for per-region outputs whose regions may
    # differ in shape (a fan-out's and after): NAME holds every region's values, flat, one
    # region after another, and NAME.shapes (int64 [regions, rank]) each region's shape.
    # Not listed, a per-region output is its regions stacked ([regions, ...]), and a request
    # whose regions differ in shape is answered inference_failed naming it.
    ragged: tuple[str, ...] = ()


@dataclass(frozen=True)
class Spec:
    """A declared tensor: dtype and one request's shape (a str: a free dimension)."""

    dtype: str
    shape: tuple[int | str, ...]


def parse_spec(text: str, at: str) -> Spec:
    """``"float32 [76, 32, 1]"`` as a ``Spec``; a ConfigError naming ``at`` if not one."""
    found = _SPEC.fullmatch(text)
    check(found is not None, at, f"{text!r}: expected a dtype and a shape, as \"float32 [76, "
          "32, 1]\"")  # fmt: skip
    assert found is not None
    dims: list[int | str] = []
    for raw in (d.strip() for d in found[2].split(",") if d.strip()):
        dims.append(int(raw) if raw.isdigit() else raw)
    return Spec(found[1], tuple(dims))


def source_of(text: str, at: str) -> tuple[str, str]:
    """``"STEP.OUTPUT"`` or ``"request.NAME"`` as (step or "request", tensor)."""
    step, dot, tensor = text.partition(".")
    check(bool(dot and step and tensor), at, f"{text!r}: expected request.NAME or STEP.OUTPUT")
    return step, tensor


def _check_model_step(where: str, step: StepConfig, served: Mapping[str, str]) -> None:
    check(step.model in served, f"{where}.model", f"{step.model!r} is not a model this "
          f"worker serves ({', '.join(served)})")  # fmt: skip
    check(not step.outputs, f"{where}.outputs", "a model's outputs are its file's")
    check(not step.vectorized, f"{where}.vectorized", "a model step runs its rows as a "
          "batch already; vectorized is a function step's")  # fmt: skip
    check(not step.fan_out, f"{where}.fan_out", "a function step fans out (its outputs hold "
          "the regions); a model step runs once per region after it")  # fmt: skip


def _check_function_step(where: str, step: StepConfig) -> None:
    check(bool(_FUNCTION.fullmatch(step.function)), f"{where}.function",
          f"{step.function!r}: expected module:function")  # fmt: skip
    check(bool(step.outputs), f"{where}.outputs", "a function step declares its outputs, as "
          "{name = \"float32 [76, 32, 1]\"}")  # fmt: skip
    check(bool(step.inputs), f"{where}.inputs", "a function step names its inputs")
    for out, spec in step.outputs.items():
        parse_spec(spec, f"{where}.outputs.{out}")
    check(not (step.vectorized and step.fan_out), f"{where}.vectorized", "a vectorized "
          "function returns a row per row it is given: it does not fan out")  # fmt: skip


def _check_op_step(where: str, step: StepConfig) -> None:
    """An operation's shape (which operation, its inputs and settings: checked
    once the models load, ``worker.compute.ops``)."""
    check(bool(step.inputs), f"{where}.inputs", f"{step.op!r} names its inputs")
    check(not step.outputs, f"{where}.outputs", "an operation's outputs are its own")
    check(not step.fan_out, f"{where}.fan_out", "an operation fans out or not by itself")
    check(not step.vectorized, f"{where}.vectorized", "an operation is run as it is built "
          "(vectorized is a function step's)")  # fmt: skip


def check_pipelines(s: Settings, served: Mapping[str, str]) -> None:
    """Each pipeline's shape, as the settings load (``served``: the worker's models
    by name, each to where it is configured): topics; steps named once, each a
    model the worker serves or a function, never both; every source a request
    input or an earlier step's; outputs named from a step."""
    for name, p in s.pipelines.items():
        at = f"pipelines.{name}"
        check(bool(_NAME.fullmatch(name)), at, "a pipeline's name: letters, digits, _ and -")
        check(name not in served, at, f"{name!r} is also a model's name: every model and "
              "pipeline needs a name of its own")  # fmt: skip
        check(bool(p.topics), f"{at}.topics", "names the input topics the pipeline answers")
        check(bool(p.steps), f"{at}.steps", "a pipeline has one step or more")
        check(bool(p.outputs), f"{at}.outputs", "names the answer's outputs, as "
              "{name = \"STEP.OUTPUT\"}")  # fmt: skip
        check(any(step.model for step in p.steps), f"{at}.steps", "a pipeline runs a model "
              "or more (its batching is its first model's)")  # fmt: skip
        for tensor, spec in p.inputs.items():
            check(bool(_NAME.fullmatch(tensor)), f"{at}.inputs.{tensor}", "a request "
                  "input's name: letters, digits, _ and -")  # fmt: skip
            parse_spec(spec, f"{at}.inputs.{tensor}")
        earlier: set[str] = set()
        shares = [step.deadline_share for step in p.steps]
        check(all(0.0 <= x <= 1.0 for x in shares) and sum(shares) <= 1.0 + 1e-9,
              f"{at}.steps", f"deadline_share: each 0 to 1, together at most 1, got {shares}")
        for i, step in enumerate(p.steps):
            where = f"{at}.steps[{i}]"
            check(bool(_NAME.fullmatch(step.name)) and step.name != REQUEST, f"{where}.name",
                  f"{step.name!r}: every step is named (letters, digits, _ and -; not "
                  f"{REQUEST!r})")  # fmt: skip
            check(step.name not in earlier, f"{where}.name", f"{step.name!r} names an "
                  "earlier step too")  # fmt: skip
            check(sum(map(bool, (step.model, step.function, step.op))) == 1, where,
                  "a step is a model (model = ...), a function (function = ...) or an "
                  "operation (op = \"crop_boxes\", \"resize\", \"nms\")")  # fmt: skip
            check(i > 0 or bool(step.model) or bool(p.inputs), where, "the first step is a "
                  "model, whose request is the pipeline's, unless the request's tensors are "
                  f"declared ([{at}.inputs]; then a function or op may come first)")  # fmt: skip
            if step.model:
                _check_model_step(where, step, served)
            elif step.function:
                _check_function_step(where, step)
            else:
                _check_op_step(where, step)
            if step.when:
                source, _ = source_of(step.when, f"{where}.when")
                check(source == REQUEST or source in earlier, f"{where}.when",
                      f"{step.when!r}: {source!r} is not an earlier step or the request")
            for tensor, text in step.inputs.items():
                source, read = source_of(text, f"{where}.inputs.{tensor}")
                check(source == REQUEST or source in earlier, f"{where}.inputs.{tensor}",
                      f"{text!r}: {source!r} is not an earlier step (the steps before it: "
                      f"{', '.join(sorted(earlier)) or 'none'})")  # fmt: skip
                check(source != REQUEST or not p.inputs or read in p.inputs,
                      f"{where}.inputs.{tensor}", f"{text!r}: the request's declared tensors "
                      f"are {', '.join(p.inputs)} ([{at}.inputs])")  # fmt: skip
            earlier.add(step.name)
        for out, text in p.outputs.items():
            source, _ = source_of(text, f"{at}.outputs.{out}")
            check(source in earlier, f"{at}.outputs.{out}", f"{text!r}: {source!r} is not a "
                  "step of the pipeline")  # fmt: skip
            check(out + ".shapes" not in p.outputs or out not in p.ragged, f"{at}.outputs",
                  f"{out + '.shapes'!r}: the name of {out!r}'s shapes, answered ragged")
        for out in p.ragged:
            check(out in p.outputs, f"{at}.ragged", f"{out!r} is not one of the pipeline's "
                  f"outputs ({', '.join(p.outputs)})")  # fmt: skip
