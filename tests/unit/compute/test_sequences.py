"""A stateful model's sequences without a broker: binding a state input to the
model file (the refusals name the setting), one request per sequence per run in
the order read, states loaded and stored per key, reset, ended, bounded,
expired and dropped with their partition. The model served from Kafka is
tests/integration/test_stateful.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from worker.compute.sequences import SequenceStates, waves
from worker.config import LimitsConfig, ModelConfig
from worker.config.model import StateConfig
from worker.flow.errors import ConfigError, InvalidRequest
from worker.flow.messages import Job, TopicPartition
from worker.flow.values import Request
from worker.model.inputs import bind
from worker.model.inputs.state import BoundState
from worker.model.io import ModelIO, TensorDesc
from worker.model.rows import Row

F32 = np.dtype(np.float32)
VAD = ModelIO(
    (TensorDesc("input", F32, ("samples",)), TensorDesc("state", F32, (2, 4), batch_axis=1)),
    (TensorDesc("output", F32, (1,)), TensorDesc("stateN", F32, ("a", "b"), batch_axis=1)),
)
A, B = TopicPartition("in", 0), TopicPartition("in", 1)


def model(**state: object) -> ModelConfig:
    return ModelConfig(path="m.onnx", state={"state": StateConfig(**state)})  # type: ignore[arg-type]


def row(key: bytes | None, tp: TopicPartition = A, start: bool = False, end: bool = False) -> Row:
    request = Request(v=1, id="r", inputs={}, sequence_start=start, sequence_end=end)
    return Row.of(Job(tp, 0, key, 0.0, None, request=request))


def test_a_state_input_is_fed_by_the_worker_not_by_requests() -> None:
    inputs = bind(model(output="stateN"), VAD, LimitsConfig())
    assert [k.name for k in inputs.kinds] == ["input"]
    (state,) = inputs.states
    assert isinstance(state, BoundState) and state.output.name == "stateN"
    assert state.initial.shape == (2, 4) and not state.initial.any()
    assert state.free_symbols() == ()
    with pytest.raises(
        InvalidRequest,
        match=r"inputs\.state: the sequence's state, kept by the worker "
        r"\(model\.state\.state\); leave it out, and send sequence_start",
    ):
        state.check(np.zeros((2, 4), F32))


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"output": "nope"}, r"model\.state\.state\.output: the model has no output 'nope'"),
        ({"output": "output"}, r"cannot be the next 'state'"),
        ({"output": "stateN", "batch_axis": 0}, r"batch_axis: 0, but the model file puts"),
    ],
)
def test_a_state_that_does_not_fit_the_model_is_refused_naming_the_setting(
    state: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        bind(model(**state), VAD, LimitsConfig())


def test_a_model_without_the_input_is_refused() -> None:
    cfg = ModelConfig(path="m.onnx", state={"h": StateConfig(output="stateN")})
    with pytest.raises(ConfigError, match=r"model\.state\.h: the model has no input 'h'"):
        bind(cfg, VAD, LimitsConfig())


def test_waves_hold_one_row_per_sequence_in_the_order_read() -> None:
    rows = [row(b"a"), row(b"b"), row(b"a"), row(b"c"), row(b"a"), row(b"b")]
    got = [[r.job.key for r in wave] for wave in waves(rows)]
    assert got == [[b"a", b"b", b"c"], [b"a", b"b"], [b"a"]]


def states(
    max_sequences: int = 10, ttl: float = 60.0, owns: Callable[[Job], bool] = lambda job: True
) -> tuple[SequenceStates, BoundState]:
    (state,) = bind(model(output="stateN"), VAD, LimitsConfig()).states
    return SequenceStates([state], ttl, max_sequences, owns), state


def ran(r: Row, value: float) -> None:
    r.outputs = {"output": np.zeros(1, F32), "stateN": np.full((2, 4), value, F32)}


def test_a_sequence_continues_from_its_last_state_until_reset_or_ended() -> None:
    seqs, _ = states()
    first = row(b"k")
    assert seqs.load(first, 0.0) and not first.values["state"].any()
    ran(first, 1.0)
    seqs.store(first)
    assert first.outputs is not None and set(first.outputs) == {"output"}
    second = row(b"k")
    assert seqs.load(second, 1.0) and (second.values["state"] == 1.0).all()
    restart = row(b"k", start=True)
    assert seqs.load(restart, 2.0) and not restart.values["state"].any()
    ran(restart, 2.0)
    ending = row(b"k", end=True)
    seqs.store(restart)
    assert seqs.load(ending, 3.0) and (ending.values["state"] == 2.0).all()
    ran(ending, 3.0)
    seqs.store(ending)
    assert len(seqs) == 0


def test_no_key_and_no_room_are_answered_never_evicting_a_live_sequence() -> None:
    seqs, _ = states(max_sequences=2, ttl=60.0)
    keyless = row(None)
    assert not seqs.load(keyless, 0.0) and keyless.error is not None
    assert keyless.error.code == "invalid_request" and "record key" in keyless.error.message
    assert seqs.load(row(b"a"), 0.0) and seqs.load(row(b"b"), 0.0)
    third = row(b"c")
    assert not seqs.load(third, 1.0) and third.error is not None
    assert third.error.code == "too_many_sequences" and len(seqs) == 2
    assert seqs.load(row(b"c"), 61.0)  # "a" and "b" idle past the TTL: expired, room again
    assert len(seqs) == 1


def test_a_revoked_partition_takes_its_sequences_along() -> None:
    seqs, _ = states()
    assert seqs.load(row(b"a", A), 0.0) and seqs.load(row(b"b", B), 0.0)
    assert seqs.forget({A}) == 1 and len(seqs) == 1


def test_a_row_read_before_its_partition_was_revoked_touches_no_state() -> None:
    """Still in the pipeline when the partition came back: its state was restored
    since, and its record is read again; running it would apply it twice."""
    seqs, _ = states(owns=lambda job: job.epoch == 1)
    stale = row(b"a")  # epoch 0
    assert not seqs.load(stale, 0.0) and len(seqs) == 0
    assert stale.error is not None and "revoked" in stale.error.message


def test_a_restored_sequence_continues_and_one_that_no_longer_fits_is_skipped() -> None:
    seqs, _ = states()
    good = {"state": np.full((2, 4), 5.0, F32)}
    bad = {"state": np.zeros((3, 4), F32)}
    assert seqs.restore(A, {b"a": good, b"b": bad}, 0.0) == 1
    r = row(b"a")
    assert seqs.load(r, 1.0) and (r.values["state"] == 5.0).all()
