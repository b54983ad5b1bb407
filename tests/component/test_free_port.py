"""free_port: ports for servers that bind them a moment later, out of the kernel's own way."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kairos.launcher import processes
from kairos.launcher.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


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


# A picker in a process of its own: a window of ports so narrow that two pickers drawing at random
# from it would share about a hundred ports, unless each skips the other's reservations.
_PICKER = """
import sys
from kairos.launcher import processes
processes._PLANNED_PORTS_FLOOR = {floor}
processes._ephemeral_low = lambda: {floor} + {width}
print("ready", flush=True)
sys.stdin.readline()  # go: both pickers start together
print(" ".join(str(processes.free_port()) for _ in range({count})), flush=True)
sys.stdin.readline()  # the test read both lists: exit, which drops the reservations
"""


def test_two_processes_picking_at_once_never_share_a_port() -> None:
    floor, width, count = processes._PLANNED_PORTS_FLOOR, 1500, 500
    script = _PICKER.format(floor=floor, width=width, count=count)
    pickers = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        for _ in range(2)
    ]
    try:
        pipes = [(picker.stdin, picker.stdout) for picker in pickers]
        for _, out in pipes:
            assert out is not None and out.readline() == "ready\n"
        for into, _ in pipes:
            assert into is not None
            into.write("go\n")
            into.flush()
        # Each list is read while both pickers still run: neither has dropped its reservations,
        # whichever order the two drew in.
        picked = [[int(p) for p in out.readline().split()] for _, out in pipes if out is not None]
    finally:
        for picker in pickers:
            with contextlib.suppress(OSError):
                picker.communicate("exit\n", timeout=60)
    first, second = picked
    assert len(first) == len(second) == count
    assert all(floor <= p < floor + width for p in first + second)  # from the window, not the kernel's fallback
    assert len(set(first)) == count and len(set(second)) == count
    assert set(first).isdisjoint(second)


def test_a_port_reserved_by_another_process_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert holder.stdout is not None
        held = int(holder.stdout.readline())
        # Every pick lands on the held port first (free to bind: only reserved), then on the next one up.
        picks = iter([held, held + 1])
        monkeypatch.setattr(processes._pick, "randrange", lambda lo, hi: next(picks))
        monkeypatch.setattr(processes, "_handed_out", set())
        assert free_port() == held + 1
    finally:
        holder.communicate("exit\n", timeout=60)


_HOLDER = """
import sys
from kairos.launcher import processes
print(processes.free_port(), flush=True)
sys.stdin.readline()
"""


def test_reserving_ports_writes_nothing_to_the_temp_folder(tmp_path: Path) -> None:
    """kairos up promises to leave nothing behind: its ports' reservations are no files."""
    script = "from kairos.launcher.processes import free_port\nprint([free_port() for _ in range(20)])"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []
