"""Process plumbing shared by the long-running components."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT. Install it before announcing "listening on": a
    supervisor may signal as soon as it reads that line."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop's event loop where uvloop is installed (a dependency on
    Linux and macOS), else on asyncio's own. uvloop halves the loop's share of a request's time
    in the aiohttp sidecar (bench/gateway_overhead.py, sidecar_pd and sidecar_deflect)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
