"""Wall times a test tier reports at the end of the run (printed by tests/conftest.py)."""

from __future__ import annotations

RECORDED: list[tuple[str, float]] = []


def record(label: str, seconds: float) -> None:
    RECORDED.append((label, seconds))
