"""free_port: ports for servers that bind them a moment later, out of the kernel's own way."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kairos.launcher import processes
from kairos.launcher.processes import free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low = processes._ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(processes._PLANNED_PORTS_FLOOR <= p < low for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[0]))  # free: a server can take it


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        # Every pick lands on the busy port first, then on the next one up.
        picks = iter([busy, busy + 1])
        monkeypatch.setattr(processes._pick, "randrange", lambda lo, hi: next(picks))
        monkeypatch.setattr(processes, "_PLANNED_PORTS_FLOOR", 1024)
        monkeypatch.setattr(processes, "_ephemeral_low", lambda: 65_000)
        monkeypatch.setattr(processes, "_handed_out", set())
        assert free_port() == busy + 1


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    kernels_low = processes._ephemeral_low()
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("15500\t60999\n")  # under 1,000 ports below it
    monkeypatch.setattr(processes, "_EPHEMERAL_RANGE", narrow)
    assert processes._ephemeral_low() == 15_500
    assert free_port() >= kernels_low  # the kernel's pick (its real range), not one below it
    monkeypatch.setattr(processes, "_EPHEMERAL_RANGE", tmp_path / "missing")
    assert processes._ephemeral_low() == 32768
