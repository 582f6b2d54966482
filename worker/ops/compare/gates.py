"""The rollout gate: each threshold the operator set, what the comparison
measured for it, and whether it holds. ``failures`` (the CLI's exit status and
messages) and the decision page (``plot``) both read ``gates``: one decision."""

from __future__ import annotations

import math
from dataclasses import dataclass

from worker.ops.compare.report import Report


@dataclass(frozen=True)
class Thresholds:
    """What the operator requires (None: not checked)."""

    min_top1: float | None = None
    min_topk: float | None = None
    max_abs_diff: float | None = None
    min_cosine: float | None = None
    min_coverage: float | None = None
    max_error_diff: int | None = None


@dataclass(frozen=True)
class Gate:
    """One check: ``flag`` and its ``threshold`` as given, the ``measured`` value
    it was decided on (the worst over the outputs; None: nothing to measure),
    and why it is not met (``problems``; empty: met)."""

    flag: str
    threshold: str
    measured: float | None
    problems: tuple[str, ...]
    lower_is_better: bool = False

    @property
    def passed(self) -> bool:
        return not self.problems


def gates(report: Report, t: Thresholds) -> list[Gate]:
    """Every check ``t`` asks for, decided on ``report``. A threshold with
    nothing to measure it on fails: a rollout check that compared nothing must
    not pass. ``--label-key`` with no labelled request is a gate too."""
    out: list[Gate] = []
    ranked = {name: s for name, s in report.outputs.items() if s.ranked}
    compared = {name: s for name, s in report.outputs.items() if s.rows or s.shape_mismatch}
    for flag, bound, attr in (
        ("--min-top1", t.min_top1, "top1"),
        ("--min-topk", t.min_topk, "topk"),
    ):
        if bound is None:
            continue
        problems = [] if ranked else [f"{flag}: no classifier-like output was compared"]
        values = {name: getattr(s, attr) for name, s in sorted(ranked.items())}
        problems += [f"{flag} {bound}: {name} agrees on {v:.4f}"
                     for name, v in values.items() if v < bound]  # fmt: skip
        out.append(Gate(flag, f"{bound:g}", min(values.values(), default=None), tuple(problems)))
    if t.max_abs_diff is not None or t.min_cosine is not None:
        shapes = [f"{name}: shapes differ in {s.shape_mismatch} rows"
                  for name, s in sorted(compared.items()) if s.shape_mismatch]  # fmt: skip
        nothing = [] if compared else ["--max-abs-diff/--min-cosine: no output was compared"]
        if t.max_abs_diff is not None:
            bound = t.max_abs_diff
            diffs = {n: s.max_abs_diff for n, s in sorted(compared.items())
                     if s.max_abs_diff is not None}  # fmt: skip
            problems = [f"--max-abs-diff {bound:g}: {n} differs by {d:.3g}"
                        for n, d in diffs.items() if d > bound or math.isnan(d)]  # fmt: skip
            worst = max(diffs.values(), default=None)
            out.append(Gate("--max-abs-diff", f"{bound:g}", worst,
                            tuple(nothing + shapes + problems), lower_is_better=True))  # fmt: skip
            nothing, shapes = [], []  # said once
        if t.min_cosine is not None:
            bound = t.min_cosine
            cosines = {n: s.mean_cosine for n, s in sorted(compared.items())}
            problems = [
                f"--min-cosine {bound:g}: {n} has {'-' if c is None else f'{c:.6f}'}"
                for n, c in cosines.items() if c is None or c < bound
            ]  # fmt: skip
            known = [c for c in cosines.values() if c is not None]
            out.append(Gate("--min-cosine", f"{bound:g}", min(known, default=None),
                            tuple(nothing + shapes + problems)))  # fmt: skip
    if t.min_coverage is not None:
        ratio = report.coverage.ratio
        problems = []
        if ratio is None or ratio < t.min_coverage:
            shown = "nothing to join" if ratio is None else f"{ratio:.4f}"
            problems.append(f"--min-coverage {t.min_coverage:g}: {shown}")
        out.append(Gate("--min-coverage", f"{t.min_coverage:g}", ratio, tuple(problems)))
    if report.label_key is not None:
        labelled = max((a.labelled for sides in report.accuracy.values()
                        for a in sides.values()), default=0)  # fmt: skip
        problems = []
        if not labelled:
            # Accuracy asked for and none measured: "- (0/0)" would decide nothing.
            problems.append(
                f"--label-key {report.label_key}: no joined request carries a class index as "
                f"meta.{report.label_key} (read from {report.label_source or 'nowhere'}; "
                f"{report.unusable_labels} unusable); send labels with produce --meta "
                f"{report.label_key}=N (its --samples carry theirs)"
            )
        out.append(Gate("--label-key", report.label_key, float(labelled), tuple(problems)))
    if t.max_error_diff is not None:
        differs = report.status["differs"]
        problems = []
        if differs > t.max_error_diff:
            problems.append(f"--max-error-diff {t.max_error_diff}: the outcome differs in "
                            f"{differs} rows")  # fmt: skip
        out.append(Gate("--max-error-diff", str(t.max_error_diff), float(differs),
                        tuple(problems), lower_is_better=True))  # fmt: skip
    return out


def failures(report: Report, t: Thresholds) -> list[str]:
    """Why ``report`` misses ``t`` (empty: it meets every threshold)."""
    return [problem for gate in gates(report, t) for problem in gate.problems]
