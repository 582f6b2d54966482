"""A benchmark's summary: printed as JSON, and written to ``--json`` when given."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def emit(summary: Mapping[str, Any], json_path: str | None) -> None:
    text = json.dumps(summary, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
