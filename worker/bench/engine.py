"""The worker's engine alone (``engine_img_s``): the figure a drain is read against.

The engine is loaded with the run's settings exactly as a worker loads it and
timed on its largest batch. A CPU engine runs one batch of the run's requests,
prepared and collated once as the worker does it (decoded, preprocessed or
tokenized, padded: ``worker.model.inputs``), over and over (``Engine.run``); a GPU
engine gets one slot as the GPU stage builds it and is timed enqueueing the
largest batch again and again on the slot's stream, with one synchronisation at
the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final, cast

from worker.app.plan import RunPlan
from worker.compute.engines import Engine, GpuEngine, load_engine
from worker.config import Settings
from worker.contract import Request
from worker.flow.messages import Job, TopicPartition
from worker.model.inputs import ModelInputs, bind
from worker.model.rows import Row
from worker.model.shapes import bucket_sizes

# The engine runs until its time is up or it ran this often, after a warm-up.
ENGINE_MAX_RUNS: Final = 1000
ENGINE_WARM_RUNS: Final = 3


def load_run_engine(settings: Settings) -> Engine | GpuEngine:
    """The engine as the worker loads it (``worker.app.worker``)."""
    s = settings
    return load_engine(
        s.model,
        device=s.gpu.device,
        max_batch_size=s.batching.max_batch_size,
        cuda_graphs=s.gpu.cuda_graphs,
        buckets=bucket_sizes(s.batching.max_batch_size, s.batching.preferred_batch_sizes),
    )


def timed(
    step: Callable[[], object],
    finish: Callable[[], object],
    seconds: float,
    max_runs: int = ENGINE_MAX_RUNS,
) -> float:
    """Seconds per ``step``: run it until ``seconds`` have passed or it ran
    ``max_runs`` times, then ``finish`` (waiting for work ``step`` only
    enqueued) inside the timed span."""
    runs = 0
    start = time.perf_counter()
    while True:
        step()
        runs += 1
        if runs >= max_runs or time.perf_counter() - start >= seconds:
            break
    finish()
    return (time.perf_counter() - start) / runs


def engine_rate(settings: Settings, requests: Sequence[Request], seconds: float) -> float:
    """Requests/s (images or texts) of the run's engine alone at
    ``batching.max_batch_size``."""
    engine = load_run_engine(settings)
    inputs = bind(settings.model, engine.info.io, settings.limits, settings.batching)
    try:
        if RunPlan.of(settings).device == "gpu":
            rows, per_batch = gpu_batch_seconds(cast(GpuEngine, engine), settings, inputs, seconds)
        else:
            rows = settings.batching.max_batch_size
            per_batch = cpu_batch_seconds(engine, inputs, requests, rows, seconds)
    finally:
        engine.close()
    return rows / per_batch


def cpu_batch_seconds(
    engine: Engine, inputs: ModelInputs, requests: Sequence[Request], rows: int, seconds: float
) -> float:
    """One batch of ``rows`` requests, checked, prepared, grouped by length and
    collated once as the CPU stage does it; its runs timed over and over."""
    answers = []
    for i in range(rows):
        values, lengths = inputs.check(requests[i % len(requests)])
        job = Job(TopicPartition("bench", 0), i, None, arrived=0.0, deadline=None,
                  inputs=values, lengths=lengths)  # fmt: skip
        answers.append(Row.of(job))
    if len(inputs.prepare(answers)) != len(answers):
        raise ValueError(f"a benchmark request was refused: {[a.error for a in answers]}")
    runs = [inputs.collate(group).feeds for group in inputs.groups(answers)]

    def batch() -> None:
        for feeds in runs:
            engine.run(feeds)

    for _ in range(ENGINE_WARM_RUNS):
        batch()
    return timed(batch, lambda: None, seconds)


def gpu_batch_seconds(
    engine: GpuEngine, settings: Settings, inputs: ModelInputs, seconds: float
) -> tuple[int, float]:
    """One slot made as the GPU stage makes it (``worker.compute.gpu.stage``:
    the layout, the buffers, the engine's context, which warms and captures
    every bucket); then the largest batch enqueued on the slot's stream over and
    over, at the longest lengths, synchronised once at the end. Returns the
    rows run (the largest batch, at least the engine's smallest) and the seconds
    per run. Floating inputs hold random normal values, not zeros: matrix units
    can run faster on zeros (13% for a bf16 product on an H200 of this
    workplace) and would flatter the engine; integer ones (token ids) stay 0, an
    id every vocabulary has."""
    import cupy

    from worker.compute.gpu.plan import slot_shapes
    from worker.compute.gpu.slots import Allocations, Slot, SlotLayout

    device = settings.gpu.device
    b = settings.batching
    shapes = slot_shapes(inputs, b.max_batch_size, b.preferred_batch_sizes,
                         inputs.length_buckets, engine.min_batch_size)  # fmt: skip
    engine.prepare(shapes)
    rows, lengths = shapes.batches[-1], shapes.max_lengths
    layout = SlotLayout(
        device=device,
        max_batch_size=rows,
        engine_inputs=engine.inputs,
        engine_outputs=engine.outputs,
    )
    slot = Slot.create(0, layout, Allocations())
    try:
        with cupy.cuda.Device(device):
            slot.context = engine.create_context(slot)
            # The buffers were zero-filled on the legacy default stream (see the stage).
            cupy.cuda.runtime.deviceSynchronize()
            for x in slot.engine_inputs.values():
                if x.dtype.kind == "f":
                    x[...] = cupy.random.default_rng(0).standard_normal(x.shape).astype(x.dtype)
            cupy.cuda.runtime.deviceSynchronize()
            for _ in range(ENGINE_WARM_RUNS):
                engine.enqueue(slot, rows, lengths)
            slot.stream.synchronize()

            def step() -> None:
                engine.enqueue(slot, rows, lengths)

            return rows, timed(step, slot.stream.synchronize, seconds)
    finally:
        slot.close()
