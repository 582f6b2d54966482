"""Several models in one worker: each model paused at one batch of records in
flight (at least 256) where the bound is left to derive, so one model's backlog
does not hold the loop and the writer ahead of another's requests; an operator's
bound is kept; a lone model keeps a lone model's bound."""

from __future__ import annotations

from worker.app.lanes import APART_MIN_INFLIGHT, apart_bound, backpressure
from worker.config import BatchingConfig, KafkaConfig, ModelConfig, Settings


def test_a_derived_bound_is_one_batch_at_least_256_and_a_set_one_is_kept() -> None:
    assert apart_bound(BatchingConfig()) == APART_MIN_INFLIGHT == 256
    assert apart_bound(BatchingConfig(max_batch_size=512)) == 512
    assert apart_bound(BatchingConfig().sized(300)) == 300  # the model's batch, derived
    assert apart_bound(BatchingConfig(max_inflight_records=5000)) == 5000
    lone = BatchingConfig()
    assert lone.max_inflight_records == 1024 and lone.inflight_derived


def test_several_models_are_bounded_apart_and_one_model_as_before() -> None:
    one = Settings()
    alone, _ = backpressure(one)
    assert not alone.apart and alone.lanes[0].max_records == one.batching.max_inflight_records
    two = Settings(kafka=KafkaConfig(input_topics=("a", "b")))
    other = Settings(model=ModelConfig(name="bulk"))
    apart, ranks = backpressure(two, [two, other], {"a": 0, "b": 1})
    assert ranks == {"a": 0, "b": 1}  # each topic its model's rank
    assert apart.apart and [b.max_records for b in apart.lanes] == [256, 256]
    assert apart.labels == ["digits", "bulk"] and apart.groups is None
