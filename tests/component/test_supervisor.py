"""``kairos up``'s supervisor on real child processes: a killed child comes back with the same
command line, a crash loop gives up on that child alone, and a taken port is refused."""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kairos.launcher.processes import (
    ManagedProcess,
    ProcessError,
    ProcessGroup,
    RestartPolicy,
    Supervisor,
    ensure_port_free,
)
from tests.waiting import wait_until

FAST = RestartPolicy(backoff_s=0.01, max_backoff_s=0.05, max_exits=3, window_s=60.0)


@pytest.fixture
def group() -> Iterator[ProcessGroup]:
    g = ProcessGroup()
    yield g
    g.stop_all()


def _python(tmp_path: Path, name: str, code: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def test_a_killed_child_is_restarted_with_the_same_command_line(group: ProcessGroup, tmp_path: Path) -> None:
    said: list[str] = []
    child = group.start(_python(tmp_path, "sleeper", "import time; print('up', flush=True); time.sleep(600)"))
    first = child.pid
    log = tmp_path / "sleeper.log"
    wait_until(lambda: log.read_text() == "up\n", what="the first run's output")
    supervisor = Supervisor(group, FAST, say=said.append)
    supervisor.check()
    assert said == []  # nothing to do while everyone runs
    child.kill()
    wait_until(lambda: (supervisor.check(), child.alive())[1], what="the child running again")
    assert child.pid != first
    assert said[0].startswith(f"sleeper exited with {-signal.SIGKILL}; restarting it in 0.01 s"), said
    assert said[1] == f"sleeper restarted (pid {child.pid})"
    wait_until(lambda: log.read_text() == "up\nup\n", what="the second run's output after the first's")
    assert supervisor.given_up() == []


def test_a_crash_loop_gives_up_on_that_child_only(group: ProcessGroup, tmp_path: Path) -> None:
    said: list[str] = []
    steady = group.start(_python(tmp_path, "steady", "import time; time.sleep(600)"))
    crasher = _python(tmp_path, "crasher", "import sys; print('broken config', flush=True); sys.exit(3)")
    group.procs.append(crasher)
    crasher.start()
    supervisor = Supervisor(group, FAST, say=said.append)
    wait_until(lambda: (supervisor.check(), supervisor.given_up())[1] == ["crasher"], what="the crasher given up")
    assert [line.split(";")[0] for line in said if "restarting" in line] == ["crasher exited with 3"] * 2
    assert "crasher exited with 3, 3 times in 60 s: a crash loop; giving up on it" in said[-1]
    assert "broken config" in said[-1]  # the end of its log, where the reason is
    starts = sum(1 for line in said if "restarted" in line)
    for _ in range(5):  # given up means left alone
        supervisor.check()
    assert sum(1 for line in said if "restarted" in line) == starts == 2
    assert steady.alive()


def test_a_port_something_listens_on_is_refused_with_what_it_was_for() -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as Envoy binds its listener
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ProcessError, match=f"the gateway port {port} on 127.0.0.1 is in use"):
            ensure_port_free("127.0.0.1", port, "the gateway")
    ensure_port_free("127.0.0.1", port, "the gateway")  # closed: free again
