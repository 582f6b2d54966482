"""A comparison's verdict: the report (JSON and text) and the thresholds it is
held to. No I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from worker.ops.compare.results import SIDES, Side
from worker.ops.compare.stats import OutputSummary


@dataclass(frozen=True)
class Coverage:
    """How much of each side the join matched. ``ratio`` is ``joined`` over the
    larger side (joined / in baseline and joined / in candidate, whichever is
    lower); None when neither side had a result. ``requests``: records read
    on the input topic, when one was given."""

    baseline: int
    candidate: int
    joined: int
    duplicates: Mapping[Side, int]
    unreadable: Mapping[Side, int]
    requests: int | None = None
    outside_window: Mapping[Side, int] | None = None  # results before --since, per side

    @property
    def ratio(self) -> float | None:
        most = max(self.baseline, self.candidate)
        return self.joined / most if most else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "candidate": self.candidate,
            "joined": self.joined,
            "only_baseline": self.baseline - self.joined,
            "only_candidate": self.candidate - self.joined,
            "ratio": self.ratio,
            "duplicates": dict(self.duplicates),
            "unreadable": dict(self.unreadable),
            "requests": self.requests,
            "outside_window": None if self.outside_window is None else dict(self.outside_window),
        }


@dataclass(frozen=True)
class Accuracy:
    """One side's top-1 accuracy on one classifier-like output, over the joined
    pairs whose request carries a usable label (an error answer is wrong)."""

    labelled: int
    correct: int

    @property
    def value(self) -> float | None:
        return self.correct / self.labelled if self.labelled else None

    def to_dict(self) -> dict[str, Any]:
        return {"labelled": self.labelled, "correct": self.correct, "accuracy": self.value}


@dataclass(frozen=True)
class Report:
    topics: Mapping[Side, str]
    models: Mapping[Side, tuple[str, ...]]  # every "name@version" each side answered with
    coverage: Coverage
    status: Mapping[str, Any]  # StatusAgreement.to_dict()
    outputs: Mapping[str, OutputSummary]
    latency: Mapping[str, Any]  # Latency.summary()
    label_key: str | None = None
    label_source: str | None = None  # "requests" or "results' meta"
    unusable_labels: int = 0  # labels that are not a class index
    accuracy: Mapping[str, Mapping[Side, Accuracy]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "topics": dict(self.topics),
            "models": {side: list(models) for side, models in self.models.items()},
            "coverage": self.coverage.to_dict(),
            "status": dict(self.status),
            "outputs": {name: s.to_dict() for name, s in sorted(self.outputs.items())},
            "latency": self.latency,
        }
        if self.label_key is not None:
            doc["accuracy"] = {
                "label_key": self.label_key,
                "label_source": self.label_source,
                "unusable_labels": self.unusable_labels,
                "outputs": {
                    name: {side: acc.to_dict() for side, acc in sides.items()}
                    for name, sides in sorted(self.accuracy.items())
                },
            }
        return doc

    def format(self) -> str:
        """The report for a terminal: coverage, outcomes, agreement per output,
        accuracy, latency (milliseconds)."""
        c = self.coverage
        ratio = "-" if c.ratio is None else f"{c.ratio:.4f}"
        lines = [
            f"baseline  {self.topics['baseline']}: {', '.join(self.models['baseline']) or '-'}",
            f"candidate {self.topics['candidate']}: {', '.join(self.models['candidate']) or '-'}",
            f"coverage: {c.joined} joined of {c.baseline} baseline and {c.candidate} candidate "
            f"results ({ratio}); duplicates {c.duplicates['baseline']}/"
            f"{c.duplicates['candidate']}, unreadable {c.unreadable['baseline']}/"
            f"{c.unreadable['candidate']}"
            + ("" if c.requests is None else f"; {c.requests} requests on the input topic")
            + (
                ""
                if c.outside_window is None
                else f"; before --since: {c.outside_window['baseline']}/"
                f"{c.outside_window['candidate']} left out"
            ),
            f"outcome differs: {self.status['differs']} (status {self.status['status_differs']}, "
            f"error code {self.status['error_code_differs']}); past its deadline on one side "
            f"only: {self.status['expired_on_one_side']} (not the model's difference)",
        ]
        lines += [f"  {change}: {n}" for change, n in self.status["changes"].items()]
        lines.append(f"{'output':<24}{'rows':>8}{'top-1':>8}{'top-k':>8}{'k':>4}"
                     f"{'max|diff|':>12}{'mean cos':>10}")  # fmt: skip
        for name, s in sorted(self.outputs.items()):
            diff = "-" if s.max_abs_diff is None else f"{s.max_abs_diff:.3g}"
            lines.append(
                f"{name:<24}{s.rows:>8}{_num(s.top1, 4):>8}{_num(s.topk, 4):>8}"
                f"{'-' if s.k is None else s.k:>4}{diff:>12}{_num(s.mean_cosine, 6):>10}"
            )
            odd = {"shape mismatch": s.shape_mismatch, "only in baseline": s.only_baseline,
                   "only in candidate": s.only_candidate, "non-finite": s.non_finite}  # fmt: skip
            if any(odd.values()):
                lines.append("  " + ", ".join(f"{k} {v}" for k, v in odd.items() if v))
        for name, sides in sorted(self.accuracy.items()):
            parts = [f"{side} {_num(a.value, 4)} ({a.correct}/{a.labelled})"
                     for side, a in sides.items()]  # fmt: skip
            lines.append(f"top-1 accuracy ({name}, meta.{self.label_key}): " + ", ".join(parts))
        if self.label_key is not None and self.unusable_labels:
            lines.append(f"  {self.unusable_labels} labels are not a class index (ignored)")
        lines.append("latency of ok results, ms (p50/p95/p99):")
        for side in SIDES:
            for model, stages in self.latency.get(side, {}).items():
                cells = [f"{stage} {p['p50_us'] / 1e3:.2f}/{p['p95_us'] / 1e3:.2f}/"
                         f"{p['p99_us'] / 1e3:.2f}" for stage, p in stages.items()]  # fmt: skip
                lines.append(f"  {side} {model}: " + "; ".join(cells))
        return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
