"""The batch size the CPU path derives from the loaded model when
``batching.max_batch_size`` is left to derive (``worker.app.plan``)."""

from __future__ import annotations

import numpy as np
import pytest

from worker.app.plan import BATCH_ROWS, RunPlan, as_run, batch_rows, sized_for
from worker.compute.engines import load_engine
from worker.config import BatchingConfig, KafkaConfig, LaneConfig, ModelConfig, Settings
from worker.model.io import EngineInfo, ModelIO, TensorDesc

F32, I64 = np.dtype("float32"), np.dtype("int64")


def info(*inputs: TensorDesc, batch: int | None = None) -> EngineInfo:
    io = ModelIO(inputs, (TensorDesc("out", F32, (10,)),), batch=batch)
    return EngineInfo("onnxruntime", "m", "v", io, None)


def test_small_rows_fill_a_batch_up_to_its_bytes_within_the_bounds() -> None:
    assert batch_rows(info(TensorDesc("image", F32, (1, 8, 8)))) == 256  # 256 B a row
    assert batch_rows(info(TensorDesc("x", F32, (128,)))) == 128  # 512 B
    assert batch_rows(info(TensorDesc("x", F32, (16,)))) == BATCH_ROWS[1]  # capped
    # Two inputs: a row is both.
    assert batch_rows(info(TensorDesc("a", F32, (64,)), TensorDesc("b", F32, (64,)))) == 128


def test_large_rows_keep_the_default() -> None:
    assert batch_rows(info(TensorDesc("image", F32, (3, 224, 224)))) == BATCH_ROWS[0]


def test_unknown_row_sizes_and_fixed_batches_are_not_derived() -> None:
    assert batch_rows(info(TensorDesc("ids", I64, ("sequence",)))) is None
    assert batch_rows(info(TensorDesc("x", F32, (4,)), batch=1)) is None


def test_sized_settings_follow_the_model_only_where_left_to_derive() -> None:
    small = info(TensorDesc("image", F32, (1, 8, 8)))
    sized = sized_for(Settings(), small)
    b = sized.batching
    assert b.max_batch_size == 256
    # The defaults derived from the batch size follow it.
    assert (b.queue_capacity, b.max_inflight_records) == (2048, 2 * 256 * 4)
    assert RunPlan.of(sized).batch_buckets[-1] == 256
    # Set explicitly, the batch size is the user's; so are the other settings.
    explicit = Settings(batching=BatchingConfig(max_batch_size=64))
    assert sized_for(explicit, small) is explicit
    kept = sized_for(Settings(batching=BatchingConfig(max_inflight_records=500)), small)
    assert (kept.batching.max_batch_size, kept.batching.max_inflight_records) == (256, 500)
    # A preferred size above what the model would get is kept reachable.
    preferred = Settings(batching=BatchingConfig(preferred_batch_sizes=(512,)))
    assert preferred.batching.max_batch_size == 512
    assert sized_for(preferred, small).batching.max_batch_size == 512


def test_priority_lanes_keep_the_default_batch_size() -> None:
    kafka = KafkaConfig(
        input_topics=("u", "b"),
        lanes=(LaneConfig(topics=("u",), priority=0), LaneConfig(topics=("b",), priority=1)),
    )
    laned = Settings(kafka=kafka)
    assert sized_for(laned, info(TensorDesc("image", F32, (1, 8, 8)))) is laned


def test_the_bundled_model_gets_256_rows() -> None:
    s = Settings()
    engine = load_engine(s.model)
    try:
        assert sized_for(s, engine.info).batching.max_batch_size == 256
    finally:
        engine.close()


def test_the_config_command_shows_the_batch_size_the_worker_would_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert as_run(Settings()).batching.max_batch_size == 256
    explicit = Settings(batching=BatchingConfig(max_batch_size=64))
    assert as_run(explicit) is explicit
    missing = Settings(model=ModelConfig(path="/no/such/model.onnx"))
    assert as_run(missing).batching.max_batch_size == 64
    assert "derived from the model at start-up" in capsys.readouterr().err
