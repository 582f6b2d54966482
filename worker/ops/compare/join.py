"""The join of two result topics on ``source``, pair by pair as they are read.

A result waits until the other side's result for the same request arrives;
then the pair is scored and both are dropped, so memory holds only the results
one side has and the other not yet (or never). The first result of a request
on a side counts; a repeat (at-least-once delivery writes one after a crash) is
only counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from worker.ops.compare.report import Accuracy, Coverage, Report
from worker.ops.compare.results import SIDES, Key, ResultRow, Side, class_of, ranking
from worker.ops.compare.stats import Latency, OutputAgreement, StatusAgreement


@dataclass(frozen=True, slots=True)
class _Pair:
    """What accuracy needs of a joined pair: its label as the results echoed
    it, and each side's top class per classifier-like output."""

    key: Key
    label: object
    tops: dict[str, tuple[int | None, int | None]]


class Comparison:
    """Feed it results (``add``) and, optionally, the requests' labels
    (``label``); ``report`` says how the candidate compares."""

    def __init__(
        self,
        top_k: int = 3,
        label_key: str | None = None,
        since: Mapping[tuple[str, int], int] | None = None,
    ) -> None:
        """``since``: a window, the first offset of each input partition it
        holds (``compare --since``); results and requests of other offsets, or of
        partitions it does not name, are left out (counted as outside it)."""
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        self._top_k = top_k
        self._label_key = label_key
        self._since = since
        self._outside: dict[Side, int] = dict.fromkeys(SIDES, 0)
        self._waiting: dict[Side, dict[Key, ResultRow]] = {side: {} for side in SIDES}
        self._seen: dict[Side, set[Key]] = {side: set() for side in SIDES}
        self._duplicates: dict[Side, int] = dict.fromkeys(SIDES, 0)
        self._unreadable: dict[Side, int] = dict.fromkeys(SIDES, 0)
        self._models: dict[Side, set[str]] = {side: set() for side in SIDES}
        self._outputs: dict[str, OutputAgreement] = {}
        self._status = StatusAgreement()
        self._latency = Latency()
        self._pairs: list[_Pair] = []
        self._labels: dict[Key, object] | None = None  # from the requests, when read
        self._requests = 0

    def _in_window(self, key: Key) -> bool:
        if self._since is None:
            return True
        start = self._since.get((key[0], key[1]))
        return start is not None and key[2] >= start

    def add(self, side: Side, row: ResultRow) -> None:
        if not self._in_window(row.key):
            self._outside[side] += 1
            return
        if row.key in self._seen[side]:
            self._duplicates[side] += 1
            return
        self._seen[side].add(row.key)
        self._models[side].add(row.model)
        self._latency.add(side, row)
        other: Side = "candidate" if side == "baseline" else "baseline"
        match = self._waiting[other].pop(row.key, None)
        if match is None:
            self._waiting[side][row.key] = row
        elif side == "candidate":
            self._pair(match, row)
        else:
            self._pair(row, match)

    def unreadable(self, side: Side) -> None:
        """A record on a result topic that is not a result."""
        self._unreadable[side] += 1

    def label(self, key: Key, label: object) -> None:
        """A request read on the input topic, with its label (None: none);
        once any is given, labels come from the requests, not the results."""
        if self._labels is None:
            self._labels = {}
        if not self._in_window(key):
            return
        self._requests += 1
        if label is not None:
            self._labels[key] = label

    def _pair(self, a: ResultRow, b: ResultRow) -> None:
        self._status.add(a, b)
        if a.status == "ok" and b.status == "ok":
            for name in a.outputs.keys() | b.outputs.keys():
                acc = self._outputs.get(name)
                if acc is None:
                    acc = self._outputs[name] = OutputAgreement(self._top_k)
                acc.add(name, a.outputs.get(name), b.outputs.get(name))
        if self._label_key is not None:
            ta, tb = _tops(a), _tops(b)
            tops = {name: (ta.get(name), tb.get(name)) for name in ta.keys() | tb.keys()}
            label = a.label if a.label is not None else b.label
            self._pairs.append(_Pair(a.key, label, tops))

    def report(self, topics: dict[Side, str]) -> Report:
        joined = self._status.joined
        report = Report(
            topics=topics,
            models={side: tuple(sorted(self._models[side])) for side in SIDES},
            coverage=Coverage(
                baseline=len(self._seen["baseline"]),
                candidate=len(self._seen["candidate"]),
                joined=joined,
                duplicates=dict(self._duplicates),
                unreadable=dict(self._unreadable),
                requests=None if self._labels is None else self._requests,
                outside_window=None if self._since is None else dict(self._outside),
            ),
            status=self._status.to_dict(),
            outputs={name: acc.summary() for name, acc in self._outputs.items()},
            latency=self._latency.summary(),
        )
        return report if self._label_key is None else self._with_accuracy(report)

    def _with_accuracy(self, report: Report) -> Report:
        """Each side's top-1 accuracy per classifier-like output, over the joined
        pairs whose label is a class index (labels from the requests when they
        were read, else from the meta the results echo)."""
        labels = self._labels
        names = sorted({name for p in self._pairs for name in p.tops})
        counts = {name: {side: [0, 0] for side in SIDES} for name in names}
        unusable = 0
        for p in self._pairs:
            raw = p.label if labels is None else labels.get(p.key)
            if raw is None:
                continue
            truth = class_of(raw)
            if truth is None:
                unusable += 1
                continue
            for name in names:
                tops = p.tops.get(name, (None, None))
                for side, top in zip(SIDES, tops, strict=True):
                    counts[name][side][0] += 1
                    counts[name][side][1] += int(top == truth)
        return dataclasses.replace(
            report,
            label_key=self._label_key,
            label_source="results' meta" if labels is None else "requests",
            unusable_labels=unusable,
            accuracy={
                name: {side: Accuracy(n, ok) for side, (n, ok) in sides.items()}
                for name, sides in counts.items()
            },
        )


def _tops(row: ResultRow) -> dict[str, int]:
    """The top class of each classifier-like output of an ``ok`` result (an
    error answer names none: it is wrong whatever the label)."""
    if row.status != "ok":
        return {}
    out = {}
    for name, arr in row.outputs.items():
        ranked = ranking(name, arr)
        if ranked is not None:
            out[name] = int(ranked[0])
    return out
