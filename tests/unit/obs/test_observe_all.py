"""``observe_all`` (per batch) exposes exactly what ``observe`` per amount does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from worker.obs.metrics import observe_all

BUCKETS = (0.0001, 0.001, 0.01, 0.1, 1.0, 10.0)
amounts = st.lists(
    st.one_of(
        st.sampled_from([*BUCKETS, 0.0, -1.0, 1e9]),  # bounds themselves, and outside them
        st.floats(min_value=-1.0, max_value=100.0, allow_nan=False),
    ),
    max_size=50,
)


def exposition(values: list[float], batched: bool) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    h = Histogram("t_seconds", "test", ["model"], buckets=BUCKETS, registry=registry)
    child = h.labels("m")
    if batched:
        observe_all(child, values)
    else:
        for v in values:
            child.observe(v)
    return {
        (s.name, s.labels.get("le", "")): s.value
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


@given(amounts, st.integers(1, 3))
def test_batched_observations_expose_what_one_by_one_does(values: list[float], rounds: int) -> None:
    one_by_one = exposition(values * rounds, batched=False)
    batched = exposition(values * rounds, batched=True)
    assert batched.keys() == one_by_one.keys()
    for key, want in one_by_one.items():
        assert abs(batched[key] - want) <= 1e-9 * max(1.0, abs(want)), key


def test_model_metrics_keep_the_serving_version_and_the_one_before() -> None:
    """A swapped-in version's latencies are its own series; the exposition keeps
    the serving version and the one before it (its last batches finish after
    the swap), never every version a long-running worker served."""
    from prometheus_client import REGISTRY

    from worker.obs.metrics import model_metrics

    def versions() -> set[str]:
        return {
            s.labels["version"]
            for family in REGISTRY.collect() if family.name == "infer_request_seconds"
            for s in family.samples if s.labels.get("model") == "swapped"
        }  # fmt: skip

    first = model_metrics("swapped", "v1")
    first.request_seconds("urgent").observe(0.01)
    first.request_seconds("bulk").observe(0.01)
    first.results("ok").inc()
    assert model_metrics("swapped", "v1") is first
    model_metrics("swapped", "v2").request_seconds("bulk").observe(0.02)
    assert versions() == {"v1", "v2"}
    model_metrics("swapped", "v3").request_seconds("bulk").observe(0.03)
    assert versions() == {"v2", "v3"}
    # Per lane (issue 56: the urgent lane's end-to-end latency, apart).
    v1_urgent = {"model": "swapped", "version": "v1", "lane": "urgent"}
    assert REGISTRY.get_sample_value("infer_request_seconds_count", v1_urgent) is None
    v3_bulk = {"model": "swapped", "version": "v3", "lane": "bulk"}
    assert REGISTRY.get_sample_value("infer_request_seconds_count", v3_bulk) == 1
    assert (
        REGISTRY.get_sample_value(
            "infer_results_produced_total", {"model": "swapped", "version": "v1", "status": "ok"}
        )
        is None
    )
