"""From an engine run's outputs to each request's: which outputs a result carries,
postprocessed how, and cut back to the request's own lengths.

Decided once at start-up (``OutputPlan``), applied per run on the stage's thread:

- with postprocessing on (``softmax`` / ``top_k``), ``model.output`` is replaced by
  its computed forms (``topk_indices`` + ``topk_scores``, or ``probabilities``;
  the raw tensor too with ``include_raw``), plus any outputs ``model.outputs``
  names; with it off, every output (or those ``model.outputs`` names) comes back
  as computed, ``model.output`` L2-normalised with ``normalize``;
- an output axis that carries the symbol of a padded input dimension (ONNX
  names them: a per-token output of a text model shares ``sequence`` with
  ``input_ids``) is cut back to the request's own length, so padding never shows
  in an answer. Postprocessing of such an output runs per row, after the cut;
- a request's row of an output is taken at the output's batch axis (the first,
  or a recurrent state's ``[layers, batch, hidden]`` middle one).

Which outputs come back is ``worker.model.io.select_outputs``'s decision, shared
with the start-up binding, which refuses padding an output could not be cut
back from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from worker.config import ModelConfig, PostprocessConfig
from worker.flow.errors import ConfigError, InferenceFailed
from worker.model.io import ModelIO
from worker.model.postprocess import l2_normalize, postprocess
from worker.model.rows import Row


@dataclass(frozen=True)
class OutputSelection:
    """Which model outputs a result carries, decided once from the settings:
    ``raw`` is ``model.output`` (what postprocessing reads; default the first
    output with a batch dimension), ``passed`` come back as computed, and with
    postprocessing on, ``raw``'s computed forms replace it (``worker.compute.
    outputs``). An output without a batch dimension (one value for the whole
    batch) cannot be a request's answer: left out by default, refused by name."""

    raw: str
    passed: tuple[str, ...]
    postprocessed: bool  # raw is replaced by its computed forms

    @property
    def returned(self) -> tuple[str, ...]:
        """Every model output whose rows a result carries (its shape matters)."""
        if self.postprocessed:
            return tuple(dict.fromkeys((*self.passed, self.raw)))
        return self.passed


def select_outputs(
    io: ModelIO, output: str | None, outputs: Sequence[str], postprocessed: bool
) -> OutputSelection:
    """``output`` / ``outputs``: ``model.output`` and ``model.outputs``;
    ``postprocessed``: the resolved postprocessing replaces ``model.output``."""
    names = io.output_names
    if not names:
        raise ConfigError("model.path: the model declares no outputs")
    batched = tuple(t.name for t in io.outputs if t.batched)
    raw = output or (batched[0] if batched else names[0])
    if raw not in names:
        raise ConfigError(f"model.output: {raw!r} not in model outputs {list(names)}")
    for name in outputs:
        if name not in names:
            raise ConfigError(f"model.outputs: {name!r} not in model outputs {list(names)}")
    passed = tuple(outputs) if postprocessed or outputs else batched
    selection = OutputSelection(raw, passed, postprocessed)
    for name in selection.returned:
        desc = io.output(name)
        if desc is not None and not desc.batched:
            setting = "model.output" if name == raw and name not in passed else "model.outputs"
            raise ConfigError(
                f"{setting}: the output {name!r} ({desc.shown()}) has no batch dimension: it "
                "is one value for the whole batch, not a row per request; leave it out"
            )
    return selection


# ``model.output_axes.NAME = "none"``: the output has no batch axis.
NO_BATCH_AXIS: Final = -1


class OutputPlan:
    def __init__(
        self,
        io: ModelIO,
        model: ModelConfig,
        post: PostprocessConfig,
        padded_symbols: frozenset[str] = frozenset(),
    ) -> None:
        """``post``: resolved postprocessing settings; ``padded_symbols``: the free
        dimensions the inputs pad (``ModelInputs.padded_symbols``)."""
        selection = select_outputs(io, model.output, model.outputs, post.active)
        self.raw_name = selection.raw
        self.post = post
        self.active = post.active
        self.passed = selection.passed
        # Per output: the (axis, symbol) pairs cut back to each request's length.
        self.cuts: dict[str, tuple[tuple[int, str], ...]] = {}
        # Per output not batched on its first axis: where its rows are (a state).
        self.axes: dict[str, int] = {}
        for desc in io.outputs:
            cuts = tuple(
                (axis, desc.symbol(axis))
                for axis in desc.free_axes
                if desc.symbol(axis) in padded_symbols
            )
            if cuts:
                self.cuts[desc.name] = cuts
            if desc.batch_axis:
                self.axes[desc.name] = desc.batch_axis
        # What each run must return a row of: the returned outputs, and model.output
        # when postprocessing reads it; each held to what the model declares.
        self.used = selection.returned
        self.declared = {d.name: d for d in io.outputs if d.name in self.used}
        self.fixed_batch = io.batch
        for name, axis in model.output_axes.items():
            self._rows_at(io, name, axis)

    def _rows_at(self, io: ModelIO, name: str, axis: object) -> None:
        """``model.output_axes``: the output's rows are at ``axis`` ("none": it has
        no batch axis, a batch-1 model's whole output is its row), whatever the
        file declares; its declaration is not held against it, its rows are."""
        setting = f"model.output_axes.{name}"
        if name not in io.output_names:
            raise ConfigError(f"{setting}: the model has no output {name!r} "
                              f"(its outputs: {', '.join(io.output_names)})")  # fmt: skip
        if axis == "none":
            if io.batch != 1:
                raise ConfigError(
                    f'{setting} = "none": only a model of fixed batch 1 can have an output '
                    "without a batch axis (one request per run); this one's batch is "
                    f"{'free' if io.batch is None else io.batch}"
                )
            self.axes[name] = NO_BATCH_AXIS
        else:
            assert isinstance(axis, int)
            self.axes[name] = axis
        self.declared.pop(name, None)
        self.cuts.pop(name, None)  # cut back by a declaration that does not hold: no

    def first_rows(
        self, raw: Mapping[str, np.ndarray], n: int, run_rows: int
    ) -> dict[str, np.ndarray]:
        """The first ``n`` rows of each output a result needs, at its batch axis (a
        run of ``run_rows`` of a fixed-batch model, filled up past the requests it
        answers); each output first held to its declaration (``check``)."""
        out = dict(raw)
        for name in self.used:
            arr = raw.get(name)
            if arr is None:
                raise InferenceFailed(f"the engine returned no output {name!r}")
            self.check(name, arr, run_rows)
            axis = self.axes.get(name, 0)
            if axis == NO_BATCH_AXIS:
                continue  # the whole output is the run's one row (scatter gives it an axis)
            out[name] = arr[(slice(None),) * axis + (slice(0, n),)]
        return out

    def check(self, name: str, arr: np.ndarray, rows: int) -> None:
        """``arr`` is output ``name`` as the model declares it for a run of ``rows``:
        its rank, ``rows`` on its batch axis, every fixed dimension. Otherwise
        ``InferenceFailed`` (each request of the run is answered
        ``inference_failed``) naming the output and both shapes. A declaration
        that does not hold would have the rows taken from the wrong axis: a
        fixed-batch OCR model from PyPI declares ``[1, seqlen]`` and returns
        ``[seqlen, 1, C]``, and "the first row" was its first time step, answered
        ``ok`` (issue 37)."""
        desc = self.declared.get(name)
        axis = self.axes.get(name, 0)
        if axis == NO_BATCH_AXIS:  # the whole output is the row of a run of one
            if rows != 1:
                raise InferenceFailed(f"output {name}: a run of {rows} rows, but "
                                      f"model.output_axes.{name} = \"none\"")  # fmt: skip
            return
        if desc is None:  # nothing declared to hold it to: the rows at least
            if arr.ndim <= axis or arr.shape[axis] != rows:
                raise InferenceFailed(f"output {name} has shape {list(arr.shape)}: not "
                                      f"{rows} rows on axis {axis}")  # fmt: skip
            return
        want = desc.full_shape(rows)
        problem = None
        if arr.ndim != len(want):
            problem = f"rank {arr.ndim}, not {len(want)}"
        else:
            for i, (dim, got) in enumerate(zip(want, arr.shape, strict=True)):
                if isinstance(dim, int) and dim != got:
                    what = "the run's rows" if i == desc.batch_axis else "declared"
                    problem = f"axis {i} is {got}, not {dim} ({what})"
                    break
        if problem is not None:
            batch = "batch" if self.fixed_batch is None else self.fixed_batch
            declared = ", ".join("?" if d is None else str(d) for d in desc.full_shape(batch))
            raise InferenceFailed(
                f"output {name!r}: the model declares [{declared}], the engine returned "
                f"{list(arr.shape)} for a run of {rows} ({problem}): the model file's "
                "declaration does not hold, so no request's row can be told; fix the "
                "export, or leave the output out (model.outputs)"
            )

    def columns(self, raw: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """An engine run's outputs for its ``n`` rows as whole-batch arrays, a row
        a request, as ``scatter`` would give them out (a plan with nothing cut
        back to a request's length only: ``cuts`` empty). What a pipeline keeps
        of a step it runs as columns, sliced per region with no answer made."""
        assert not self.cuts
        batch: dict[str, np.ndarray] = {}
        raw = self._rows_first(raw, n, None)
        for name in self.passed:
            batch[name] = raw[name]
        if self.active:
            self._postprocess(raw, (), batch, {})
        elif self.post.normalize and self.raw_name in batch:
            batch[self.raw_name] = l2_normalize(batch[self.raw_name])
        return batch

    def _rows_first(self, raw: Mapping[str, np.ndarray], n: int,
                    forms: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:  # fmt: skip
        """The outputs a run must return, each checked (a row for each request, as
        declared) and with its rows on the first axis."""
        raw = dict(raw)
        for name in self.used if forms is None else self.passed:
            arr = raw.get(name)
            if arr is None:
                raise InferenceFailed(f"the engine returned no output {name!r}")
            self.check(name, arr, n)  # a row for each request, as declared
            axis = self.axes.get(name, 0)
            if axis == NO_BATCH_AXIS:
                raw[name] = arr[None]
            elif axis:
                raw[name] = np.moveaxis(arr, axis, 0)
        return raw

    def scatter(
        self,
        raw: Mapping[str, np.ndarray],
        answers: Sequence[Row],
        forms: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Fill each answer's ``outputs`` with its row of every output it carries.
        ``forms``: the postprocessed forms when the device computed them (then
        ``raw`` holds only the outputs passed as they are)."""
        n = len(answers)
        raw = self._rows_first(raw, n, forms)
        batch: dict[str, np.ndarray] = {}  # whole-batch arrays, one row per request
        rows: dict[str, list[np.ndarray]] = {}  # per-request rows (cut back)
        for name in self.passed:
            if name in self.cuts:
                rows[name] = self._cut(raw[name], name, answers)
            else:
                batch[name] = raw[name]
        if self.active and forms is not None:
            batch.update(forms)
        elif self.active:
            self._postprocess(raw, answers, batch, rows)
        elif self.post.normalize:
            name = self.raw_name
            if name in rows:
                rows[name] = [l2_normalize(r) for r in rows[name]]
            elif name in batch:
                batch[name] = l2_normalize(batch[name])
        for i, answer in enumerate(answers):
            out = {name: arr[i] for name, arr in batch.items()}
            for name, per_row in rows.items():
                out[name] = per_row[i]
            answer.outputs = out

    def _postprocess(
        self,
        raw: Mapping[str, np.ndarray],
        answers: Sequence[Row],
        batch: dict[str, np.ndarray],
        rows: dict[str, list[np.ndarray]],
    ) -> None:
        name = self.raw_name
        if name not in self.cuts:
            batch.update(postprocess(raw[name], self.post, name))
            return
        cut = self._cut(raw[name], name, answers)
        per_row = [postprocess(r[None], self.post, name) for r in cut]
        for form in per_row[0] if per_row else {}:
            rows[form] = [p[form][0] for p in per_row]

    def _cut(self, arr: np.ndarray, name: str, answers: Sequence[Row]) -> list[np.ndarray]:
        cuts = self.cuts[name]
        out = []
        for i, answer in enumerate(answers):
            lengths = answer.lengths
            index: list[slice] = [slice(None)] * (arr.ndim - 1)
            for axis, symbol in cuts:
                index[axis] = slice(0, lengths.get(symbol, arr.shape[axis + 1]))
            out.append(arr[i][tuple(index)])
        return out
