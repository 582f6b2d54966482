"""A record that kills the whole process (issue 10): real worker processes really
die on a marked input (a fault injected into the engine through
``sitecustomize``, as a native crash would end them: ``os._exit``, no cleanup),
and after ``limits.max_crash_attempts`` deaths with that record at the head the
next worker sends it to the DLQ unrun and answers everything else."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.faults.conftest import request, start
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import extended_pythonpath
from worker.ops.topics import Collector, committed_offsets, produce_all

CRASH_HOOK = """
import os
from worker.compute.engines import onnxruntime as _ort

_run = _ort.OnnxRuntimeEngine.run


def run(self, feeds):
    if (feeds["image"][:, 0, 0, 0] > 0.99).any():  # the marked image's corner: 255
        os._exit(137)  # like a native crash: no cleanup, no clean hand-over
    return _run(self, feeds)


_ort.OnnxRuntimeEngine.run = run
"""

MARKED = 7


async def test_a_record_that_kills_the_process_is_quarantined_after_max_attempts(
    names: dict[str, str], tmp_path: Path, broker_factory: Callable[[], Broker]
) -> None:
    (tmp_path / "sitecustomize.py").write_text(CRASH_HOOK)
    n = 20
    broker = broker_factory()
    try:
        await create_topics(
            broker.bootstrap,
            {names["requests"]: 1, names["results"]: 1, names["dlq"]: 1, names["guard"]: 1},
        )
        records = [
            (f"k{i}".encode(), request(i, corner=255 if i == MARKED else None)) for i in range(n)
        ]
        await produce_all(broker.bootstrap, names["requests"], records)
        env = {
            "PYTHONPATH": extended_pythonpath(tmp_path),
            "INFER_WORKER_KAFKA__CRASH_GUARD_TOPIC": names["guard"],
            "INFER_WORKER_LIMITS__MAX_CRASH_ATTEMPTS": "3",
        }
        collector = Collector(broker.bootstrap, [names["results"], names["dlq"]])
        await collector.start()
        crashes, exits = 0, []
        for _ in range(8):
            w = start(broker, names, **env)
            deadline = time.monotonic() + 60
            while w.proc.poll() is None and collector.count() < n and time.monotonic() < deadline:
                await collector.collect(lambda c: False, 0.2)
            if w.proc.poll() is None:  # answered everything: stop it cleanly
                exits.append(w.terminate())
                break
            exits.append(w.proc.returncode)
            crashes += 1
        await collector.collect(lambda c: c.count() >= n, 10)
        await collector.stop()
        committed = await committed_offsets(broker.bootstrap, names["group"], names["requests"], 1)
    finally:
        broker.stop()
    assert exits[:-1] == [137] * crashes and exits[-1] == 0, exits
    # The first death is in a whole batch; then one record at a time finds the
    # marked one, which three processes die on before the fourth quarantines it.
    assert crashes == 4, exits
    results = {r.result().id for r in collector.records[names["results"]]}
    assert results == {f"req-{i}" for i in range(n) if i != MARKED}
    (dlq,) = collector.records[names["dlq"]]
    assert dlq.headers["error.code"] == b"crash_loop" and dlq.headers["stage"] == b"crash_loop"
    assert dlq.headers["source.offset"] == str(MARKED).encode()
    assert dlq.value == records[MARKED][1] and dlq.record_key == records[MARKED][0]
    assert committed == {0: n}
