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
  in an answer. Postprocessing of such an output runs per row, after the cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from worker.config import ModelConfig, PostprocessConfig
from worker.errors import ConfigError, InferenceFailed
from worker.inference.postprocess import l2_normalize, postprocess
from worker.model import ModelIO
from worker.records import Answer


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
        names = io.output_names
        if not names:
            raise ConfigError("model.path: the model declares no outputs")
        self.raw_name = model.output or names[0]
        if self.raw_name not in names:
            raise ConfigError(f"model.output: {self.raw_name!r} not in model outputs {list(names)}")
        for name in model.outputs:
            if name not in names:
                raise ConfigError(f"model.outputs: {name!r} not in model outputs {list(names)}")
        self.post = post
        self.active = post.active
        if self.active:
            self.passed = tuple(model.outputs)  # returned as computed, beside the forms
        else:
            self.passed = tuple(model.outputs) or names
        # Per output: the (axis, symbol) pairs cut back to each request's length.
        self.cuts: dict[str, tuple[tuple[int, str], ...]] = {}
        for desc in io.outputs:
            cuts = tuple(
                (axis, desc.symbol(axis))
                for axis in desc.free_axes
                if desc.symbol(axis) in padded_symbols
            )
            if cuts:
                self.cuts[desc.name] = cuts
        self.used = tuple(dict.fromkeys((*self.passed, self.raw_name)))

    def scatter(
        self,
        raw: Mapping[str, np.ndarray],
        answers: Sequence[Answer],
        forms: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Fill each answer's ``outputs`` with its row of every output it carries.
        ``forms``: the postprocessed forms when the device computed them (then
        ``raw`` holds only the outputs passed as they are)."""
        n = len(answers)
        for name in self.used if forms is None else self.passed:
            arr = raw.get(name)
            if arr is None:
                raise InferenceFailed(f"the engine returned no output {name!r}")
            if arr.ndim < 1 or arr.shape[0] != n:  # a model that does not return a row each
                raise InferenceFailed(f"output {name} has {arr.shape[0] if arr.ndim else 0} "
                                      f"rows for {n} requests")  # fmt: skip
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
        answers: Sequence[Answer],
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

    def _cut(self, arr: np.ndarray, name: str, answers: Sequence[Answer]) -> list[np.ndarray]:
        cuts = self.cuts[name]
        out = []
        for i, answer in enumerate(answers):
            lengths = answer.job.lengths
            index: list[slice] = [slice(None)] * (arr.ndim - 1)
            for axis, symbol in cuts:
                index[axis] = slice(0, lengths.get(symbol, arr.shape[axis + 1]))
            out.append(arr[i][tuple(index)])
        return out
