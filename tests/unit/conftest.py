"""The unit tier's guard: unit tests do no I/O, by construction.

Every unit test runs with INET socket connect/bind, process starts (``subprocess``, ``os.fork``,
``os.system``, ``os.posix_spawn``) and gRPC server/channel creation replaced by a function that
raises :class:`UnitTierIOError`. A test that needs any of them belongs in ``tests/component``.

AF_UNIX sockets stay allowed: asyncio's event loop wakes itself through a Unix socketpair.
gRPC channels are refused as well as servers because gRPC's C core opens its sockets below the
Python ``socket`` module, where the socket guard cannot see them.

Product code may catch the error (a reconnect loop that logs ``Exception`` and retries), so the
guard also records each refusal and fails the test at teardown: a swallowed refusal still fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import grpc.aio
import pytest

_MOVE = "unit tests do no I/O: move this test to tests/component"
_INET = (socket.AF_INET, socket.AF_INET6)


class UnitTierIOError(RuntimeError):
    """Raised when a unit test tries to open a network socket, start a process or a gRPC server.

    Not an OSError on purpose: code that retries on connection errors must not absorb it."""


@pytest.fixture(autouse=True)
def _no_io(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Yields the list of refusals (the guard's own tests clear it after checking it)."""
    refused: list[str] = []

    def refuse(what: str) -> UnitTierIOError:
        refused.append(what)
        return UnitTierIOError(f"{_MOVE} ({what})")

    def socket_guard(name: str) -> Callable[..., Any]:
        original = getattr(socket.socket, name)

        def guarded(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
            if self.family in _INET:
                raise refuse(f"socket.{name}{args!r}")
            return original(self, *args, **kwargs)

        return guarded

    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, socket_guard(name))

    def blocked(what: str) -> Callable[..., Any]:
        def guarded(*_args: Any, **_kwargs: Any) -> Any:
            raise refuse(what)

        return guarded

    # _execute_child is where every Popen (and asyncio.create_subprocess_*) forks/spawns.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", blocked("subprocess start"))
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, blocked(f"os.{name}"))
    for module, name in (
        (grpc, "server"),
        (grpc.aio, "server"),
        (grpc, "insecure_channel"),
        (grpc, "secure_channel"),
        (grpc.aio, "insecure_channel"),
        (grpc.aio, "secure_channel"),
    ):
        monkeypatch.setattr(module, name, blocked(f"{module.__name__}.{name}"))

    yield refused
    if refused:
        pytest.fail(f"{_MOVE}; refused: {', '.join(refused)}", pytrace=False)
