"""Throwaway experiment (issue 36): time the worker's cycle collections by
generation (gc.callbacks), written to $GCTIME_DIR/<pid>.txt once a second."""

import gc
import os
import threading
import time

_out = os.environ.get("GCTIME_DIR")
if _out:
    _t = {"start": 0.0}
    _by = {0: [0, 0.0, 0], 1: [0, 0.0, 0], 2: [0, 0.0, 0]}

    def _cb(phase, info):  # type: ignore[no-untyped-def]
        if phase == "start":
            _t["start"] = time.perf_counter()
        else:
            g = _by[info["generation"]]
            g[0] += 1
            g[1] += time.perf_counter() - _t["start"]
            g[2] += info.get("collected", 0)

    gc.callbacks.append(_cb)

    def _dump() -> None:
        while True:
            time.sleep(1.0)
            with open(f"{_out}/{os.getpid()}.txt", "w") as fh:
                fh.write(repr({k: (v[0], round(v[1] * 1000, 1), v[2]) for k, v in _by.items()}))
                threshold, count, cpu = gc.get_threshold(), gc.get_count(), time.process_time()
                fh.write(f" threshold={threshold!r} count={count!r} cpu={cpu:.2f}\n")

    threading.Thread(target=_dump, daemon=True).start()

_t0 = os.environ.get("GC_T0")
if _t0:
    import worker.app.collector as _collector

    _collector.THRESHOLDS = (int(_t0), 50, 100)  # type: ignore[misc]
