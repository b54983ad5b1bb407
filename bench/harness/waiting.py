"""Waiting for a server to come up: polling a probe until it answers or the time is up."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(probe: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")
