"""``python -m worker`` and the ``infer-worker`` script: the commands are in worker/cli."""

from __future__ import annotations

import sys

from worker.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
