"""GroupLease: is this member still in its consumer group, as the group
coordinator last confirmed? The exactly-once writer asks before it commits a
transaction.

Why it is needed: aiokafka (0.12 to 0.14) sends TxnOffsetCommit version 0, which
names the group but not the member or its generation (KIP-447 added them in
version 3). The group coordinator therefore accepts a transaction's offsets
from a member it has already expelled: a *zombie*, one that was paused (a long
GC, SIGSTOP, a network partition) past its session timeout while another member
took its partitions. A restarted member is fenced by the broker (its
transactional id's epoch is bumped), but a zombie whose partitions went to a
*different* member is not; it would commit results the new owner also commits.

A successful Heartbeat (the member's id and generation, sent to the group
coordinator) at local time t means the coordinator's session for this member
runs until at least t + session_timeout: the coordinator received it after t,
and expels a member only once its session expired (or it left, or a newer
instance with its group_instance_id replaced it, which also fences its
transactional id). The lease is therefore granted until t + session_timeout and
renewed once less than half of it is left, so a commit starts with at least
half a session timeout to land. What remains unguarded: a commit that takes
longer than that (a broker stalled mid-commit), which the broker would have
refused under KIP-447. A heartbeat answered REBALANCE_IN_PROGRESS still counts:
the member keeps its partitions until it rejoins, after its revoke callback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiokafka.errors import KafkaError, RebalanceInProgressError, for_code
from aiokafka.protocol.group import HeartbeatRequest
from aiokafka.structs import TopicPartition as KafkaTP

from worker.flow.deadline import Deadline
from worker.flow.messages import TopicPartition

log = structlog.get_logger(__name__)


class GroupLease:
    """Group membership confirmed by the coordinator, good for a while.

    ``consumer`` returns the group consumer (or None before it starts).
    """

    def __init__(
        self, consumer: Callable[[], Any], session_timeout_ms: int, timeout: float
    ) -> None:
        self._consumer = consumer
        self._session = session_timeout_ms / 1000.0
        self._timeout = timeout
        self._until = 0.0
        self._member: tuple[int, str] | None = None  # (generation, member id) granted to
        self.probes = 0

    def _identity(self) -> tuple[Any, tuple[int, str]] | None:
        consumer = self._consumer()
        coordinator = getattr(consumer, "_coordinator", None)  # aiokafka has no public call
        if coordinator is None or coordinator.generation < 0 or not coordinator.member_id:
            return None  # not (or no longer) a member: left, expelled, not yet joined
        return coordinator, (int(coordinator.generation), str(coordinator.member_id))

    async def held(self) -> bool:
        """True while the coordinator confirmed this member's generation at most
        half a session timeout ago; else asks it again (one Heartbeat)."""
        found = self._identity()
        if found is None:
            return False
        coordinator, member = found
        now = time.monotonic()
        if member == self._member and self._until - now >= self._session / 2:
            return True
        request = HeartbeatRequest(coordinator.group_id, member[0], member[1])
        self.probes += 1
        try:
            response = await asyncio.wait_for(coordinator._send_req(request), self._timeout)
        except (KafkaError, TimeoutError) as exc:
            log.warning("group_lease_unconfirmed", error=repr(exc))
            return False
        error = for_code(response.error_code)
        if error.errno == 0 or error is RebalanceInProgressError:
            self._member, self._until = member, now + self._session
            return True
        log.warning("group_lease_lost", error=error.__name__, generation=member[0])
        self._member, self._until = None, 0.0
        return False

    async def offsets_visible(self, offsets: dict[TopicPartition, int]) -> None:
        """Until the group coordinator answers ``offsets`` as the group's
        committed offsets (at most one request timeout; a miss is logged). A
        transaction's offsets become visible only once its markers are written,
        which is after its commit returned."""
        consumer = self._consumer()
        if consumer is None or not offsets:
            return
        budget = Deadline(self._timeout)
        while True:
            behind = {}
            for tp, wanted in offsets.items():
                try:
                    seen = await asyncio.wait_for(
                        consumer.committed(KafkaTP(tp.topic, tp.partition)), self._timeout
                    )
                except (KafkaError, TimeoutError):
                    seen = None
                if seen is None or seen < wanted:
                    behind[tp] = (seen, wanted)
            if not behind:
                return
            if budget.expired:
                log.warning("committed_offsets_not_visible", partitions=len(behind))
                return
            offsets = {tp: wanted for tp, (_, wanted) in behind.items()}
            await asyncio.sleep(0.02)
