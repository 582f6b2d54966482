"""A GPU stage evicted and loaded again by demand (issue 68), on the CPU twin
(``model.backend = "gpu-twin"``): the stage's own code frees and rebuilds its
slots, engine and ring, and the twin's memory pool (what the device share
measures) shows what they hold. Only a GPU shows CUDA graphs captured again and
TensorRT's execution contexts freed (tests/gpu); the twin has neither."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from tests.gpu.support import gpu_stage, make_jobs, queues
from tests.gpu.support import request_jobs as jobs
from worker.compute.engines import load_engine
from worker.compute.gpu import twin
from worker.compute.gpu.budget import DeviceShare
from worker.compute.gpu.freeing import FreeingGate
from worker.compute.gpu.stage import GpuStage
from worker.config import BatchingConfig, GpuConfig, LimitsConfig, ModelConfig
from worker.config.model import PostprocessConfig, PreprocessConfig
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.errors import ConfigError
from worker.flow.messages import Batch, Job
from worker.model.inputs import bind
from worker.ops.samples import sentiment_samples

IMAGES = ModelConfig(path="builtin:digits", backend="gpu-twin",
                     preprocess=PreprocessConfig(device="gpu"),
                     postprocess=PostprocessConfig(top_k=3))  # fmt: skip
TEXTS = ModelConfig(path="builtin:sentiment", backend="gpu-twin")
ROWS = 16


def _images(n: int = 40) -> list[Job]:
    rng = np.random.default_rng(7)
    return make_jobs([rng.integers(0, 256, size=(int(rng.integers(6, 30)), int(rng.integers(6, 30)),
                                                1), dtype=np.uint8) for _ in range(n)])  # fmt: skip


def _texts(n: int = 40) -> list[Job]:
    engine = load_engine(TEXTS, max_batch_size=ROWS)
    inputs = bind(TEXTS, engine.info.io, LimitsConfig(), BatchingConfig())
    engine.close()
    return jobs(inputs, [{"text": s.text} for s in sentiment_samples()[:n]])


class Started:
    """A twin stage on a device share of its own (a fresh twin: its pool counts
    only this stage), measured as the worker measures a model's start."""

    def __init__(self, model: ModelConfig, slots: int = 2) -> None:
        self.model = model
        self.cupy = twin.make()
        self.share = DeviceShare(0, 0.5, torch_engine=False, cupy=self.cupy)
        self.empty = self.share.used()
        source, sink = queues()
        self.stage: GpuStage = self.share.measure(model.name, lambda: gpu_stage(
            source, sink, self.engine(), model, ROWS, slots, GpuConfig(max_input_bytes=1 << 20),
            batching=BatchingConfig(), budget=self.share.slots_for(model.name), cupy=self.cupy,
        ))  # fmt: skip
        self.first = self.share.models[model.name]

    def engine(self) -> Any:
        return load_engine(self.model, max_batch_size=ROWS)

    async def answer(self, items: list[Job]) -> list[Any]:
        """Every request, in batches of up to 1.5 slots' rows (some run in chunks)."""
        out: list[Any] = []
        size = ROWS * 3 // 2
        for seq, start in enumerate(range(0, len(items), size)):
            part = items[start : start + size]
            done = await self.stage.run_batch(Batch(part, time.monotonic(), "full", seq))
            out.extend(done.answers)
        return out


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.error is None and w.error is None, (g.error, w.error)
        assert set(g.outputs) == set(w.outputs)
        for name in w.outputs:
            np.testing.assert_array_equal(g.outputs[name], w.outputs[name])


@pytest.mark.parametrize(("model", "items"), [(IMAGES, _images), (TEXTS, _texts)],
                         ids=["images-on-device-top-k", "texts-of-free-length"])  # fmt: skip
async def test_an_evicted_stage_loaded_again_answers_as_before(
    model: ModelConfig, items: Callable[[], list[Job]]
) -> None:
    """Evict frees the slots (the pool drops to what it held before the stage
    started); load rebuilds them by the constructor's path (the engine prepared
    at the same shapes, the same ring, checked against the share again) and
    measures what it took, as the first start measured; the answers are the
    same, to the bit."""
    s = Started(model)
    stage = s.stage
    try:
        layout, ring_bytes = stage.layout, dict(s.share.rings)
        want = await s.answer(items())
        assert s.first >= stage.layout.device_bytes * 2 > 0

        stage.evict()
        assert not stage.loaded and stage.slots == ()
        assert s.share.used() == s.empty  # every device buffer back to the pool
        stage.evict()  # idempotent

        took = stage.load(s.engine())
        assert stage.loaded
        assert took == s.first  # the twin's pool: exactly what the first start took
        assert s.share.used() == s.empty + s.first
        assert stage.layout == layout and s.share.rings == ring_bytes
        _same(await s.answer(items()), want)
    finally:
        stage.close()


async def test_evict_and_load_again_and_again_leaks_nothing() -> None:
    s = Started(IMAGES, slots=3)
    stage = s.stage
    try:
        want = await s.answer(_images(20))
        loaded, count = s.share.used(), stage.allocations.count
        for _ in range(4):
            stage.evict()
            assert s.share.used() == s.empty
            assert stage.load(s.engine()) == s.first
            assert s.share.used() == loaded
            assert stage.allocations.count == count  # the same buffers, no more
            _same(await s.answer(_images(20)), want)
            assert stage.allocations.count == count  # and none per batch
    finally:
        stage.close()
    assert s.share.used() == s.empty


async def test_a_batch_its_residence_refuses_is_answered_so_and_takes_no_slot() -> None:
    """The residence is entered before a slot is taken: the batch of a model that
    cannot run now (unloaded, its load failed) never touches the ring; its
    runnable requests carry the residence's error, one past its deadline is
    answered so, as any other."""
    s = Started(IMAGES)
    stage = s.stage
    refusal = ErrorInfo(ErrorCode.UNKNOWN_MODEL, "model 'digits' is unloaded")
    acquired: list[int] = []
    ring = stage.ring
    acquire = ring.acquire

    async def counted() -> Any:
        acquired.append(1)
        return await acquire()

    ring.acquire = counted  # type: ignore[method-assign]
    entered: list[int] = []

    @contextlib.asynccontextmanager
    async def refusing() -> AsyncIterator[ErrorInfo | None]:
        entered.append(len(acquired))
        yield refusal

    stage.residence = refusing
    try:
        items = _images(5)
        items[1:2] = make_jobs([np.zeros((8, 8, 1), np.uint8)], deadline=time.monotonic() - 1)
        done = await stage.run_batch(Batch(items, time.monotonic(), "full", 1))
        codes = [a.error.code if a.error else None for a in done.answers]
        assert codes == [ErrorCode.UNKNOWN_MODEL, ErrorCode.DEADLINE_EXCEEDED,
                         *[ErrorCode.UNKNOWN_MODEL] * 3]  # fmt: skip
        assert done.answers[0].error == refusal
        assert done.engine_rows == 0
        assert entered == [0] and acquired == [] and ring.busy == 0
    finally:
        stage.close()


async def test_a_batch_of_an_evicted_model_waits_in_its_residence_for_the_load() -> None:
    """As ``worker.app.demand`` holds a model: the residence loads the evicted
    stage (on a thread) before the batch takes a slot, and counts the batch
    in use until it is answered; eviction waits for none here."""
    s = Started(IMAGES)
    stage = s.stage
    want = await s.answer(_images(12))
    stage.evict()
    states: list[tuple[bool, bool]] = []

    @contextlib.asynccontextmanager
    async def held() -> AsyncIterator[ErrorInfo | None]:
        states.append((stage.loaded, bool(stage.slots)))
        if not stage.loaded:
            await asyncio.to_thread(stage.load, s.engine())
        yield None
        states.append((stage.loaded, stage.ring.busy == 0))

    stage.residence = held
    try:
        _same(await s.answer(_images(12)), want)
        assert states[0] == (False, False)  # entered evicted: no ring to touch yet
        assert states[1:] == [(True, True)] * (len(states) - 1)  # each slot released
    finally:
        stage.close()


async def test_a_batch_reaching_an_evicted_stage_without_a_residence_is_never_run() -> None:
    s = Started(IMAGES)
    stage = s.stage
    stage.evict()
    try:
        done = await stage.run_batch(Batch(_images(3), time.monotonic(), "full", 1))
        assert {a.error.code for a in done.answers if a.error} == {ErrorCode.INFERENCE_FAILED}
        assert all(a.outputs is None for a in done.answers) and done.engine_rows == 0
    finally:
        stage.close()


async def test_a_load_that_fails_leaves_the_stage_evicted_and_frees_what_it_built() -> None:
    s = Started(IMAGES, slots=3)
    stage = s.stage
    stage.evict()
    broken = s.engine()
    made: list[int] = []
    closed: list[bool] = []
    create, close = broken.create_context, broken.close

    def third_fails(slot: Any) -> Any:
        made.append(slot.index)
        if slot.index == 2:
            raise ConfigError("no context for slot 2")
        return create(slot)

    broken.create_context = third_fails
    broken.close = lambda: (closed.append(True), close())
    try:
        with pytest.raises(ConfigError, match="slot 2"):
            stage.load(broken)
        assert made == [0, 1, 2] and closed == [True]
        assert not stage.loaded and s.share.used() == s.empty
        assert stage.load(s.engine()) == s.first
        assert len(await s.answer(_images(4))) == 4
    finally:
        stage.close()


def test_a_freeing_waits_for_the_submissions_under_way_and_shuts_new_ones_out() -> None:
    """The process's gate (``worker.compute.gpu.freeing``): only a GPU could
    deadlock without it; here its exclusion is what is checked."""
    gate = FreeingGate()
    submitting, release = threading.Event(), threading.Event()
    freeing, freed = threading.Event(), threading.Event()
    order: list[str] = []

    def submit() -> None:
        with gate.submitting():
            submitting.set()
            release.wait(5)
            order.append("submitted")

    def free() -> None:
        with gate.freeing():
            freeing.set()
            order.append("freed")
            freed.wait(5)

    first = threading.Thread(target=submit)
    first.start()
    assert submitting.wait(5)
    evict = threading.Thread(target=free)
    evict.start()
    assert not freeing.wait(0.05)  # a submission under way: the freeing waits
    submitting.clear()
    late = threading.Thread(target=submit)
    late.start()
    release.set()
    assert freeing.wait(5)
    assert not submitting.wait(0.05)  # a freeing holds the gate: no submission starts
    freed.set()
    for t in (first, evict, late):
        t.join(5)
    assert order == ["submitted", "freed", "submitted"]
    assert gate.submissions == 0
