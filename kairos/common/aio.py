"""asyncio helpers shared by the long-running services."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task[object], poll_s: float = 0.1) -> None:
    """Cancel ``task`` and return once it has ended.

    Python 3.11's ``asyncio.wait_for`` (used inside redis-py and aiohttp) can swallow a
    cancellation that lands just as the awaited call completes, and the task then runs on. So
    cancel again until the task is done, instead of trusting one ``cancel()``.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=poll_s)
    with contextlib.suppress(asyncio.CancelledError):
        await task
