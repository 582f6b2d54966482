"""The cycle collector is settled for serving once started: start-up's objects
frozen out of later collections, and collections less often (the thresholds
``worker.app.collector`` documents). Run in a child process: freezing and the
thresholds are process-wide, and the test process keeps its own."""

from __future__ import annotations

import json
import subprocess
import sys

from worker.app.collector import THRESHOLDS

PROBE = """
import gc, json
before = {"thresholds": gc.get_threshold(), "frozen": gc.get_freeze_count()}
from worker.app.collector import settle_for_serving
settle_for_serving()
after = {"thresholds": gc.get_threshold(), "frozen": gc.get_freeze_count()}
print(json.dumps({"before": before, **after}))
"""


def test_start_up_objects_are_frozen_and_collections_are_rarer() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], check=True, capture_output=True, text=True, timeout=60
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"]["frozen"] == 0 and tuple(got["before"]["thresholds"]) != THRESHOLDS
    assert tuple(got["thresholds"]) == THRESHOLDS
    assert got["frozen"] > 1000  # the imported modules and what they hold
