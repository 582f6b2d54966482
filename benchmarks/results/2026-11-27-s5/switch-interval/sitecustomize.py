"""The worker's GIL switch interval from ``SWITCH_INTERVAL`` (seconds; Python's
default 0.005). Put this folder on the worker's PYTHONPATH. Benchmark code."""

import os
import sys

sys.setswitchinterval(float(os.environ.get("SWITCH_INTERVAL", "0.005")))
