"""One worker process: metrics endpoint, signals, the worker, its exit status.

``serve`` is what ``infer-worker run`` runs: SIGTERM/SIGINT drain, commit and
leave the group; a second signal abandons the drain.
"""

from __future__ import annotations

import asyncio
import signal

import structlog

from worker.app.collector import settle_for_serving
from worker.config import Settings
from worker.obs import metrics

log = structlog.get_logger("worker")

EXIT_OK = 0
EXIT_FAILED = 1  # a stage failed: engine dead, delivery failed, failure budget
EXIT_UNDRAINED = 2  # stopped without draining (a second signal, the drain deadline)


async def serve(settings: Settings) -> int:
    """Run one worker until SIGTERM/SIGINT (drain, commit, leave) or a fatal error.

    A second signal abandons the drain: in-flight work is not committed and will
    be redelivered to the group.
    """
    from worker.app.worker import Worker

    if settings.metrics.port:
        from worker.obs.http import serve_http

        serve_http(settings.metrics.port, settings.metrics.host)
    metrics.set_liveness_timeout(settings.metrics.liveness_timeout_ms / 1000.0)
    ticker = asyncio.create_task(_tick(), name="liveness")

    loop = asyncio.get_running_loop()
    signals = 0
    stop_requested = asyncio.Event()
    worker = Worker(settings)

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        log.info("signal", signal=signal.Signals(signum).name, count=signals)
        stop_requested.set()
        if signals > 1:
            worker.abandon()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    await worker.start()
    settle_for_serving()  # before the first fetch is read: the pipeline's tasks wait
    waiter = asyncio.ensure_future(worker.wait())
    stopper = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    stopper.cancel()
    drained = await worker.stop()
    ticker.cancel()
    if worker.failure is not None:
        log.error("worker_failed", error=repr(worker.failure))
        return EXIT_FAILED
    return EXIT_OK if drained and signals <= 1 else EXIT_UNDRAINED


TICK_S = 0.1


async def _tick(interval: float = TICK_S) -> None:
    """Proof of a live event loop for ``/livez`` (a blocked loop stops ticking),
    and how late each tick came (``infer_event_loop_lag_seconds``): a request
    waits for the loop at every hop, fetch, intake, batch, result, send."""
    loop = asyncio.get_running_loop()
    while True:
        metrics.loop_ticked()
        due = loop.time() + interval
        await asyncio.sleep(interval)
        metrics.EVENT_LOOP_LAG_SECONDS.observe(max(0.0, loop.time() - due))
