"""Answers turned into records, and acknowledged records settled: what both
writers do with a completed batch before and after the producer has it.

``records`` makes a batch's result, DLQ and state records (``outgoing``), skips
answers of partitions revoked or reset meanwhile, counts refusals (the one
place) and the failure budget; ``next_attempts`` applies ``decide`` to records
not acknowledged; ``acknowledged`` marks their offsets done and counts what was
delivered. The writers (``at_least_once``, ``exactly_once``) differ only in
how records are sent and when offsets commit, and hold one of these each.
"""

from __future__ import annotations

import time
from collections import Counter

import structlog

from worker.contract import ModelInfo
from worker.flow.codes import ErrorCode
from worker.flow.errors import DeliveryFailed, FailureBudgetExceeded
from worker.flow.messages import Answer, Completed, Job, StateChange, TopicPartition
from worker.kafka.delivery.decide import Action, Verdict, decide, refusal_code
from worker.kafka.delivery.outgoing import (
    OutRecord,
    Topics,
    fallback,
    record_for,
    state_record,
    step_record,
)
from worker.kafka.delivery.writer import WriterParts
from worker.kafka.permissions import NOT_AUTHORISED
from worker.obs import metrics
from worker.obs.logs import RateLimited
from worker.obs.tracing import Tracer, answer_span

log = structlog.get_logger(__name__)

# How many jobs with two records in flight before the map is swept of those
# whose partition was revoked (their acknowledgements never come).
_PENDING_SWEEP = 10_000


def _rejection(answer: Answer) -> str | None:
    """The code an answer was refused with without running the model (counted in
    ``infer_requests_rejected_total``), or None: answered by the model, or its
    run failed (``inference_failed``, counted as batch failures)."""
    job = answer.job
    if job.failure is not None:
        return job.failure.code
    if answer.error is not None and answer.error.code != ErrorCode.INFERENCE_FAILED:
        return answer.error.code
    return None


class Answers:
    """A writer's records: made from answers, settled once acknowledged."""

    def __init__(self, parts: WriterParts) -> None:
        kafka = parts.kafka
        self._kafka = kafka
        # Not copied: a model the control topic brings is added to it while serving.
        self._models = parts.models
        self._state_topics = dict(parts.state_topics)
        # One model: its changelog, whatever name its jobs carry (tools, tests).
        self._only_changelog = (next(iter(self._state_topics.values()), None)
                                if len(self._models) == 1 else None)  # fmt: skip
        self._tracker = parts.tracker
        self._committer = parts.committer
        self._budget = parts.budget
        self._tracer = parts.tracer or Tracer()
        self._seq = 0
        self._rejections = RateLimited(burst=10, interval=10.0)
        self._topics = Topics(output=kafka.output_topic, dlq=kafka.dlq_topic,
                              registered=parts.registered)  # fmt: skip
        self._shadow = kafka.shadow  # a shadow writes no DLQ records
        # The request latency's lane label, by input topic (one lane without lanes).
        self._lane_of = {t: lane.label for lane in kafka.ranked_lanes for t in lane.topics}
        # Records still unacknowledged of jobs that have more than one (an answer
        # and its state record), by (partition, offset, epoch).
        self._pending: dict[tuple[TopicPartition, int, int], int] = {}

    def records(self, completed: Completed) -> list[OutRecord]:
        """The records for a completed batch's answers, skipping those of
        partitions revoked or reset meanwhile (their new owner answers them);
        each counts against the failure budget."""
        now = time.monotonic()
        outs: list[OutRecord] = []
        model = self._model_of(completed)
        rejected: Counter[tuple[str, str]] = Counter()  # by (topic, code)
        counted: list[Job] = []  # answers the failure budget counts, and whether each failed
        failed: list[bool] = []
        shadowed: list[Job] = []  # DLQ-bound answers of a shadow: answered without a record
        for answer in completed.answers:
            job = answer.job
            if not self._tracker.owns(job.tp, job.offset, job.epoch):
                continue  # partition revoked or reset meanwhile: its new owner answers it
            code = _rejection(answer)
            if code is not None:
                rejected[job.tp.topic, code] += 1
            self._seq += 1
            trace = None
            if job.trace is not None or self._tracer.exporting:
                trace = answer_span(self._tracer, answer, model.name,
                                    len(completed.answers), now)  # fmt: skip
            out = record_for(
                answer, model, self._topics, self._seq, now, self._kafka.max_request_size, trace
            )
            # Its latency is that model's and version's.
            out.model_name, out.model_version = model.name, model.version
            counted.append(job)
            failed.append(out.kind == "dlq" or (
                answer.error is not None and answer.error.code == ErrorCode.INFERENCE_FAILED
            ))  # fmt: skip
            if out.kind != "ok":
                self.log_rejection(out)
            if out.kind == "dlq" and self._shadow:
                # Logged and counted above (infer_requests_rejected_total):
                # answered, as far as its offset goes, without a record.
                shadowed.append(job)
                continue
            outs.append(out)
            changelog = self._state_topics.get(job.model) or (
                self._only_changelog if len(self._models) == 1 else None)  # fmt: skip
            if changelog and answer.state is not None and out.kind != "dlq":
                outs.append(self._state_record(job, answer.state, changelog))
            if out.kind == "ok":  # a pipeline's steps' outputs, for their own topics
                for step in answer.steps:
                    self._one_more(job)
                    outs.append(step_record(job, step, model.version, out.request_id, self._seq))
        # Per batch: a batch without failures is counted at once. Nothing of the
        # batch is settled before: a budget exceeded halts with it unanswered.
        tripped = self._budget.record_all(failed) if self._budget is not None else None
        if tripped is not None:
            at, reason = counted[tripped[0]], tripped[1]
            raise FailureBudgetExceeded(
                f"halting: {reason}; last at {at.tp.topic}:{at.tp.partition}@{at.offset}"
            )
        for job in shadowed:
            self._tracker.done(job.tp, job.offset, job.epoch)
        if shadowed:
            self._committer.notify()
        for (topic, code), count in rejected.items():  # the one place rejections are counted
            metrics.REQUESTS_REJECTED.labels(code=code).inc(count)
            lane = self._kafka.ranked_lanes[self._kafka.lane_rank.get(topic, 0)].label
            metrics.LANE_REJECTED.labels(lane=lane, code=code).inc(count)
        return outs

    def _model_of(self, completed: Completed) -> ModelInfo:
        """The model that answered ``completed`` (a batch is of one model, the one
        the intake routed its jobs to), at the version that ran it: the start-up
        one, or the version swapped in since (results carry it)."""
        name = completed.answers[0].job.model
        # One model: every batch is its, whatever name its jobs carry (tools, tests).
        model = (self._models.get(name) or next(iter(self._models.values()))
                 if len(self._models) == 1 else self._models[name])  # fmt: skip
        version = completed.model_version
        if version is None or version == model.version:
            return model
        return ModelInfo(model.name, version)

    def _state_record(self, job: Job, change: StateChange, topic: str) -> OutRecord:
        """The state record of ``job`` (``outgoing.state_record``); the job's
        offset counts as done only once it and the answer are both acknowledged."""
        self._one_more(job)
        metrics.STATE_PENDING.set(len(self._pending))
        return state_record(job, change, topic, self._seq)

    def _one_more(self, job: Job) -> None:
        """One more record for ``job`` beside its answer: its offset counts as
        done once every one of them is acknowledged."""
        self._seq += 1
        key = (job.tp, job.offset, job.epoch)
        if len(self._pending) >= _PENDING_SWEEP:  # jobs of revoked partitions: never acked
            self._pending = {k: n for k, n in self._pending.items() if self._tracker.owns(*k)}
        self._pending[key] = self._pending.get(key, 1) + 1

    def next_attempts(
        self, failed: list[tuple[OutRecord, BaseException | None, bool]], idempotent: bool
    ) -> list[tuple[OutRecord, Verdict]]:
        """``decide``, applied to records not acknowledged, each with why (None: its
        transaction failed for another reason) and whether it was sent alone: the
        records to send next (each itself or its fallback), in request order. A
        failure is ``shared`` when the same exception struck several records (the
        broker refused their record batch as a whole). Raises ``DeliveryFailed``
        when even a fallback was refused."""
        struck = Counter(id(f) for _, f, _ in failed if f is not None)
        for f in {id(f): f for _, f, _ in failed if isinstance(f, NOT_AUTHORISED)}.values():
            self._rejections(
                log.error, "not_authorised", error=repr(f), effect="answers wait, "
                "offsets stay uncommitted, delivery is not ready until the ACL is back",
                fix='docs/guides/secure.md lists every ACL a worker needs',
            )  # fmt: skip
        todo = []
        for record, failure, alone in sorted(failed, key=lambda t: t[0].seq):
            shared = failure is not None and struck[id(failure)] > 1
            verdict = decide(record, failure, idempotent=idempotent, shared=shared, alone=alone)
            if verdict.action is Action.GIVE_UP:
                raise DeliveryFailed(
                    f"{record.job.source} cannot be delivered even as an error: {failure!r}"
                )
            nxt = record
            if verdict.action is Action.FALL_BACK:
                assert failure is not None
                answered = ModelInfo(record.model_name, record.model_version)
                nxt = fallback(record, refusal_code(failure), repr(failure), answered,
                               self._topics.registered)  # fmt: skip
            todo.append((nxt, verdict))
        return todo

    def log_rejection(self, out: OutRecord) -> None:
        """Every request answered with an error or sent to the DLQ is logged (at
        most ``burst`` lines per interval): code, where it came from and its id,
        never its payload."""
        job = out.job
        error = out.error
        code, message = (error.code, error.message) if error is not None else ("?", "")
        self._rejections(
            log.warning,
            "request_rejected",
            code=code,
            message=message[:200],
            topic=job.tp.topic,
            partition=job.tp.partition,
            offset=job.offset,
            id=out.request_id,
            sent_to="result" if out.kind != "dlq" else "none (shadow)" if self._shadow else "dlq",
        )

    def acknowledged(self, acked: list[OutRecord]) -> None:
        """Mark offsets done and count what was delivered, per batch."""
        now, wall_ms = time.monotonic(), time.time() * 1000.0
        # Per answering model version (one, but for the batches around a swap).
        kinds: dict[tuple[str, str, str], int] = {}
        latencies: dict[tuple[str, str, str], list[float]] = {}  # by model, version and lane
        ages: list[float] = []
        pending, done = self._pending, self._tracker.done
        for out in acked:
            job = out.job
            left = 0
            if pending:  # jobs with two records (an answer and its state record)
                key = (job.tp, job.offset, job.epoch)
                left = pending.pop(key, 1) - 1
                if left:  # its answer or its state record is still unacknowledged
                    pending[key] = left
            if not left:
                done(job.tp, job.offset, job.epoch)
            if out.kind == "state":
                metrics.STATE_RECORDS.inc()
                continue
            if out.kind == "step":
                continue
            name, version = out.model_name, out.model_version
            lane = (name, version, self._lane_of.get(job.tp.topic, job.tp.topic))
            if (seen := latencies.get(lane)) is None:
                seen = latencies[lane] = []
            seen.append(now - job.arrived)
            if job.timestamp_ms is not None and job.timestamp_ms > 0:
                # Wall clocks of two hosts: clamped at 0 when the producer's runs ahead.
                ages.append(max(0.0, wall_ms - job.timestamp_ms) / 1000.0)
            kinds[name, version, out.kind] = kinds.get((name, version, out.kind), 0) + 1
        for (name, version, lane_label), seconds in latencies.items():
            m = metrics.model_metrics(name, version)
            metrics.observe_all(m.request_seconds(lane_label), seconds)
        metrics.observe_all(metrics.RECORD_AGE_SECONDS, ages)
        if self._state_topics:
            metrics.STATE_PENDING.set(len(self._pending))
        for (name, version, kind), count in kinds.items():  # counters per batch, not per record
            if kind == "dlq":
                metrics.DLQ_PRODUCED.inc(count)
            else:
                metrics.model_metrics(name, version).results(kind).inc(count)
