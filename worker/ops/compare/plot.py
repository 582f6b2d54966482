"""The comparison as a PNG: agreement per output, latency per stage. Needs
matplotlib (the ``bench`` extra); ``available`` says whether it is there."""

from __future__ import annotations

import importlib.util

from worker.ops.compare.report import Report
from worker.ops.compare.results import SIDES


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(report: Report, path: str) -> None:
    """Left: top-1 and top-k agreement and mean cosine similarity per output.
    Right: p50 and p99 latency per stage, each side and model a bar group.
    Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    agree, latency = fig.subplots(1, 2)
    names = sorted(report.outputs)
    metrics = (("top-1", "top1"), ("top-k", "topk"), ("mean cosine", "mean_cosine"))
    width = 0.8 / len(metrics)
    lowest = 0.0  # a mean cosine can be negative
    for i, (label, attr) in enumerate(metrics):
        values = [getattr(report.outputs[n], attr) for n in names]
        xs = [j + i * width for j, v in enumerate(values) if v is not None]
        shown = [v for v in values if v is not None]
        agree.bar(xs, shown, width, label=label)
        lowest = min([lowest, *shown])
    agree.set_xticks([j + width for j in range(len(names))], names, rotation=20, ha="right")
    agree.set_ylim(lowest - 0.05 if lowest < 0 else 0.0, 1.05)
    agree.set_title(f"agreement ({report.coverage.joined} joined)")
    agree.legend(loc="lower right")

    groups = [(side, model, stages) for side in SIDES
              for model, stages in report.latency.get(side, {}).items() if stages]  # fmt: skip
    stages = list(dict.fromkeys(s for _, _, st in groups for s in st))
    width = 0.8 / max(1, len(groups))
    for i, (side, model, st) in enumerate(groups):
        xs = [j + i * width for j, s in enumerate(stages) if s in st]
        p50 = [st[s]["p50_us"] / 1e3 for s in stages if s in st]
        p99 = [st[s]["p99_us"] / 1e3 for s in stages if s in st]
        bars = latency.bar(xs, p50, width, label=f"{side} {model[:24]} p50")
        latency.scatter(xs, p99, marker="_", s=200, color=bars.patches[0].get_facecolor(),
                        label=f"{side} p99")  # fmt: skip
    latency.set_xticks([j + 0.4 - width / 2 for j in range(len(stages))], stages)
    latency.set_ylabel("ms")
    latency.set_title("latency of ok results (bar p50, tick p99)")
    if groups:
        latency.legend(fontsize="small")
    FigureCanvasAgg(fig).print_png(path)
