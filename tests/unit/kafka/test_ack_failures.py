"""``Producing.failures``: every record batch's future awaited, each failure
reported under its future, whichever order the records come in."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from worker.config import KafkaConfig
from worker.kafka.delivery.outgoing import OutRecord
from worker.kafka.delivery.producing import Producing


async def _no_factory(kafka: KafkaConfig) -> Any:
    raise AssertionError("no producer is made here")


def _sent(*futures: asyncio.Future[object]) -> list[tuple[OutRecord, asyncio.Future[object]]]:
    return [(cast(OutRecord, object()), fut) for fut in futures]


async def test_a_failed_batch_is_reported_wherever_its_records_stand() -> None:
    loop = asyncio.get_running_loop()
    ok, bad, late = loop.create_future(), loop.create_future(), loop.create_future()
    refused = RuntimeError("refused")
    # Two batches' records consecutive, then the first batch's future again
    # (a record sent on its own shares none, but order is not relied on).
    sent = _sent(ok, ok, bad, bad, bad, ok, late)
    ok.set_result(None)
    bad.set_exception(refused)
    loop.call_later(0.01, late.set_exception, ValueError("late"))
    producing = Producing(KafkaConfig(), _no_factory)
    failures = await producing.failures(sent, caught=(Exception,))
    assert failures == {id(bad): refused, id(late): failures[id(late)]}
    assert isinstance(failures[id(late)], ValueError)


async def test_a_fatal_failure_is_raised_at_once() -> None:
    loop = asyncio.get_running_loop()
    fenced = loop.create_future()
    fenced.set_exception(KeyError("fenced"))
    producing = Producing(KafkaConfig(), _no_factory)
    with pytest.raises(KeyError):
        await producing.failures(_sent(fenced, fenced), caught=(ValueError,), fatal=(KeyError,))
