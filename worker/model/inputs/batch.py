"""A model's request inputs together: one request checked, one batch prepared,
grouped by length and collated into the model's feeds.

``ModelInputs`` is what the stages hold (built once by ``binding.bind``): the
intake calls ``check``; an inference stage calls ``prepare`` for a batch, then
``groups`` and ``collate`` for each engine run.

Grouping is how a batch answers each request exactly as that request alone.
Rows run together only where their free dimensions are equal (Triton's rule),
except on the dimensions binding found safe to pad (``padded_symbols``: a text's
tokens, whose attention mask is fed; a tensor marked ``pad`` whose dependent
outputs are cut back). There, rows whose lengths fall in one bucket
(``batching.length_buckets``, powers of two by default) share a run, padded to
its longest row, which keeps padding under 2x. A batch of several groups runs
as several engine calls, and its answers keep their order (the batch completes
as one).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from worker.contract import Request, Tensor
from worker.flow.errors import InvalidRequest
from worker.model.inputs.base import BoundInput
from worker.model.inputs.state import BoundState
from worker.model.rows import Row


@dataclass(frozen=True)
class Collated:
    """One engine run's inputs: the feeds by model input name, and the length each
    padded symbol was padded to (what outputs sharing it are cut back from)."""

    feeds: dict[str, np.ndarray]
    padded: dict[str, int]


def _unbatched(value: Tensor, ranks: tuple[int, ...]) -> Tensor:
    shape = value.shape
    if len(shape) - 1 in ranks and shape and shape[0] == 1:
        return Tensor(value.dtype, shape[1:], value.data)
    return value


def length_bucket(length: int, buckets: Sequence[int]) -> int:
    """The bucket ``length`` falls in: the first bound >= it, else the next power
    of two (beyond the configured bounds, or when there are none)."""
    i = bisect.bisect_left(buckets, length)
    if i < len(buckets):
        return buckets[i]
    return 1 << max(0, length - 1).bit_length()


class ModelInputs:
    def __init__(
        self,
        kinds: Sequence[BoundInput],
        *,
        constants: Sequence[BoundInput] = (),
        padded: frozenset[str] = frozenset(),
        split_by_length: bool = True,
        length_buckets: Sequence[int] = (),
        batch: int | None = None,
    ) -> None:
        """``kinds``: the request inputs; ``constants``: inputs the worker feeds
        itself; ``padded``: the free dimensions (by symbol) that rows of different
        lengths may be padded on (``binding`` decides: every other free dimension
        groups rows by its exact length); ``batch``: the model's fixed batch size,
        if it has one."""
        self.kinds = tuple(kinds)
        self.constants = tuple(constants)
        # Worker-fed inputs that carry a sequence's state (a stateful model).
        self.states = tuple(k for k in self.constants if isinstance(k, BoundState))
        self.by_name = {k.name: k for k in self.kinds}
        self._constant_names = {k.name: k for k in self.constants}
        self._names = ", ".join(sorted(self.by_name))
        self.split_by_length = split_by_length
        self.length_buckets = tuple(length_buckets)
        self.batch = batch
        # Symbols of free dimensions, and the request inputs that give them.
        symbols: dict[str, list[str]] = {}
        for kind in self.kinds:
            for symbol in kind.free_symbols():
                symbols.setdefault(symbol, []).append(kind.name)
        self.symbols = {s: tuple(dict.fromkeys(names)) for s, names in symbols.items()}
        unknown = padded - self.symbols.keys()
        if unknown:
            raise ValueError(f"padded dimensions {sorted(unknown)} belong to no input")
        self.padded_symbols = frozenset(padded)
        # Per record, only the kinds with free dimensions report lengths (the hot
        # path of an image classifier does no length bookkeeping at all).
        self._measured = frozenset(k.name for k in self.kinds if k.free_symbols())

    def pad_candidates(self) -> frozenset[str]:
        """Free dimensions every input carrying them may pad (before outputs are
        considered): what binding starts from."""
        return frozenset(
            symbol
            for symbol, names in self.symbols.items()
            if all(self.by_name[n].pads for n in names)
        )

    def max_lengths(self) -> dict[str, int]:
        """Each free dimension's bound: the smallest any input gives it (0: none)."""
        out: dict[str, int] = {}
        for kind in self.kinds:
            for symbol, bound in kind.max_lengths().items():
                if bound > 0:
                    out[symbol] = min(bound, out.get(symbol, bound))
                else:
                    out.setdefault(symbol, 0)
        return out

    # --- intake (event loop, per record) -------------------------------------------

    def check(
        self, request: Request, batched: bool = False
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """The request's inputs validated (by request input name) and the lengths of
        their free dimensions known so far; raises ``InvalidRequest`` /
        ``TensorTooLarge`` naming the input, with the request's id and meta.
        ``batched``: tensors may carry a leading batch dimension of 1 (the Open
        Inference Protocol's), dropped where the input's row has one rank fewer."""
        try:
            return self._checked(request.inputs, batched)
        except InvalidRequest as exc:
            exc.request_id, exc.meta = request.id, request.meta
            raise

    def check_arrays(
        self, arrays: Mapping[str, np.ndarray], request_id: str = ""
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """``check`` for inputs a pipeline's earlier steps made: numpy arrays by
        request input name, checked as a request's tensors (or image pixels) are,
        with no wire tensor made and read back (no copy of their data)."""
        try:
            return self._checked(arrays, batched=False)
        except InvalidRequest as exc:
            exc.request_id = request_id
            raise

    def _checked(
        self, given: Mapping[str, Any], batched: bool
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """One body for both callers: a request's values, or a step's arrays."""
        values: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        if given.keys() != self.by_name.keys():  # a name set apart, in C
            self._name_problem(given)
        for kind in self.kinds:
            value = given.get(kind.name)
            if value is None:
                self._name_problem(given)
            if batched and isinstance(value, Tensor):
                value = _unbatched(value, kind.row_ranks())
            row = values[kind.name] = kind.check(value)
            if kind.name not in self._measured:
                continue
            for symbol, n in kind.lengths(row).items():
                seen = lengths.setdefault(symbol, n)
                if seen != n:
                    others = ", ".join(f"inputs.{o}" for o in self.symbols[symbol])
                    raise InvalidRequest(
                        f"inputs.{kind.name}: dimension {symbol!r} is {n} but {seen} in "
                        f"another input ({others} must agree on it)"
                    )
        return values, lengths

    def _name_problem(self, given: Mapping[str, Any]) -> NoReturn:
        """Raise for an input the model does not take, else for one it lacks."""
        for name in given:
            constant = self._constant_names.get(name)
            if constant is not None:
                constant.check(given[name])  # raises: the worker feeds it
            if name not in self.by_name:
                raise InvalidRequest(
                    f"inputs.{name[:64]}: unknown input; the model takes {self._names}"
                )
        missing = next(k.name for k in self.kinds if k.name not in given)
        raise InvalidRequest(
            f"inputs.{missing}: missing (the model takes {self._names}; got "
            f"{', '.join(sorted(given)) or 'none'})"
        )

    # --- inference stage (worker threads, per batch) ---------------------------------

    def pending(self, answers: list[Row]) -> bool:
        """Whether ``prepare`` has work to do for these answers."""
        return any(k.pending(answers) for k in self.kinds)

    def prepare(self, answers: list[Row]) -> list[Row]:
        """Each kind's batch work (decode files, tokenize; a worker thread); returns
        the answers that can run (a failure is that answer's error)."""
        runnable = answers
        for kind in self.kinds:
            kind.prepare(runnable)
            runnable = [a for a in runnable if a.error is None]
        return runnable

    def groups(
        self, answers: list[Row], buckets: Mapping[str, Sequence[int]] | None = None
    ) -> list[list[Row]]:
        """Runs of the batch that go to the engine together, in batch order within
        each: rows of equal free dimensions, except that on a padded dimension
        rows share a run when their lengths fall in one bucket (``buckets`` per
        symbol: a GPU's compiled lengths; else ``batching.length_buckets``), or
        always with ``split_by_length`` off."""
        if not self.symbols or len(answers) < 2:
            return [answers]
        names = tuple(self.symbols)
        padded = self.padded_symbols
        split = self.split_by_length
        groups: dict[tuple[int, ...], list[Row]] = {}
        for answer in answers:
            lengths = answer.lengths
            key = tuple(
                lengths.get(s, 1)
                if s not in padded
                else length_bucket(
                    lengths.get(s, 1), buckets[s] if buckets else self.length_buckets
                )
                if split
                else 0
                for s in names
            )
            groups.setdefault(key, []).append(answer)
        return list(groups.values())

    def bucketed(
        self, answers: Sequence[Row], buckets: Mapping[str, Sequence[int]]
    ) -> dict[str, int]:
        """The lengths a GPU runs ``answers`` (one group) at: on a padded
        dimension, the smallest compiled bucket that holds the longest row; on
        any other, the rows' own length."""
        return {
            s: length_bucket(longest, buckets[s]) if s in self.padded_symbols else longest
            for s, longest in self.padded(answers).items()
        }

    def padded(self, answers: Sequence[Row]) -> dict[str, int]:
        """Each symbol's longest length among ``answers`` (one group): what the CPU
        runs it at (every row's own length where the dimension is not padded)."""
        return {s: max(a.lengths.get(s, 1) for a in answers) for s in self.symbols}

    def collate(
        self,
        answers: Sequence[Row],
        padded: Mapping[str, int] | None = None,
        buffers: Mapping[str, np.ndarray] | None = None,
        kinds: Sequence[BoundInput] | None = None,
    ) -> Collated:
        """The feeds of one engine run, padded to ``padded`` (default: the longest
        rows), written into ``buffers`` where given (by feed name); ``kinds``: only
        these inputs' feeds (a GPU preprocesses its image itself). Constant inputs
        are always fed."""
        sizes = dict(padded) if padded is not None else self.padded(answers)
        out: dict[str, np.ndarray] = dict(buffers or {})
        for kind in self.kinds if kinds is None else kinds:
            kind.collate([a.values[kind.name] for a in answers], sizes, out)
        for fed in self.constants:  # a constant ignores its rows; a state's are the stage's
            fed.collate([a.values.get(fed.name) for a in answers], sizes, out)
        return Collated(out, sizes)

    def waste(self, answers: Sequence[Row], padded: Mapping[str, int]) -> tuple[int, int]:
        """Elements of the free-dimension feeds (real, padded) for a run: the
        padding cost the ``infer_padding_ratio`` metric reports."""
        real = total = 0
        for kind in self.kinds:
            for feed in kind.feeds:
                if not set(feed.symbols()) & self.padded_symbols:
                    continue
                # math.prod, not np.prod: a few ints per row, on the stage's thread
                fixed = math.prod(d for d in feed.shape if isinstance(d, int))
                syms = feed.symbols()
                total += fixed * math.prod(padded[s] for s in syms) * len(answers)
                real += fixed * sum(math.prod(a.lengths.get(s, 1) for s in syms) for a in answers)
        return real, total
