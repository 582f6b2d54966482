"""``[model.state.NAME]``: a model input that carries a sequence's state.

A stateful model (a voice-activity detector's LSTM state, a session model's
hidden state) takes its state as an input and returns the next one as an
output. The worker keeps each sequence's state (the record key is the
sequence; ``worker.model.state``) and feeds it here: requests never carry it
(one that does is told so), and the output that carries the next state is kept
by the worker, not returned. Rows are stacked at the state's batch axis
(``[layers, batch, hidden]``: axis 1), as any input's.

Start-up checks the mapping against the model file: the input and the output
exist, have the same dtype and rank, agree on every dimension both fix, and
the state has a batch dimension where the configuration says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worker.config.model import StateConfig
from worker.flow.errors import ConfigError
from worker.model.inputs.base import WorkerSetInput, pad_rows
from worker.model.io import ModelIO, TensorDesc


class BoundState(WorkerSetInput):
    kind = "state"

    def __init__(self, name: str, cfg: StateConfig, io: ModelIO) -> None:
        at = f"model.state.{name}"
        desc = io.input(name)
        if desc is None:
            raise ConfigError(
                f"{at}: the model has no input {name!r} (its inputs: {', '.join(io.input_names)})"
            )
        super().__init__(name, (desc,))
        self.desc = desc
        self.output = _output(cfg, io, desc, at)
        self.initial = _initial(cfg, desc, at)
        self.set_by = (
            f"the sequence's state, kept by the worker (model.state.{name}); "
            "leave it out, and send sequence_start to begin a sequence afresh"
        )

    def collate(
        self, rows: Sequence[Any], padded: Mapping[str, int], out: dict[str, np.ndarray]
    ) -> None:
        pad_rows(rows, self.desc, padded, 0.0, out)

    def describe(self) -> str:
        return (
            f"{self.name} (state -> {self.desc.name} {self.desc.shown()}, next from "
            f"{self.output.name}, batch axis {self.desc.batch_axis})"
        )


def _output(cfg: StateConfig, io: ModelIO, state: TensorDesc, at: str) -> TensorDesc:
    out = next((d for d in io.outputs if d.name == cfg.output), None)
    if out is None:
        raise ConfigError(
            f"{at}.output: the model has no output {cfg.output!r} (its outputs: "
            f"{', '.join(d.name for d in io.outputs)})"
        )
    if state.batch_axis is None:
        raise ConfigError(
            f"{at}: the model input {state.name!r} ({state.shown()}) has no batch dimension "
            "the file names, so the states of several sequences cannot share a run; where "
            f"one of its dimensions is the batch, unnamed in the file, set {at}.batch_axis"
        )
    if cfg.batch_axis is not None and cfg.batch_axis != state.batch_axis:
        raise ConfigError(
            f"{at}.batch_axis: {cfg.batch_axis}, but the model file puts the batch dimension "
            f"of {state.name!r} at axis {state.batch_axis} ({state.shown()})"
        )
    if not state.fixed:
        raise ConfigError(
            f"{at}: the state {state.name!r} ({state.shown()}) has free dimensions besides its "
            "batch; a state's shape must be fixed"
        )
    mismatch = (
        out.dtype != state.dtype
        or len(out.shape) != len(state.shape)
        or out.batch_axis not in (None, state.batch_axis)
        or any(isinstance(o, int) and o != s for o, s in zip(out.shape, state.shape, strict=True))
    )
    if mismatch:
        raise ConfigError(
            f"{at}.output: {out.name!r} ({out.dtype.name} {out.shown()}) cannot be the next "
            f"{state.name!r} ({state.dtype.name} {state.shown()}): dtype, rank, fixed "
            "dimensions and batch axis must agree"
        )
    return out


def _initial(cfg: StateConfig, desc: TensorDesc, at: str) -> np.ndarray:
    shape = tuple(int(d) for d in desc.shape if isinstance(d, int))
    try:
        value = np.full(shape, cfg.initial, dtype=desc.dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{at}.initial: {cfg.initial!r} is not {desc.dtype.name}: {exc}") from exc
    value.setflags(write=False)
    return value
