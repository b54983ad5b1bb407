"""The unit tier's guard (tests/unit/conftest.py) refuses I/O and leaves asyncio working."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import grpc.aio
import pytest

from tests.unit.conftest import UnitTierIOError


def test_inet_connect_and_bind_are_refused(_no_io: list[str]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(UnitTierIOError, match="component"):
        s.connect(("127.0.0.1", 9))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(UnitTierIOError):
        s.bind(("127.0.0.1", 0))
    assert len(_no_io) == 2
    _no_io.clear()


def test_processes_and_grpc_servers_are_refused(_no_io: list[str]) -> None:
    with pytest.raises(UnitTierIOError):
        subprocess.run(["true"], check=False)
    with pytest.raises(UnitTierIOError):
        grpc.aio.server()
    assert len(_no_io) == 2
    _no_io.clear()


async def test_unix_socketpairs_and_the_event_loop_still_work() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"
    assert await asyncio.sleep(0, result=7) == 7
