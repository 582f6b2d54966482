"""Memory shared by demand (``worker.app.demand``), without a broker: real CPU
stages over the bundled digits model, each counted at a size the test gives
(a model's loads measure well under it, and it counts the most any measured),
under a budget holding two of three. Which model is evicted (the least recently
used idle one, one without a backlog first, never a pinned or busy one), that a
load waits for a busy model rather than exceed the budget, prefetch from a
backlog, and a tombstone's unload. Through a broker and worker processes:
tests/integration/test_models_on_demand.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from worker.app.demand import Residency
from worker.app.memory import MIB
from worker.app.residents import Pool, Resident
from worker.compute.cpu import CpuStage, Unloaded
from worker.compute.engines import load_engine
from worker.config import load_settings
from worker.flow.errors import ConfigError
from worker.model.inputs import bind_model
from worker.obs import metrics

SIZE = 40 * MIB
BUDGET = 100 * MIB  # two of the three


def resident(name: str, loaded: bool = True, pinned: bool = False) -> Resident:
    s = load_settings(env={"INFER_WORKER_MODEL__PATH": "builtin:digits"})
    engine = load_engine(s.model)
    binding = bind_model(s.model, engine.info.io, s.limits, s.batching)
    stage = CpuStage(asyncio.Queue(), asyncio.Queue(), engine, binding, max_batch_size=8,
                     max_inflight=1)  # fmt: skip
    if not loaded:
        stage.install(Unloaded(engine.info)).close()
    return Resident(name, stage, s, SIZE, pinned=pinned)


def loaded(r: Residency) -> set[str]:
    return {m.name for m in r.residents if m.loaded}


async def test_the_least_recently_used_idle_model_makes_room() -> None:
    a, b, c = resident("a"), resident("b"), resident("c", loaded=False)
    a.last_used, b.last_used = 1.0, 2.0
    r = Residency(Pool(BUDGET, 0), [a, b, c])
    async with r.held("c") as refused:
        assert refused is None and loaded(r) == {"b", "c"}
        assert r.used() <= BUDGET
    async with r.held("a"):  # c just ended its batch: b is now the least recently used
        assert loaded(r) == {"a", "c"}
    assert metrics.MODELS_MEMORY_USED._value.get() == 2 * SIZE


async def test_a_model_with_a_backlog_is_evicted_after_those_without() -> None:
    a, b, c = resident("a"), resident("b"), resident("c", loaded=False)
    a.last_used, b.last_used = 1.0, 2.0
    r = Residency(Pool(BUDGET, 0), [a, b, c])
    r.observe({"a": 10})  # a's topics have records waiting: kept, b goes though newer
    async with r.held("c"):
        assert loaded(r) == {"a", "c"}


async def test_a_pinned_model_is_never_evicted() -> None:
    a, b, c = resident("a", pinned=True), resident("b"), resident("c", loaded=False)
    a.last_used, b.last_used = 1.0, 2.0
    r = Residency(Pool(BUDGET, 0), [a, b, c])
    async with r.held("c"):
        assert loaded(r) == {"a", "c"}
    async with r.held("b"):
        assert loaded(r) == {"a", "b"}


async def test_a_load_waits_for_a_busy_model_rather_than_exceed_the_budget() -> None:
    a, b, c = resident("a"), resident("b"), resident("c", loaded=False)
    r = Residency(Pool(BUDGET, 0), [a, b, c])
    release = asyncio.Event()
    entered = asyncio.Event()

    async def batch(name: str) -> None:
        async with r.held(name):
            entered.set()
            await release.wait()

    busy = [asyncio.create_task(batch("a")), asyncio.create_task(batch("b"))]
    await entered.wait()
    waiting = asyncio.create_task(batch("c"))
    await asyncio.sleep(0.2)
    assert loaded(r) == {"a", "b"}  # both busy: nothing evicted yet
    assert r.used() <= BUDGET
    release.set()
    await asyncio.gather(*busy, waiting)
    assert "c" in loaded(r) and len(loaded(r)) == 2 and r.used() <= BUDGET


async def test_a_backlog_loads_a_model_before_its_requests_come() -> None:
    a, c = resident("a"), resident("c", loaded=False)
    a.last_used = 1.0
    r = Residency(Pool(BUDGET, 30 * MIB), [a, c])  # 30 MiB held for good: one fits beside it
    r.observe({"c": 3})
    for _ in range(100):
        if c.loaded:
            break
        await asyncio.sleep(0.02)
    assert loaded(r) == {"c"} and r.used() == 30 * MIB + SIZE
    await r.close()


async def test_a_tombstone_frees_the_model_once_its_batch_ended_and_refuses_the_next() -> None:
    a = resident("a")
    r = Residency(Pool(0, 0), [a])
    release = asyncio.Event()

    async def batch() -> None:
        async with r.held("a") as refused:
            assert refused is None
            await release.wait()

    running = asyncio.create_task(batch())
    await asyncio.sleep(0)
    unloading = asyncio.create_task(r.unload("a", "a is unloaded"))
    await asyncio.sleep(0.05)
    assert loaded(r) == {"a"}  # its running batch holds it
    release.set()
    await asyncio.gather(running, unloading)
    assert loaded(r) == set()
    async with r.held("a") as refused:
        assert refused is not None and loaded(r) == set()  # not loaded for a refusal
        assert (refused.code, refused.message) == ("unknown_model", "a is unloaded")
    await r.served("a")
    async with r.held("a") as refused:
        assert refused is None and loaded(r) == {"a"}


async def test_batches_are_let_in_in_the_order_they_came() -> None:
    """A batch dispatched later, finding its model loaded, waits for an earlier
    one still queued for the load: else it would run first, on the version
    before a swap the earlier one then runs on (a partition's offsets answered
    out of version order)."""
    c = resident("c", loaded=False)
    r = Residency(Pool(0, 0), [c])
    order: list[str] = []
    later: list[asyncio.Task[None]] = []
    release = asyncio.Event()

    async def batch(tag: str) -> None:
        async with r.held("c"):
            order.append(tag)

    async def swap() -> None:  # holds the residency's lock while it loads
        await release.wait()
        c.stage.load(load_engine(c.settings.model))
        later.append(asyncio.create_task(batch("later")))  # dispatched now: finds c loaded

    swapping = asyncio.create_task(r.swapping("c", swap, c.settings))
    await asyncio.sleep(0)
    earlier = asyncio.create_task(batch("earlier"))  # queued for the load behind the swap
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.gather(swapping, earlier)
    await asyncio.gather(*later)
    assert order == ["earlier", "later"]


async def test_a_model_that_fails_to_load_answers_its_batch_and_is_tried_again(
    tmp_path: Path,
) -> None:
    import dataclasses
    import shutil

    from worker.model.files import bundled_file

    a = resident("a", loaded=False)
    moved = tmp_path / "digits.onnx"
    shutil.copy(bundled_file("digits.onnx"), moved)
    a.settings = dataclasses.replace(a.settings, model=dataclasses.replace(
        a.settings.model, path=str(moved)))  # fmt: skip
    b = resident("b")
    r = Residency(Pool(BUDGET // 2, 0), [a, b])  # room for one
    moved.write_bytes(b"not a model")  # replaced since start-up by something broken
    failures = metrics.MODEL_LOADS.labels("a", "failed")
    before = failures._value.get()
    async with r.held("a") as failed:
        assert failed is not None and failed.code == "inference_failed"
        assert "'a' could not be loaded" in failed.message and loaded(r) == set()
    async with r.held("b"):  # loaded again
        pass
    # The same file, soon after: answered as before without a load, b kept.
    async with r.held("a") as failed:
        assert failed is not None and "'a' could not be loaded" in failed.message
    assert loaded(r) == {"b"} and failures._value.get() == before + 1
    shutil.copy(bundled_file("digits.onnx"), moved)  # the file changed: tried again
    async with r.held("a") as failed:
        assert failed is None and loaded(r) == {"a"}


def _repository(root: Path, *names: str) -> Path:
    from tests.onnx_models import tabular

    for name in names:
        (root / name / "1").mkdir(parents=True)
        tabular(root / name / "1" / "model.onnx")
        (root / name / "model.toml").write_text(f'topics = ["in.{name}"]\n')
    return root


def test_on_demand_models_are_repository_models_answering_requests_of_their_own(
    tmp_path: Path,
) -> None:
    repo = _repository(tmp_path / "models", "a", "b")
    env = {"INFER_WORKER_REPOSITORY__PATH": str(repo),
           "INFER_WORKER_REPOSITORY__ON_DEMAND": "true",
           "INFER_WORKER_KAFKA__INPUT_TOPICS": "in.a,in.b"}  # fmt: skip
    s = load_settings(env=env)
    assert s.repository.on_demand and set(s.models) == {"a", "b"}
    with pytest.raises(ConfigError, match=r"repository\.pinned: \['z'\] not served"):
        load_settings(env={**env, "INFER_WORKER_REPOSITORY__PINNED": "z"})
    with pytest.raises(ConfigError, match=r"repository\.pinned: names models never evicted"):
        load_settings(env={"INFER_WORKER_REPOSITORY__PATH": str(repo),
                           "INFER_WORKER_REPOSITORY__PINNED": "a"})  # fmt: skip
    (repo / "b" / "model.toml").write_text('topics = ["in.b"]\nbackend = "gpu-twin"\n')
    assert load_settings(env=env).models["b"].backend == "gpu-twin"  # the GPU's budget its own
    (repo / "b" / "model.toml").write_text('topics = ["in.b"]\nreload_interval_s = 5\n')
    with pytest.raises(ConfigError, match=r"repository\.on_demand: 'b' sets reload_interval_s"):
        load_settings(env=env)


async def test_a_model_that_cannot_fit_beside_the_pinned_ones_stops_start_up(
    tmp_path: Path,
) -> None:
    from tests.onnx_models import wide
    from worker.app.worker import Worker

    repo = _repository(tmp_path / "models", "a")
    (repo / "b" / "1").mkdir(parents=True)
    wide(repo / "b" / "1" / "model.onnx", mib=8)
    (repo / "b" / "model.toml").write_text('topics = ["in.b"]\n')
    s = load_settings(env={"INFER_WORKER_REPOSITORY__PATH": str(repo),
                           "INFER_WORKER_REPOSITORY__ON_DEMAND": "true",
                           "INFER_WORKER_LIMITS__MAX_MODELS_MEMORY_MB": "4",
                           "INFER_WORKER_KAFKA__INPUT_TOPICS": "in.a,in.b"})  # fmt: skip
    worker = Worker(s)
    with pytest.raises(ConfigError, match=r"limits\.max_models_memory_mb: 'b' holds \d+ MiB, "
                       r"which does not fit the budget of 4 MiB"):  # fmt: skip
        await worker.prepare()
    await worker.stop()


async def test_an_evicted_model_s_memory_is_freed_though_its_engine_is_still_referenced(
    tmp_path: Path,
) -> None:
    """The worker keeps every model it loaded at start-up in a list (its engine
    there too): evicting one must free its memory all the same."""
    import dataclasses
    import gc

    from tests.onnx_models import wide
    from worker.app.memory import resident_bytes

    a = resident("a")
    path = wide(tmp_path / "wide.onnx", mib=24)
    a.settings = dataclasses.replace(a.settings, model=dataclasses.replace(
        a.settings.model, path=str(path)))  # fmt: skip
    r = Residency(Pool(0, 0), [a])
    a.stage.evict()
    async with r.held("a"):  # loaded by demand: the 24 MiB model
        pass
    kept = a.stage._engine  # as the worker's list would hold it
    gc.collect()
    before = resident_bytes()
    r._evict(a, "room")
    gc.collect()
    after = resident_bytes()
    assert before is not None and after is not None
    assert before - after >= 16 * MIB, (before - after) / MIB
    assert kept is not None


async def test_a_version_swapped_in_counts_at_least_its_file(tmp_path: Path) -> None:
    import dataclasses

    from tests.onnx_models import wide

    a = resident("a")
    r = Residency(Pool(0, 0), [a])
    bigger = dataclasses.replace(a.settings, model=dataclasses.replace(
        a.settings.model, path=str(wide(tmp_path / "v2.onnx", mib=24))))  # fmt: skip

    async def swap() -> str | None:
        return None  # (swapped in by worker.app.reload.swap; its size is what counts here)

    assert await r.swapping("a", swap, bigger) is None
    assert a.size >= 24 * MIB


def test_a_repository_model_s_version_has_one_owner_the_control_topic(tmp_path: Path) -> None:
    repo = _repository(tmp_path / "models", "a")
    (repo / "a" / "model.toml").write_text('topics = ["in.a"]\nreload_interval_s = 5\n')
    env = {"INFER_WORKER_REPOSITORY__PATH": str(repo), "INFER_WORKER_KAFKA__INPUT_TOPICS": "in.a"}
    assert load_settings(env=env).models["a"].reload_interval_s == 5  # its file's, watched
    with pytest.raises(ConfigError, match=r"repository\.a\.reload_interval_s: a repository "
                       r"model's version is set through kafka\.control_topic"):  # fmt: skip
        load_settings(env={**env, "INFER_WORKER_KAFKA__CONTROL_TOPIC": "models.control"})


async def test_a_load_measured_over_its_estimate_makes_room_after_it(tmp_path: Path) -> None:
    """A model counted at 1 MiB that measures tens as it loads: the models
    beside it make room right after, the budget held between loads."""
    import dataclasses

    from tests.onnx_models import wide

    a, b, c = resident("a"), resident("b"), resident("c", loaded=False)
    c.settings = dataclasses.replace(c.settings, model=dataclasses.replace(
        c.settings.model, path=str(wide(tmp_path / "c.onnx", seed=5, mib=12))))  # fmt: skip
    c.size = MIB
    a.last_used, b.last_used = 1.0, 2.0
    r = Residency(Pool(BUDGET, 0), [a, b, c])
    async with r.held("c"):
        assert c.size <= BUDGET, c.size / MIB  # (a model alone over it: model_over_budget)
        assert r.used() <= BUDGET, (r.used() / MIB, c.size / MIB)
        if c.size > BUDGET - 2 * SIZE:  # measured over what a and b left: room made after
            assert "a" not in loaded(r)


async def test_a_request_whose_deadline_passed_while_its_model_loaded_is_answered_so(
    tmp_path: Path,
) -> None:
    """Through the CPU stage: a batch of an evicted model waits for the load,
    then is triaged, so a request whose deadline passed meanwhile is answered
    deadline_exceeded (no engine time), the others run."""
    import time

    from tests.onnx_models import wide
    from worker.contract import Request, Tensor
    from worker.flow.messages import Batch, Job, TopicPartition

    path = wide(tmp_path / "w.onnx", seed=7, mib=12)
    s = load_settings(env={"INFER_WORKER_MODEL__PATH": str(path)})
    engine = load_engine(s.model)
    binding = bind_model(s.model, engine.info.io, s.limits, s.batching)
    stage = CpuStage(asyncio.Queue(), asyncio.Queue(), engine, binding, max_batch_size=8,
                     max_inflight=1)  # fmt: skip
    stage.evict()
    r = Residency(Pool(0, 0), [Resident("w", stage, s, 0)])
    jobs = []
    for i in range(3):
        request = Request(v=1, id=str(i), inputs={"features": Tensor.from_numpy(
            np.full(4, i, np.float32))})  # fmt: skip
        values, lengths = binding.inputs.check(request)
        deadline = time.monotonic() + 0.001 if i == 1 else None  # passes while it loads
        jobs.append(Job(TopicPartition("in", 0), i, None, time.monotonic(), deadline,
                        request=request, inputs=values, lengths=lengths))  # fmt: skip
    done = await stage.run_batch(Batch(jobs, time.monotonic(), "full", 1))
    assert [a.error.code if a.error else None for a in done.answers] == [
        None, "deadline_exceeded", None]  # fmt: skip
    assert done.engine_rows == 2 and r.get("w") is not None and stage.loaded
    stage.close()


async def test_a_model_that_comes_is_given_room_before_it_loads() -> None:
    """A model the control topic brings (``Residency.arrive``): room made for
    its file before its load (the least recently used idle model evicted),
    then a resident as any; the memory held within the budget throughout."""
    a, b = resident("a"), resident("b")
    a.last_used, b.last_used = 1.0, 2.0
    r = Residency(Pool(BUDGET, 0), [a, b])
    during: list[set[str]] = []

    async def load() -> tuple[Resident, float]:
        during.append(loaded(r))  # what was held while it loaded
        return resident("c"), 0.01

    came = await r.arrive(SIZE, load)
    assert during == [{"b"}]  # a made room before the load, not after it
    assert r.get("c") is came and loaded(r) == {"b", "c"} and r.used() <= BUDGET
    async with r.held("a"):  # c is a resident as any: b, now the oldest, makes room
        assert loaded(r) == {"a", "c"}
    await r.close()
