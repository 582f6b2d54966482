"""Delivery verification: did every request get exactly one answer, in order?

The worker promises at-least-once delivery: every record on an input topic gets
a result on the output topic or, when it cannot be answered at all, a record on
the DLQ, and the results of one input partition appear in request order. This
module checks that promise from the outside, from nothing but the topics
themselves, so it can judge any worker build (or a fault-injection run) without
trusting the worker's own metrics or committed offsets.

It has two halves:

* a pure core, ``verify`` / ``check``, that compares the offsets requested with
  the sources the answers name and builds a ``Report``; no I/O, so every rule is
  unit-tested on plain tuples;
* ``read_topics``, which reads the three topic sets from the beginning without a
  consumer group (a verifier must not move anybody's committed offsets) and
  turns records into the core's inputs.

``add_arguments`` / ``run`` are the ``infer-worker verify`` command line.

The join key is the ``source`` {topic, partition, offset} that every result
carries and the ``source.*`` headers of every DLQ record: the wire contract's
idempotency key. Request ids are client-chosen and need not be unique, so they
are never used to match.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from worker.config import KafkaConfig, load_settings
from worker.contract import decode_result
from worker.errors import ConfigError, WorkerError
from worker.tools.topics import Collected, Collector

__all__ = [
    "DlqRow",
    "Duplicate",
    "InputRecord",
    "Inputs",
    "Kind",
    "Observed",
    "OrderingViolation",
    "OutputRow",
    "PartitionReport",
    "Reply",
    "Report",
    "Totals",
    "Unparseable",
    "add_arguments",
    "check",
    "read_topics",
    "run",
    "verify",
]

Kind = Literal["result", "dlq"]

#: ``{input topic: {partition: offsets}}``: every request that was made. A
#: partition listed with no offsets is known to exist but was empty.
Inputs = Mapping[str, Mapping[int, Iterable[int]]]
#: ``(output_partition, output_offset, source_topic, source_partition, source_offset)``
OutputRow = tuple[int, int, str, int, int]
#: ``(source_topic, source_partition, source_offset)``
DlqRow = tuple[str, int, int]

#: How many ordering violations each partition report keeps as examples; the
#: count is always exact.
DEFAULT_MAX_EXAMPLES: Final = 5

# --------------------------------------------------------------------------- types


@dataclass(frozen=True, slots=True, order=True)
class InputRecord:
    """One request's position: the identity an answer's ``source`` refers to."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}@{self.offset}"


@dataclass(frozen=True, slots=True)
class Reply:
    """One record that answers a request: a result or a DLQ record.

    ``output_partition`` / ``output_offset`` locate the answer in its own topic.
    They are ``None`` where the caller does not know them (DLQ rows given to
    ``verify`` carry only the source); such answers count for delivery but take
    no part in the ordering check.
    """

    source: InputRecord
    output_partition: int | None
    output_offset: int | None
    kind: Kind = "result"

    def sort_key(self) -> tuple[str, int, int, InputRecord]:
        """Total order over answers, so that reports never depend on the order
        records happened to be fetched in."""
        return (
            self.kind,
            -1 if self.output_partition is None else self.output_partition,
            -1 if self.output_offset is None else self.output_offset,
            self.source,
        )


@dataclass(frozen=True, slots=True, order=True)
class Unparseable:
    """A record on the output or DLQ topic that names no source we can read:
    a result that does not decode, or a DLQ record without valid ``source.*``
    headers. Reported, never fatal: one corrupt record must not hide the state
    of all the others."""

    topic: str
    partition: int
    offset: int
    reason: str


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A request answered more than once. A result *and* a DLQ record for the
    same request is a duplicate too: the client would see an answer and the
    operator a failure for one request."""

    offset: int
    results: int
    dlq: int

    @property
    def count(self) -> int:
        return self.results + self.dlq


@dataclass(frozen=True, slots=True)
class OrderingViolation:
    """An answer in ``output_partition`` whose source offset is lower than that
    of the answer to the same source partition just before it in that output
    partition."""

    output_partition: int
    output_offset: int
    offset: int
    previous_offset: int
    previous_output_offset: int


@dataclass(frozen=True, slots=True)
class PartitionReport:
    """Delivery state of one input partition.

    ``requests`` and ``answered`` count distinct offsets; ``results`` and
    ``dlq`` count answer records (duplicates and unknown ones included), so
    ``results + dlq - answered`` is the number of surplus answers.
    """

    topic: str
    partition: int
    requests: int
    answered: int
    results: int
    dlq: int
    #: Requested offsets with neither a result nor a DLQ record.
    lost: tuple[int, ...]
    #: Offsets (requested or not) with more than one answer.
    duplicates: tuple[Duplicate, ...]
    ordering_violations: int
    #: The first few violations, in output order.
    ordering_examples: tuple[OrderingViolation, ...]
    #: Source offsets of answers to requests that are not among the inputs,
    #: one entry per answer record.
    unknown: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "requests": self.requests,
            "answered": self.answered,
            "results": self.results,
            "dlq": self.dlq,
            "lost": list(self.lost),
            "duplicates": [
                {"offset": d.offset, "count": d.count, "results": d.results, "dlq": d.dlq}
                for d in self.duplicates
            ],
            "ordering_violations": self.ordering_violations,
            "ordering_examples": [dataclasses.asdict(v) for v in self.ordering_examples],
            "unknown": list(self.unknown),
        }


@dataclass(frozen=True, slots=True)
class Totals:
    """Sums over all partitions. ``duplicates`` counts offsets answered more than
    once, ``surplus_answers`` the answers beyond the first for those offsets."""

    partitions: int
    requests: int
    answered: int
    results: int
    dlq: int
    lost: int
    duplicates: int
    surplus_answers: int
    ordering_violations: int
    unknown: int
    unparseable: int


@dataclass(frozen=True, slots=True)
class Report:
    """The verdict. ``ok`` means nothing was lost (and, with ``strict``, nothing
    was answered twice). Duplicates are expected under at-least-once delivery
    after a crash, so by default they are reported but do not fail the check;
    ordering violations, unknown and unparseable answers are always reported
    and never decide ``ok`` on their own (an unparseable answer still leaves
    its request lost, which does)."""

    partitions: tuple[PartitionReport, ...]
    unparseable: tuple[Unparseable, ...] = ()
    strict: bool = False
    totals: Totals = field(init=False)

    def __post_init__(self) -> None:
        p = self.partitions
        totals = Totals(
            partitions=len(p),
            requests=sum(r.requests for r in p),
            answered=sum(r.answered for r in p),
            results=sum(r.results for r in p),
            dlq=sum(r.dlq for r in p),
            lost=sum(len(r.lost) for r in p),
            duplicates=sum(len(r.duplicates) for r in p),
            surplus_answers=sum(d.count - 1 for r in p for d in r.duplicates),
            ordering_violations=sum(r.ordering_violations for r in p),
            unknown=sum(len(r.unknown) for r in p),
            unparseable=len(self.unparseable),
        )
        object.__setattr__(self, "totals", totals)

    @property
    def ok(self) -> bool:
        t = self.totals
        return t.lost == 0 and not (self.strict and t.duplicates)

    def failures(self) -> list[str]:
        """Why ``ok`` is false, in words; empty when it is true."""
        t = self.totals
        out = []
        if t.lost:
            out.append(f"{t.lost} lost")
        if self.strict and t.duplicates:
            out.append(f"{t.duplicates} duplicated (strict)")
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, every list sorted: two runs over the same topics give
        byte-identical output, so reports can be diffed."""
        return {
            "ok": self.ok,
            "strict": self.strict,
            "failures": self.failures(),
            "totals": dataclasses.asdict(self.totals),
            "partitions": [r.to_dict() for r in self.partitions],
            "unparseable": [dataclasses.asdict(u) for u in self.unparseable],
        }

    def format(self, max_items: int = 20) -> str:
        """A table per partition, then the problems (at most ``max_items`` lines
        each, offsets folded into ranges), then the verdict."""
        headers = (
            "topic",
            "partition",
            "requests",
            "answered",
            "results",
            "dlq",
            "lost",
            "duplicates",
            "out-of-order",
            "unknown",
        )
        rows = [
            (
                r.topic,
                str(r.partition),
                str(r.requests),
                str(r.answered),
                str(r.results),
                str(r.dlq),
                str(len(r.lost)),
                str(len(r.duplicates)),
                str(r.ordering_violations),
                str(len(r.unknown)),
            )
            for r in self.partitions
        ]
        t = self.totals
        rows.append(
            (
                "total",
                "",
                str(t.requests),
                str(t.answered),
                str(t.results),
                str(t.dlq),
                str(t.lost),
                str(t.duplicates),
                str(t.ordering_violations),
                str(t.unknown),
            )
        )
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

        def line(cells: Sequence[str]) -> str:
            first = cells[0].ljust(widths[0])
            rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
            return "  ".join((first, *rest)).rstrip()

        out = [line(headers), *(line(row) for row in rows)]
        problems: list[str] = []
        for r in self.partitions:
            name = f"{r.topic}/{r.partition}"
            if r.lost:
                problems.append(f"lost        {name}: {_ranges(r.lost, max_items)}")
            for d in r.duplicates[:max_items]:
                problems.append(
                    f"duplicate   {name}@{d.offset}: answered {d.count}x "
                    f"({d.results} result(s), {d.dlq} dlq)"
                )
            if len(r.duplicates) > max_items:
                problems.append(f"duplicate   {name}: ... {len(r.duplicates) - max_items} more")
            for v in r.ordering_examples:
                problems.append(
                    f"order       {name}: offset {v.offset} at output "
                    f"{v.output_partition}@{v.output_offset} after offset {v.previous_offset} "
                    f"at output {v.output_partition}@{v.previous_output_offset}"
                )
            if r.ordering_violations > len(r.ordering_examples):
                more = r.ordering_violations - len(r.ordering_examples)
                problems.append(f"order       {name}: ... {more} more")
            if r.unknown:
                problems.append(
                    f"unknown     {name}: answers for offsets never requested: "
                    f"{_ranges(r.unknown, max_items)}"
                )
        for u in self.unparseable[:max_items]:
            problems.append(f"unparseable {u.topic}/{u.partition}@{u.offset}: {u.reason}")
        if len(self.unparseable) > max_items:
            problems.append(f"unparseable ... {len(self.unparseable) - max_items} more")
        if problems:
            out += ["", *problems]
        out.append("")
        if self.ok:
            notes = []
            if t.duplicates:
                notes.append(f"{t.duplicates} duplicated")
            if t.ordering_violations:
                notes.append(f"{t.ordering_violations} out of order")
            if t.unknown:
                notes.append(f"{t.unknown} unknown")
            if t.unparseable:
                notes.append(f"{t.unparseable} unparseable")
            extra = f" ({', '.join(notes)})" if notes else ""
            out.append(f"OK: {t.requests} requests, all answered{extra}")
        else:
            out.append(f"FAILED: {', '.join(self.failures())} of {t.requests} requests")
        return "\n".join(out)


def _ranges(offsets: Sequence[int], max_items: int) -> str:
    """``0 1 2 5 7 8`` -> ``0-2, 5, 7-8``: lost offsets usually come in runs."""
    runs: list[tuple[int, int]] = []
    for o in offsets:
        if runs and o <= runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], max(o, runs[-1][1]))
        else:
            runs.append((o, o))
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:max_items])
    if len(runs) > max_items:
        text += f", ... ({len(runs) - max_items} more ranges)"
    return text


# --------------------------------------------------------------------------- pure core


def verify(
    inputs: Inputs,
    outputs: Iterable[OutputRow] = (),
    dlq: Iterable[DlqRow] = (),
    *,
    unparseable: Iterable[Unparseable] = (),
    strict: bool = False,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
) -> Report:
    """Check answers given as plain tuples (see ``OutputRow`` and ``DlqRow``)."""
    answers = [
        *(Reply(InputRecord(st, sp, so), op, oo, "result") for op, oo, st, sp, so in outputs),
        *(Reply(InputRecord(st, sp, so), None, None, "dlq") for st, sp, so in dlq),
    ]
    return check(inputs, answers, unparseable=unparseable, strict=strict, max_examples=max_examples)


def check(
    inputs: Inputs,
    answers: Iterable[Reply],
    *,
    unparseable: Iterable[Unparseable] = (),
    strict: bool = False,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
) -> Report:
    """Compare the requests made with the answers seen.

    Every input partition gets a report, and so does every partition that an
    answer names but the inputs do not (all its answers are then ``unknown``):
    an answer pointing at a partition nobody asked about is as suspicious as
    one pointing at a missing offset.
    """
    requested: dict[tuple[str, int], set[int]] = defaultdict(set)
    for topic, partitions in inputs.items():
        for partition, offsets in partitions.items():
            requested[(topic, partition)].update(offsets)

    ordered = sorted(answers, key=Reply.sort_key)
    # Reply counts per source, split by kind: [results, dlq].
    counts: dict[tuple[str, int], dict[int, list[int]]] = defaultdict(dict)
    for a in ordered:
        per_offset = counts[(a.source.topic, a.source.partition)]
        pair = per_offset.setdefault(a.source.offset, [0, 0])
        pair[0 if a.kind == "result" else 1] += 1

    ordering = _ordering(ordered, max_examples)

    reports = []
    for key in sorted(requested.keys() | counts.keys()):
        wanted = requested.get(key, set())
        seen = counts.get(key, {})
        unknown: list[int] = []
        for offset in sorted(seen.keys() - wanted):
            unknown += [offset] * sum(seen[offset])
        violations, examples = ordering.get(key, (0, []))
        reports.append(
            PartitionReport(
                topic=key[0],
                partition=key[1],
                requests=len(wanted),
                answered=len(wanted & seen.keys()),
                results=sum(r for r, _ in seen.values()),
                dlq=sum(d for _, d in seen.values()),
                lost=tuple(sorted(wanted - seen.keys())),
                duplicates=tuple(
                    Duplicate(offset, r, d) for offset, (r, d) in sorted(seen.items()) if r + d > 1
                ),
                ordering_violations=violations,
                ordering_examples=tuple(examples),
                unknown=tuple(unknown),
            )
        )
    return Report(tuple(reports), tuple(sorted(unparseable)), strict)


def _ordering(
    answers: Sequence[Reply], max_examples: int
) -> dict[tuple[str, int], tuple[int, list[OrderingViolation]]]:
    """Ordering violations per source partition.

    Only results are checked: the contract orders the results a client reads,
    and ordering only exists within one output partition. Within it, the
    *first* answer to each request is compared with the previous first answer
    from the same source partition; a step backwards is one violation. First
    answers only, because a redelivered request answered again later is a
    duplicate (reported as such), not a reordering; adjacent steps rather than
    a running maximum, so one request answered too early counts once instead
    of once for every request it overtook.
    """
    found: dict[tuple[str, int], tuple[int, list[OrderingViolation]]] = {}
    seen: set[tuple[int, InputRecord]] = set()
    last: dict[tuple[int, str, int], tuple[int, int]] = {}
    for a in answers:  # sorted by (kind, output partition, output offset)
        if a.kind != "result" or a.output_partition is None or a.output_offset is None:
            continue
        if (a.output_partition, a.source) in seen:
            continue
        seen.add((a.output_partition, a.source))
        lane = (a.output_partition, a.source.topic, a.source.partition)
        previous = last.get(lane)
        last[lane] = (a.source.offset, a.output_offset)
        if previous is None or a.source.offset >= previous[0]:
            continue
        key = (a.source.topic, a.source.partition)
        count, examples = found.get(key, (0, []))
        if len(examples) < max_examples:
            examples.append(
                OrderingViolation(a.output_partition, a.output_offset, a.source.offset, *previous)
            )
        found[key] = (count + 1, examples)
    return found


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class Observed:
    """What ``read_topics`` found besides the inputs. ``complete`` is false when
    ``timeout`` passed before the topics went quiet: the answers may then lag
    the inputs, and a verdict from them is not to be trusted."""

    answers: tuple[Reply, ...]
    unparseable: tuple[Unparseable, ...]
    complete: bool


_DECIMAL: Final = re.compile(rb"[0-9]+")
_SOURCE_HEADERS: Final = ("source.topic", "source.partition", "source.offset")


def _dlq_source(headers: Mapping[str, bytes]) -> InputRecord | str:
    """The source named by a DLQ record's headers, or why there is none.

    The numbers must be plain ASCII decimals: ``int()`` would also take
    ``" 7"``, ``"+7"`` or ``"7_0"``, which no worker writes.
    """
    missing = [h for h in _SOURCE_HEADERS if h not in headers]
    if missing:
        return f"DLQ record without header(s) {', '.join(missing)}"
    try:
        topic = headers["source.topic"].decode("ascii")
    except UnicodeDecodeError:
        return "DLQ header source.topic is not ASCII"
    numbers = []
    for name in ("source.partition", "source.offset"):
        raw = headers[name]
        if not _DECIMAL.fullmatch(raw):
            return f"DLQ header {name} is not a decimal number: {raw[:32]!r}"
        numbers.append(int(raw))
    if not topic:
        return "DLQ header source.topic is empty"
    return InputRecord(topic, numbers[0], numbers[1])


def _result_source(value: bytes | None) -> InputRecord | str:
    if value is None:
        return "record has no value (tombstone)"
    try:
        s = decode_result(value).source
    except (ValueError, WorkerError) as exc:
        return f"not a result: {exc}"[:300]
    return InputRecord(s.topic, s.partition, s.offset)


async def read_topics(
    bootstrap: str,
    input_topics: Sequence[str],
    output_topic: str,
    dlq_topic: str,
    *,
    idle_timeout: float = 2.0,
    timeout: float = 60.0,
) -> tuple[dict[str, dict[int, list[int]]], Observed]:
    """Read every record of the input, output and DLQ topics from the beginning.

    No consumer group is joined, so nothing is committed and no running
    worker's group is rebalanced. The read stops once no new record has
    arrived for ``idle_timeout`` seconds, counted from the first completed
    fetch (connecting is not idleness). It does not ask the broker where the
    topics end: the embedded Tansu broker answers ``end_offsets``,
    ``seek_to_end`` and ``offsets_for_times`` wrongly, and a verifier that
    trusted them would report phantom losses. The price is that answers still
    being produced after the quiet period are missed; give ``idle_timeout``
    more than the worker's longest pause.

    Records are boiled down to positions as they arrive and the collector's
    buffers emptied, so memory grows with the number of records, not their
    size. Returns every partition of each input topic (empty ones included)
    with the offsets found, and the answers; an output record that does not
    decode, or a DLQ record without valid source headers, becomes an
    ``Unparseable`` entry instead of an error. The output and DLQ topic may be
    the same topic: records are then tried as results first.
    """
    if idle_timeout <= 0 or timeout <= 0:
        raise ValueError("idle_timeout and timeout must be > 0")
    inputs_unique = list(dict.fromkeys(input_topics))
    answer_topics = [t for t in dict.fromkeys((output_topic, dlq_topic)) if t not in inputs_unique]
    if len(answer_topics) < len({output_topic, dlq_topic}):
        raise ValueError("the output and DLQ topics must not be input topics")

    inputs: dict[str, dict[int, list[int]]] = {t: {} for t in inputs_unique}
    answers: list[Reply] = []
    unparseable: list[Unparseable] = []

    def classify(topic: str, rec: Collected) -> None:
        if topic in inputs:
            inputs[topic].setdefault(rec.partition, []).append(rec.offset)
            return
        reasons = []
        if topic == output_topic:
            source = _result_source(rec.value)
            if isinstance(source, InputRecord):
                answers.append(Reply(source, rec.partition, rec.offset, "result"))
                return
            reasons.append(source)
        if topic == dlq_topic:
            source = _dlq_source(rec.headers)
            if isinstance(source, InputRecord):
                answers.append(Reply(source, rec.partition, rec.offset, "dlq"))
                return
            reasons.append(source)
        unparseable.append(Unparseable(topic, rec.partition, rec.offset, "; ".join(reasons)))

    last_new: float | None = None  # set by the first completed fetch

    def drain(c: Collector) -> None:
        nonlocal last_new
        now = time.monotonic()
        fresh = False
        for topic, bucket in c.records.items():
            for rec in bucket:
                classify(topic, rec)
            fresh = fresh or bool(bucket)
            bucket.clear()
        if fresh or last_new is None:
            last_new = now

    def quiet(_: Collector) -> bool:
        return last_new is not None and time.monotonic() - last_new >= idle_timeout

    collector = Collector(bootstrap, [*inputs_unique, *answer_topics])
    await collector.start()
    try:
        # The collector reads every partition the metadata lists: record them
        # all, so an empty input partition still shows up in the report.
        for tp in collector.partitions:
            if tp.topic in inputs:
                inputs[tp.topic].setdefault(tp.partition, [])
        complete = await collector.collect(quiet, timeout, progress=drain)
    finally:
        await collector.stop()
    drain(collector)  # anything fetched after the last progress call
    for partitions in inputs.values():
        for offsets in partitions.values():
            offsets.sort()
    inputs = {t: dict(sorted(p.items())) for t, p in inputs.items()}
    return inputs, Observed(tuple(answers), tuple(unparseable), complete)


# --------------------------------------------------------------------------- CLI


def _topic_list(text: str) -> list[str]:
    return list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``verify`` command's options. Kafka settings left out come from
    ``--config`` (file plus ``INFER_WORKER_*`` overrides, exactly as ``run``
    reads them, so the verifier checks the topics that worker uses) or else
    from the built-in defaults."""
    parser.add_argument(
        "--config", help="TOML file to take bootstrap servers and topics from (flags win)"
    )
    parser.add_argument("--bootstrap-servers", help="host:port[,host:port...]")
    parser.add_argument("--input-topics", help="comma-separated request topics")
    parser.add_argument("--output-topic", help="result topic")
    parser.add_argument("--dlq-topic", help="dead-letter topic")
    parser.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON ('-': stdout)"
    )
    parser.add_argument(
        "--strict", action="store_true", help="duplicates fail the check too (exactly-once)"
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="stop reading once no record arrived for this long (default 2)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="give up if the topics are not quiet after this long (default 60)",
    )


def _kafka_config(args: argparse.Namespace) -> KafkaConfig:
    """Flags over ``--config`` over defaults, validated by ``KafkaConfig`` itself
    so the verifier rejects exactly the topic layouts the worker rejects."""
    base = load_settings(args.config).kafka if args.config else KafkaConfig()
    changes: dict[str, Any] = {}
    if args.bootstrap_servers is not None:
        changes["bootstrap_servers"] = args.bootstrap_servers
    if args.input_topics is not None:
        changes["input_topics"] = tuple(_topic_list(args.input_topics))
    if args.output_topic is not None:
        changes["output_topic"] = args.output_topic
    if args.dlq_topic is not None:
        changes["dlq_topic"] = args.dlq_topic
    kafka = dataclasses.replace(base, **changes)
    if kafka.security_protocol != "PLAINTEXT":
        # The topic reader connects in plaintext; failing here beats a
        # connection that hangs against a TLS listener.
        raise ConfigError(
            "kafka.security_protocol: verify connects in PLAINTEXT only, "
            f"got {kafka.security_protocol}"
        )
    if not (args.idle_timeout > 0 and args.timeout > 0):
        raise ConfigError("--idle-timeout and --timeout must be > 0")
    return kafka


def run(args: argparse.Namespace) -> int:
    """Read, verify, print. Exit status: 0 ok; 1 something lost (or duplicated
    with ``--strict``), or the topics never went quiet within ``--timeout``;
    2 usage or configuration errors, including topics that do not exist and
    a broker that cannot be reached (the check could not be made)."""
    try:
        kafka = _kafka_config(args)
    except ConfigError as exc:
        print(f"infer-worker verify: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        inputs, observed = asyncio.run(
            read_topics(
                kafka.bootstrap_servers,
                kafka.input_topics,
                kafka.output_topic,
                kafka.dlq_topic,
                idle_timeout=args.idle_timeout,
                timeout=args.timeout,
            )
        )
    except Exception as exc:  # aiokafka raises its own hierarchy, Collector RuntimeError
        print(f"infer-worker verify: cannot read topics: {exc!r}", file=sys.stderr)
        return 2
    report = check(inputs, observed.answers, unparseable=observed.unparseable, strict=args.strict)
    doc = {
        **report.to_dict(),
        "complete": observed.complete,
        "topics": {
            "bootstrap_servers": kafka.bootstrap_servers,
            "input": list(kafka.input_topics),
            "output": kafka.output_topic,
            "dlq": kafka.dlq_topic,
        },
    }
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print(report.format())
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(doc, fh, indent=2)
                fh.write("\n")
    if not observed.complete:
        print(
            f"infer-worker verify: topics still busy after {args.timeout}s; "
            "the report covers only what was read",
            file=sys.stderr,
        )
        return 1
    return 0 if report.ok else 1
