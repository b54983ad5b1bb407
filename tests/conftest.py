"""Suite-wide fixtures and hooks: each test marked with its tier (its folder), the ``redis``
fixture (a real redis-server) and the wall times that tiers recorded (tests/timings.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import timings
from tests.redis_server import RedisServer

TIERS = ("unit", "component", "e2e", "compose", "integration")
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier, so ``-m unit`` works as ``tests/unit`` does; a test outside
    the tier folders is a collection error."""
    for item in items:
        path = Path(str(item.path)).resolve()
        tier = path.relative_to(_TESTS).parts[0] if path.is_relative_to(_TESTS) else None
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in a tier folder, one of tests/{{{','.join(TIERS)}}}")
        item.add_marker(tier)


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A started :class:`RedisServer` on a free loopback port, closed after the test.

    A test may stop() and start() it (an outage); it comes back on the same port, empty."""
    with RedisServer() as server:
        yield server


_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each tier's test time (setup, call and teardown), printed at the end."""
    parts = report.nodeid.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS:
        _TIER_SECONDS[parts[1]] = _TIER_SECONDS.get(parts[1], 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not timings.RECORDED and not _TIER_SECONDS:
        return
    terminalreporter.section("tier timings")
    for tier in TIERS:
        if tier in _TIER_SECONDS:
            terminalreporter.write_line(f"tests/{tier}: {_TIER_SECONDS[tier]:.1f} s in its tests")
    for label, seconds in timings.RECORDED:
        terminalreporter.write_line(f"{label}: {seconds:.1f} s")
