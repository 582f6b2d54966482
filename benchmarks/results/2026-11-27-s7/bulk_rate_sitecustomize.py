"""Throwaway experiment (issue 39): with a lane of its own, the bulk lane's
process paced at BULK_RATE records/s (a token bucket ahead of each batch)."""

import os

_RATE = float(os.environ.get("BULK_RATE", "0") or 0)
if _RATE and os.environ.get("INFER_WORKER_KAFKA__INPUT_TOPICS", "").endswith('bulk"]'):
    import asyncio
    import time

    from worker.compute import cpu

    _orig = cpu.CpuStage.run_batch
    _next = [0.0]

    async def _paced(self, batch, turn=None):  # type: ignore[no-untyped-def]
        now = time.monotonic()
        start = max(_next[0], now - 0.02)
        _next[0] = start + len(batch) / _RATE
        if start > now:
            await asyncio.sleep(start - now)
        return await _orig(self, batch, turn)

    cpu.CpuStage.run_batch = _paced
