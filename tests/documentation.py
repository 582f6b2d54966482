"""The documentation as users read it: README.md and the hand-written pages of
docs/ (the generated reference pages excluded), for the tests that hold it to
the code (examples that must run, tables that must match what the tools do)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Written at build time from the code (docs/hooks/): not documentation to check.
GENERATED = {"reference/configuration.md", "reference/metrics.md", "reference/cli.md",
             "reference/example-config.md", "benchmarks.md"}  # fmt: skip


def pages() -> list[Path]:
    docs = ROOT / "docs"
    written = sorted(p for p in docs.rglob("*.md")
                     if str(p.relative_to(docs)) not in GENERATED)  # fmt: skip
    return [ROOT / "README.md", *written]


def documentation() -> str:
    """Every page's text, one after another."""
    return "\n\n".join(p.read_text() for p in pages())
