"""``demo``/``bench --rate``: requests are sent open-loop as a Poisson process
(issue 11), not at fixed intervals and not waiting for answers."""

from __future__ import annotations

import numpy as np
import pytest

from worker.bench.senders import SenderError, produce_open_loop
from worker.ops.broker import Broker, create_topics
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration


async def test_paced_sends_have_exponential_gaps_at_the_mean_rate(
    broker: Broker, names: dict[str, str]
) -> None:
    await create_topics(broker.bootstrap, {names["requests"]: 1})
    rate, n = 200.0, 300
    produced = await produce_all(
        broker.bootstrap, names["requests"], [(None, b"x")] * n, rate=rate, seed=3
    )
    sent = np.array(sorted(p.sent_at for p in produced))
    gaps = np.diff(sent)
    # Mean gap 1/rate (5 ms), within what 300 draws and a busy machine allow.
    assert 0.7 / rate < gaps.mean() < 1.5 / rate
    # Exponential gaps vary as much as they average (coefficient of variation
    # about 1); fixed pacing would give about 0.
    assert gaps.std() / gaps.mean() > 0.6


async def test_several_senders_send_every_record_once_as_one_poisson_process(
    broker: Broker, names: dict[str, str]
) -> None:
    """``bench --senders N``: N processes share the records and the rate; what
    they send together is one open-loop schedule at the rate."""
    await create_topics(broker.bootstrap, {names["requests"]: 4})
    rate, n = 200.0, 400
    records = [(f"k{i}".encode(), f"v{i}".encode()) for i in range(n)]
    produced = await produce_open_loop(
        broker.bootstrap, names["requests"], records,
        partition_of=lambda i: i % 4, rate=rate, senders=2, seed=3,
    )  # fmt: skip
    assert [(p.key, p.value) for p in produced] == records
    assert [p.partition for p in produced] == [i % 4 for i in range(n)]
    assert len({(p.partition, p.offset) for p in produced}) == n
    collector = Collector(broker.bootstrap, [names["requests"]])
    await collector.start()
    try:
        await collector.collect(lambda c: len(c.records[names["requests"]]) >= n, 30)
    finally:
        await collector.stop()
    got = sorted(r.record_key or b"" for r in collector.records[names["requests"]])
    assert got == sorted(k for k, _ in records)
    # Both senders from the start (a barrier), not one after the other.
    first = sorted(produced, key=lambda p: p.sent_at)[:40]
    assert {int((p.key or b"k0")[1:]) % 2 for p in first} == {0, 1}
    gaps = np.diff(np.array(sorted(p.sent_at for p in produced)))
    assert 0.7 / rate < gaps.mean() < 1.5 / rate
    assert gaps.std() / gaps.mean() > 0.6


async def test_a_sender_that_cannot_connect_stops_the_run_saying_why() -> None:
    with pytest.raises(SenderError, match="did not all start"):
        await produce_open_loop(
            "127.0.0.1:1", "nowhere", [(b"k", b"v")] * 4,
            partition_of=lambda i: 0, rate=100.0, senders=2,
        )  # fmt: skip
