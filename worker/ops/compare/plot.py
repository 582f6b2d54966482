"""The comparison as a decision page (PNG): the verdict and each gate with its
threshold, measured value and pass/fail; how far the candidate disagrees, on a
log scale (0.992 agreement is 0.008 disagreement, far from 0); coverage and
outcome differences; accuracy where labels exist; latency per stage. Needs
matplotlib alone (the ``plot`` extra); ``available`` says whether it is there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from worker.ops.compare.gates import Gate
from worker.ops.compare.report import Report
from worker.ops.compare.results import SIDES

_PASS, _FAIL, _GREY = "#1a7f37", "#cf222e", "#6e7781"
_FLOOR = 1e-6  # where "no disagreement at all" is drawn on the log scale


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(report: Report, gates: Sequence[Gate], path: str) -> None:
    """Draw the page to ``path``. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 9), layout="constrained")
    grid = fig.subplots(2, 3)
    failed = [g for g in gates if not g.passed]
    verdict = (
        "NO GATE SET: nothing decided" if not gates
        else f"PASS: all {len(gates)} gates met" if not failed
        else f"FAIL: {len(failed)} of {len(gates)} gates not met"
    )  # fmt: skip
    colour = _GREY if not gates else _PASS if not failed else _FAIL
    models = " | ".join(
        f"{side} {report.topics[side]} ({', '.join(report.models[side]) or '-'})" for side in SIDES
    )
    fig.suptitle(f"{verdict}\n{models}", color=colour, fontsize=13, fontweight="bold")
    _gates(grid[0][0], gates)
    _disagreement(grid[0][1], report)
    _coverage(grid[0][2], report)
    _accuracy(grid[1][0], report)
    _latency(grid[1][1], report)
    _changes(grid[1][2], report)
    fig.savefig(path, format="png")  # no pyplot: a Figure picks its Agg canvas itself


def _gates(ax: Any, gates: Sequence[Gate]) -> None:
    ax.axis("off")
    ax.set_title("gates (threshold, measured)", loc="left")
    if not gates:
        ax.text(0, 0.9, "no threshold given: compare decided nothing", color=_GREY)
        return
    for i, g in enumerate(gates):
        y = 0.92 - i * 0.12
        measured = "-" if g.measured is None else f"{g.measured:.6g}"
        mark, colour = ("PASS", _PASS) if g.passed else ("FAIL", _FAIL)
        ax.text(0.0, y, mark, color=colour, fontweight="bold", transform=ax.transAxes)
        ax.text(0.14, y, f"{g.flag} {g.threshold}", transform=ax.transAxes)
        ax.text(0.68, y, measured, transform=ax.transAxes)
        if g.problems:
            ax.text(0.14, y - 0.05, g.problems[0][:70], color=_FAIL, fontsize=7,
                    transform=ax.transAxes)  # fmt: skip


def _disagreement(ax: Any, report: Report) -> None:
    """1 - agreement per output, log scale: a 0.992 top-1 agreement is a visible
    0.008, not a bar a hair shorter than 1."""
    names = sorted(report.outputs)
    metrics = (("1 - top-1", "top1"), ("1 - top-k", "topk"), ("1 - mean cosine", "mean_cosine"))
    width = 0.8 / len(metrics)
    for i, (label, attr) in enumerate(metrics):
        xs, values = [], []
        for j, name in enumerate(names):
            value = getattr(report.outputs[name], attr)
            if value is not None:
                xs.append(j + i * width)
                values.append(max(_FLOOR, 1.0 - value))
        if not values:
            continue  # no output measured so (a mean cosine of class indices)
        bars = ax.bar(xs, values, width, label=label)
        for bar, v in zip(bars, values, strict=True):
            shown = "0" if v <= _FLOOR else f"{v:.2g}"
            ax.annotate(shown, (bar.get_x() + bar.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=7)  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylim(_FLOOR / 2, 2.0)
    ax.set_xticks([j + width for j in range(len(names))], names, rotation=20, ha="right")
    ax.set_title(f"disagreement per output ({report.coverage.joined} pairs; lower is better)")
    if names:
        ax.legend(loc="upper right", fontsize="small")


def _coverage(ax: Any, report: Report) -> None:
    c, status = report.coverage, report.status
    rows = [
        ("joined", c.joined),
        ("only baseline", c.baseline - c.joined),
        ("only candidate", c.candidate - c.joined),
        ("outcome differs", status["differs"]),
        ("past deadline on one side", status["expired_on_one_side"]),
    ]
    if c.outside_window is not None:
        rows += [(f"before --since, {side}", c.outside_window[side]) for side in SIDES]
    labels = [r[0] for r in rows]
    values = [r[1] for r in rows]
    colours = [_PASS, _GREY, _GREY, _FAIL, _GREY, _GREY, _GREY][: len(rows)]
    bars = ax.barh(labels, values, color=colours)
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(str(v), (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    va="center", fontsize=8)  # fmt: skip
    ax.invert_yaxis()
    ratio = "-" if c.ratio is None else f"{c.ratio:.4f}"
    ax.set_title(f"coverage {ratio} and outcomes")


def _accuracy(ax: Any, report: Report) -> None:
    if report.label_key is None:
        ax.axis("off")
        ax.set_title("accuracy", loc="left")
        ax.text(0, 0.9, "no --label-key: accuracy not measured", color=_GREY)
        return
    names = sorted(report.accuracy)
    width = 0.8 / len(SIDES)
    for i, side in enumerate(SIDES):
        values = [report.accuracy[n][side].value for n in names]
        xs = [j + i * width for j, v in enumerate(values) if v is not None]
        shown = [v for v in values if v is not None]
        bars = ax.bar(xs, shown, width, label=side)
        for bar, n in zip(bars, [n for n, v in zip(names, values, strict=True) if v is not None],
                          strict=True):  # fmt: skip
            a = report.accuracy[n][side]
            ax.annotate(f"{a.value:.4f}\n{a.correct}/{a.labelled}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.set_ylim(0, 1.15)
    ax.set_xticks([j + width / 2 for j in range(len(names))], names)
    ax.set_title(f"top-1 accuracy against meta.{report.label_key}")
    if names:
        ax.legend(loc="lower right", fontsize="small")


def _latency(ax: Any, report: Report) -> None:
    groups = [(side, model, stages) for side in SIDES
              for model, stages in report.latency.get(side, {}).items() if stages]  # fmt: skip
    stages = list(dict.fromkeys(s for _, _, st in groups for s in st))
    width = 0.8 / max(1, len(groups))
    for i, (side, model, st) in enumerate(groups):
        xs = [j + i * width for j, s in enumerate(stages) if s in st]
        p50 = [st[s]["p50_us"] / 1e3 for s in stages if s in st]
        p99 = [st[s]["p99_us"] / 1e3 for s in stages if s in st]
        bars = ax.bar(xs, p50, width, label=f"{side} {model[:24]} p50")
        ax.scatter(xs, p99, marker="_", s=200, color=bars.patches[0].get_facecolor(),
                   label=f"{side} p99")  # fmt: skip
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(stages))], stages)
    ax.set_ylabel("ms")
    ax.set_title("latency of ok results (bar p50, tick p99)")
    if groups:
        ax.legend(fontsize="x-small")
    else:
        ax.text(0.05, 0.9, "no ok result carried timings", color=_GREY, transform=ax.transAxes)


def _changes(ax: Any, report: Report) -> None:
    ax.axis("off")
    ax.set_title("how outcomes differ (baseline -> candidate)", loc="left")
    changes = sorted(report.status["changes"].items(), key=lambda kv: -kv[1])
    if not changes:
        ax.text(0, 0.9, "every joined pair has the same outcome", color=_PASS)
    for i, (change, n) in enumerate(changes[:10]):
        ax.text(0, 0.9 - i * 0.08, f"{n:>7}  {change}", family="monospace", fontsize=9)
