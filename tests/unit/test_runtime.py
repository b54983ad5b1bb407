from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from kairos.common.runtime import freeze_startup_heap, run


def test_run_uses_uvloop_where_it_is_installed() -> None:
    pytest.importorskip("uvloop")

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_module()).startswith("uvloop")


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_startup_heap_collects_garbage_then_freezes_what_lives() -> None:
    kept, garbage = _Node(), _Node()
    garbage.other, garbage.other.other = _Node(), garbage  # a cycle only the collector frees
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_startup_heap()
        assert gone() is None  # collected, not frozen for good
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # out of every generation's scan
    finally:
        gc.unfreeze()
