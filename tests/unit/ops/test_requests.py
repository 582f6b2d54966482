"""What ``produce`` sends (worker.ops.requests): samples past the held-out set and
``--count`` cycle with an id per copy and say so, never a silent cap; the one
line printed per answer names a bundled model's class."""

from __future__ import annotations

import numpy as np
import pytest

from worker.contract import ModelInfo, Result, Source, Tensor, decode_request
from worker.flow.errors import ConfigError
from worker.ops.produce import describe
from worker.ops.requests import cycled, from_samples, from_text


def test_samples_past_the_held_out_set_cycle_with_their_own_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    few = from_samples(3)
    assert capsys.readouterr().err == ""
    many = from_samples(725)
    assert "the 360 held-out digits samples, cycled (725 requests" in capsys.readouterr().err
    assert len(many) == 725 and len({r.id for r in many}) == 725
    first, again = decode_request(many[0].value), decode_request(many[360].value)
    assert first.id == many[0].id and again.id == many[360].id
    np.testing.assert_array_equal(
        first.inputs["image"].to_numpy(), again.inputs["image"].to_numpy()  # type: ignore[union-attr]
    )
    assert first.meta == again.meta and many[360].label == many[0].label
    assert [r.label for r in few] == [r.label for r in many[:3]]


def test_count_cycles_what_is_given_each_copy_a_request_of_its_own() -> None:
    given = [from_text("good"), from_text("bad")]
    out = list(cycled(given, 5))
    assert [r.label for r in out] == ["'good'", "'bad'", "'good'", "'bad'", "'good'"]
    assert out[:2] == given and out[2].id == f"{given[0].id}-1" and out[4].id == f"{given[0].id}-2"
    assert [decode_request(r.value).id for r in out] == [r.id for r in out]
    assert decode_request(out[3].value).inputs == decode_request(given[1].value).inputs
    assert list(cycled(given, 1)) == given[:1]
    with pytest.raises(ConfigError, match="--count must be >= 1"):
        list(cycled(given, 0))


def test_an_answer_of_the_bundled_text_model_names_its_class() -> None:
    logits = Tensor.from_numpy(np.array([-1.5, 2.0], dtype=np.float32))
    where = Source("t", 0, 0)
    result = Result(id="r1", status="ok", source=where, outputs={"logits": logits},
                    model=ModelInfo("sentiment", "abc"), timing_us={"total": 900})  # fmt: skip
    line = describe(result)
    assert "logits float32[2] = positive" in line and line.endswith("in 0.9 ms")
    other = Result(id="r2", status="ok", source=where, outputs={"logits": logits},
                   model=ModelInfo("my-model", "abc"))  # fmt: skip
    assert describe(other) == "r2  ok  outputs: logits float32[2]"
