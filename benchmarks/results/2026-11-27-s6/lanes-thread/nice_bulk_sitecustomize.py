"""Throwaway experiment (issue 39): with a lane of its own, the process of the
bulk lane runs at a lower OS priority (nice NICE_BULK)."""

import os

if os.environ.get("NICE_BULK") and os.environ.get("INFER_WORKER_KAFKA__INPUT_TOPICS", "").endswith(
    'bulk"]'
):
    os.nice(int(os.environ["NICE_BULK"]))
