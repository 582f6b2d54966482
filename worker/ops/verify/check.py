"""The pure core: requests made vs answers seen, into a ``Report``. No I/O, so
every rule is unit-tested on plain tuples."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from worker.ops.verify.report import (
    DEFAULT_MAX_EXAMPLES,
    DlqRow,
    Duplicate,
    InputRecord,
    Inputs,
    OrderingViolation,
    OutputRow,
    PartitionReport,
    Reply,
    Report,
    Unparseable,
)


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
