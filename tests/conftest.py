"""Suite-wide fixtures and hooks: the ``redis`` fixture (a real redis-server) and the wall times
that tiers recorded (tests/timings.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import timings
from tests.redis_server import RedisServer


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A started :class:`RedisServer` on a free loopback port, closed after the test.

    A test may stop() and start() it (an outage); it comes back on the same port, empty."""
    with RedisServer() as server:
        yield server


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not timings.RECORDED:
        return
    terminalreporter.section("tier timings")
    for label, seconds in timings.RECORDED:
        terminalreporter.write_line(f"{label}: {seconds:.1f} s")
