"""The verifier's vocabulary and its verdict: what was requested, what answered
it, and the ``Report`` (a table per partition, the problems, ok or not)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

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
        out = self._table()
        problems = [line for r in self.partitions for line in _problems(r, max_items)]
        for u in self.unparseable[:max_items]:
            problems.append(f"unparseable {u.topic}/{u.partition}@{u.offset}: {u.reason}")
        if len(self.unparseable) > max_items:
            problems.append(f"unparseable ... {len(self.unparseable) - max_items} more")
        if problems:
            out += ["", *problems]
        return "\n".join([*out, "", self._verdict()])

    def _table(self) -> list[str]:
        t = self.totals
        rows = [
            (r.topic, str(r.partition), *map(str, (
                r.requests, r.answered, r.results, r.dlq, len(r.lost), len(r.duplicates),
                r.ordering_violations, len(r.unknown),
            )))
            for r in self.partitions
        ] + [
            ("total", "", *map(str, (
                t.requests, t.answered, t.results, t.dlq, t.lost, t.duplicates,
                t.ordering_violations, t.unknown,
            )))
        ]  # fmt: skip
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(_HEADERS)]

        def line(cells: Sequence[str]) -> str:
            first = cells[0].ljust(widths[0])
            rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
            return "  ".join((first, *rest)).rstrip()

        return [line(_HEADERS), *(line(row) for row in rows)]

    def _verdict(self) -> str:
        t = self.totals
        if not self.ok:
            return f"FAILED: {', '.join(self.failures())} of {t.requests} requests"
        notes = [
            f"{n} {what}"
            for n, what in (
                (t.duplicates, "duplicated"),
                (t.ordering_violations, "out of order"),
                (t.unknown, "unknown"),
                (t.unparseable, "unparseable"),
            )
            if n
        ]
        extra = f" ({', '.join(notes)})" if notes else ""
        return f"OK: {t.requests} requests, all answered{extra}"


_HEADERS: Final = (
    "topic", "partition", "requests", "answered", "results", "dlq", "lost", "duplicates",
    "out-of-order", "unknown",
)  # fmt: skip


def _problems(r: PartitionReport, max_items: int) -> list[str]:
    """The problem lines of one partition's report."""
    name = f"{r.topic}/{r.partition}"
    out = []
    if r.lost:
        out.append(f"lost        {name}: {_ranges(r.lost, max_items)}")
    for d in r.duplicates[:max_items]:
        out.append(
            f"duplicate   {name}@{d.offset}: answered {d.count}x "
            f"({d.results} result(s), {d.dlq} dlq)"
        )
    if len(r.duplicates) > max_items:
        out.append(f"duplicate   {name}: ... {len(r.duplicates) - max_items} more")
    for v in r.ordering_examples:
        out.append(
            f"order       {name}: offset {v.offset} at output "
            f"{v.output_partition}@{v.output_offset} after offset {v.previous_offset} "
            f"at output {v.output_partition}@{v.previous_output_offset}"
        )
    if r.ordering_violations > len(r.ordering_examples):
        more = r.ordering_violations - len(r.ordering_examples)
        out.append(f"order       {name}: ... {more} more")
    if r.unknown:
        out.append(
            f"unknown     {name}: answers for offsets never requested: "
            f"{_ranges(r.unknown, max_items)}"
        )
    return out


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
