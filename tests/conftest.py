"""Suite-wide hooks: print the wall times that tiers recorded (tests/timings.py)."""

from __future__ import annotations

import pytest

from tests import timings


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not timings.RECORDED:
        return
    terminalreporter.section("tier timings")
    for label, seconds in timings.RECORDED:
        terminalreporter.write_line(f"{label}: {seconds:.1f} s")
