"""Starting, watching and stopping the processes of a local cluster (tests, ``kairos up``).

Each process runs in its own process group with its output in a log file, is considered up
once its readiness probe passes, and is stopped with SIGTERM, then SIGKILL after a grace
period, so nothing outlives the cluster that started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kairos.common.errors import KairosError


class ProcessError(KairosError):
    code = "process_error"


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the process that started it dies,
    so a killed test run or `kairos up` leaves no orphans (their own sessions shield them from
    the terminal's signals otherwise)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):  # no prctl: orphans stay possible, nothing else
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tcp_ready(host: str, port: int) -> Callable[[], bool]:
    def probe() -> bool:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return True
        return False

    return probe


def http_ready(url: str, expect: int = 200) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                return resp.status == expect
        except (urllib.error.URLError, OSError, ValueError):
            return False

    return probe


@dataclass
class ManagedProcess:
    """One child process with a log file and a readiness probe."""

    name: str
    argv: Sequence[str]
    log_path: Path
    ready: Callable[[], bool] | None = None
    env: dict[str, str] | None = None
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})},
                cwd=self.cwd,
                start_new_session=True,  # its own process group: stop() reaches its children too
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessError(
                    f"{self.name} exited with {self.proc.returncode if self.proc else '?'}; "
                    f"last log lines:\n{self.tail()}"
                )
            if self.ready is None or self.ready():
                return
            time.sleep(0.05)
        raise ProcessError(f"{self.name} not ready after {timeout_s:.0f} s; last log lines:\n{self.tail()}")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL at once (fault-injection tests)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class ProcessGroup:
    """Processes started in order and stopped in reverse order."""

    procs: list[ManagedProcess] = field(default_factory=list)

    def start(self, proc: ManagedProcess, timeout_s: float = 30.0) -> ManagedProcess:
        self.procs.append(proc)
        proc.start()
        proc.wait_ready(timeout_s)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
