"""Open-loop arrivals from several sender processes.

One aiokafka producer in the bench's event loop, beside the collector, kept to
6,343 of the 7,398 JPEG records/s (19.6 kB) asked of it on the H200's host
(2026-11-28, BENCHMARKS.md "GPU"): below what four worker processes answer, so
the paced run timed the sender. With ``senders`` N > 1, N processes each send
every N-th record as a Poisson process of rate / N (the sum of independent
Poisson processes is one at the whole rate), all starting together once every
producer is connected (a barrier). On Linux ``time.monotonic`` is one clock for
every process of the host, so the senders' send times compare with the
collector's receive times.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
from collections.abc import Callable, Sequence
from typing import Any, Final

from worker.flow.errors import WorkerError
from worker.kafka.credentials import Connection
from worker.ops.topics import Produced, produce_all

# How long the senders may take to start (a spawned process imports the worker's
# modules and connects its producer: 1-2 s on an idle machine) and, after their
# schedule, to have every record acknowledged.
START_TIMEOUT_S: Final = 60.0
FINISH_SLACK_S: Final = 60.0

Record = tuple[bytes | None, bytes]
# Per record, what a sender process returns: its index in the whole list, the
# monotonic time it was handed to the producer, its partition, offset, timestamp.
Sent = tuple[int, float, int, int, int]


class SenderError(WorkerError):
    code = "sender_failed"


async def produce_open_loop(
    bootstrap: Connection,
    topic: str,
    records: Sequence[Record],
    *,
    partition_of: Callable[[int], int],
    rate: float,
    senders: int = 1,
    seed: int = 0,
) -> list[Produced]:
    """``records`` as open-loop Poisson arrivals at ``rate`` from ``senders``
    processes (1: in this event loop, as ``produce_all``); each record's
    ``Produced``, in the order given. Never more senders than records
    (``sender_count``)."""
    senders = sender_count(senders, len(records))
    if senders == 1:
        return await produce_all(
            bootstrap, topic, records, partition_of=partition_of, rate=rate, seed=seed
        )
    # spawn, not fork: this process runs an event loop and client threads.
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(senders + 1)
    results: Any = context.Queue()
    processes = []
    for k in range(senders):
        share = [(i, *records[i], partition_of(i)) for i in range(k, len(records), senders)]
        args = (bootstrap, topic, share, rate / senders, seed + k, barrier, results)
        processes.append(context.Process(target=_send_share, args=args, daemon=True))
    for process in processes:
        process.start()
    try:
        await asyncio.to_thread(_wait, barrier, results, processes)
        finish = len(records) / rate + FINISH_SLACK_S
        shares = await asyncio.to_thread(_collect, results, senders, finish, processes)
    finally:
        barrier.abort()  # a thread still waiting (the bench cancelled) returns at once
        for process in processes:
            process.kill()
            process.join()
    out: list[Produced | None] = [None] * len(records)
    for sent in shares:
        for i, sent_at, partition, offset, timestamp in sent:
            key, value = records[i]
            out[i] = Produced(key, value, sent_at, partition, offset, timestamp)
    unsent = [i for i, p in enumerate(out) if p is None]
    if unsent:
        raise SenderError(f"{len(unsent)} records were not sent (the first: {unsent[:5]})")
    return [p for p in out if p is not None]


def sender_count(asked: int, records: int) -> int:
    """The processes that send ``records``: as asked, at most one per record."""
    return max(1, min(asked, records))


def _wait(barrier: Any, results: Any, processes: Sequence[Any]) -> None:
    try:
        barrier.wait(START_TIMEOUT_S)
    except Exception as exc:  # boundary: BrokenBarrierError (a sender failed, or timed out)
        raise SenderError(
            f"the sender processes did not all start within {START_TIMEOUT_S:g} s: "
            f"{_first_error(results) or exc!r} (exit codes {[p.exitcode for p in processes]})"
        ) from exc


def _first_error(results: Any) -> str | None:
    try:
        outcome, detail = results.get(timeout=1.0)
    except queue.Empty:
        return None
    return str(detail) if outcome == "error" else None


def _collect(results: Any, senders: int, timeout: float, processes: Sequence[Any]) -> list[Any]:
    shares = []
    for _ in range(senders):
        try:
            outcome, detail = results.get(timeout=timeout)
        except queue.Empty as exc:
            raise SenderError(
                f"a sender process did not finish within {timeout:.0f} s "
                f"(exit codes {[p.exitcode for p in processes]})"
            ) from exc
        if outcome == "error":
            raise SenderError(f"a sender process failed: {detail}")
        shares.append(detail)
    return shares


def _send_share(
    bootstrap: Connection,
    topic: str,
    share: list[tuple[int, bytes | None, bytes, int]],
    rate: float,
    seed: int,
    barrier: Any,
    results: Any,
) -> None:
    """One sender process: connect, wait for the others, send its records on
    their schedule and put what it sent on ``results`` (or why it failed, the
    barrier broken so that nobody waits for it)."""
    try:
        produced = asyncio.run(
            produce_all(
                bootstrap,
                topic,
                [(key, value) for _, key, value, _ in share],
                partition_of=lambda j: share[j][3],
                rate=rate,
                seed=seed,
                on_ready=lambda: barrier.wait(START_TIMEOUT_S),
            )
        )
    except BaseException as exc:  # boundary: reported to the bench, which stops the run
        barrier.abort()
        results.put(("error", repr(exc)))
        return
    sent = [(share[j][0], p.sent_at, p.partition, p.offset, p.timestamp_ms)
            for j, p in enumerate(produced)]  # fmt: skip
    results.put(("ok", sent))
