"""``demo``/``bench --rate``: requests are sent open-loop as a Poisson process
(issue 11), not at fixed intervals and not waiting for answers."""

from __future__ import annotations

import numpy as np
import pytest

from worker.ops.broker import Broker, create_topics
from worker.ops.topics import produce_all

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
