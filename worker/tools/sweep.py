"""Moved to the package ``worker.tools.bench`` (split by job); this module keeps
the old import path working for code written against it. New code imports from
the package. Note: patching a name here does not reach the package's users."""

from worker.tools.bench.openloop import Setting, SweepPoint, number, send_open_loop
from worker.tools.bench.recommend import (
    best_setting,
    closest_setting,
    config_lines,
    qualifying,
    recommendation_text,
)
from worker.tools.bench.sweep import SweepError, SweepOptions, check_options, run_sweep
from worker.tools.bench.sweep_report import point_line, sweep_summary, write_plot

__all__ = [
    "Setting",
    "SweepError",
    "SweepOptions",
    "SweepPoint",
    "best_setting",
    "check_options",
    "closest_setting",
    "config_lines",
    "number",
    "point_line",
    "qualifying",
    "recommendation_text",
    "run_sweep",
    "send_open_loop",
    "sweep_summary",
    "write_plot",
]
