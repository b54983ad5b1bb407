from __future__ import annotations

import asyncio

import pytest

from kairos.common.runtime import run


def test_run_uses_uvloop_where_it_is_installed() -> None:
    pytest.importorskip("uvloop")

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_module()).startswith("uvloop")
