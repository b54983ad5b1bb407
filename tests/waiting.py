"""The suite's one way to wait: poll a condition until it holds, never sleep a fixed time.

``eventually`` (async) and ``wait_until`` (blocking) call ``probe`` until it returns something
truthy and return that value; past ``timeout_s`` they fail with ``what`` in the message. Timeouts
are generous on purpose: on a starved 2-core CI host a condition can take seconds, and a test
whose point is not timing must not fail because the machine is slow.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


async def eventually(
    probe: Callable[[], Awaitable[T] | T],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "condition",
    interval_s: float = 0.005,
) -> T:
    """Call (and await) ``probe()`` every ``interval_s`` until it is truthy; return its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s (last probe: {_short(value)})")
        await asyncio.sleep(interval_s)


def wait_until(
    probe: Callable[[], T],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "condition",
    interval_s: float = 0.02,
) -> T:
    """Blocking twin of :func:`eventually`, for tests that drive servers from threads."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s (last probe: {_short(value)})")
        time.sleep(interval_s)
