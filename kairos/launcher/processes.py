"""Starting, watching and stopping the processes of a local cluster (tests, ``kairos up``).

Each process runs in its own process group with its output in a log file, is considered up
once its readiness probe passes, and is stopped with SIGTERM, then SIGKILL after a grace
period, so nothing outlives the cluster that started it. :class:`Supervisor` restarts the
children that exit, as a process supervisor does (``kairos up``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
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


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PLANNED_PORTS_FLOOR = 15_000  # below the usual ephemeral range (32768-60999), above the well-known services
# A port reserved host-wide = an abstract Unix socket of this name bound (Linux).
_RESERVATION_NAME = "\0kairos-port-reservation-{port}"
_handed_out: set[int] = set()  # this process's ports: never the same one twice
_pick = random.Random()
_picking = threading.Lock()  # threads of one process pick one at a time
_reservations: list[socket.socket] = []  # kept open for the process's life: closing one frees its port


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (Linux; 32768 where it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _reserve(port: int) -> bool:
    """Reserve ``port`` host-wide for this process; False if another process holds it."""
    if sys.platform != "linux":
        return True  # no abstract sockets: this process's own bookkeeping is all there is
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        holder.bind(_RESERVATION_NAME.format(port=port))
    except OSError as exc:
        holder.close()
        # EADDRINUSE: another process picked it and still runs. Any other error: abstract
        # sockets are refused here (a sandbox), and there is nothing to hold.
        return exc.errno != errno.EADDRINUSE
    _reservations.append(holder)
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server that binds it a little later, chosen below the kernel's
    ephemeral range: there no outgoing connection's local port and no other program's port-0
    bind (vLLM picks its internal ports so) can take it in between. A real vLLM node's NIXL
    listener lost its port that way, in the middle of a CI run. Falls back to the kernel's own
    choice when the range leaves no room below it.

    The port is also reserved host-wide until this process exits, so that two processes picking
    at once (test sessions side by side, a benchmark beside a test run, ``kairos up`` beside the
    test that started it) never hand out the same one: this process binds an abstract Unix
    socket named after the port (Linux's abstract namespace, per network namespace as the ports
    are). The kernel drops it when the process exits, however it exits (SIGKILL too), and it is
    no file: nothing is left behind in the temp folder or anywhere else (a lock file there was,
    and ``kairos up`` promises to leave nothing). The socket is not inherited: a child started
    with the port does not hold it, its parent does."""
    with _picking:
        low = _ephemeral_low()
        if low - _PLANNED_PORTS_FLOOR >= 1000:
            for _ in range(200):
                port = _pick.randrange(_PLANNED_PORTS_FLOOR, low)
                if port not in _handed_out and _bindable(host, port) and _reserve(port):
                    _handed_out.add(port)
                    return port
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out and _reserve(port):
                _handed_out.add(port)
                return port
    raise ProcessError(f"no free port on {host}: every one tried is in use or reserved by another process")


def ensure_port_free(host: str, port: int, what: str) -> None:
    """Raise :class:`ProcessError` when something listens on ``host:port`` already. Envoy binds
    its listener with SO_REUSEPORT, so a second gateway on a taken port would start and silently
    share the traffic with the first: refuse before starting anything instead."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no owner
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ProcessError(f"{what} cannot listen on {host}:{port}: {exc.strerror}") from None
            raise ProcessError(
                f"{what} port {port} on {host} is in use: another kairos up or gateway is running there; "
                "stop it or pick another port"
            ) from None


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


@dataclass(frozen=True)
class RestartPolicy:
    """How :class:`Supervisor` restarts a child that exited."""

    backoff_s: float = 0.5  # delay before the first restart; doubled for each recent exit
    max_backoff_s: float = 8.0
    # A crash loop: this many exits within ``window_s`` and the child is given up (only it).
    max_exits: int = 5
    window_s: float = 60.0


@dataclass
class _Watch:
    exits: deque[float] = field(default_factory=deque)  # monotonic times of its recent exits
    restart_at: float | None = None  # when it is due to start again, while it waits
    given_up: bool = False


@dataclass
class Supervisor:
    """Keeps every child of ``group`` running: :meth:`check`, called every fraction of a second,
    notices a child that exited, says so, and starts it again with the same command line after
    an exponential backoff. A child that exits ``max_exits`` times within ``window_s`` is given
    up, loudly, and the others keep running. Restarts do not wait for readiness: the rest of the
    cluster routes around the child (heartbeats, health checks) until it is back."""

    group: ProcessGroup
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    say: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    clock: Callable[[], float] = time.monotonic
    _watch: dict[int, _Watch] = field(default_factory=dict)

    def check(self) -> None:
        now = self.clock()
        for proc in list(self.group.procs):
            watch = self._watch.setdefault(id(proc), _Watch())
            if watch.given_up or proc.alive():
                continue
            if watch.restart_at is None:
                self._exited(proc, watch, now)
            elif now >= watch.restart_at:
                watch.restart_at = None
                try:
                    proc.start()
                except OSError as exc:  # cannot even spawn it: counts as one more exit
                    self.say(f"cannot restart {proc.name}: {exc}")
                    self._exited(proc, watch, now)
                    continue
                self.say(f"{proc.name} restarted (pid {proc.pid})")

    def given_up(self) -> list[str]:
        return [p.name for p in self.group.procs if self._watch.get(id(p), _Watch()).given_up]

    def _exited(self, proc: ManagedProcess, watch: _Watch, now: float) -> None:
        p = self.policy
        watch.exits.append(now)
        while watch.exits and watch.exits[0] < now - p.window_s:
            watch.exits.popleft()
        code = proc.proc.returncode if proc.proc is not None else None
        if len(watch.exits) >= p.max_exits:
            watch.given_up = True
            self.say(
                f"{proc.name} exited with {code}, {len(watch.exits)} times in {p.window_s:g} s: a crash "
                f"loop; giving up on it (the rest of the cluster keeps serving). Its log: {proc.log_path}\n"
                f"{proc.tail(5)}"
            )
            return
        delay = min(p.max_backoff_s, p.backoff_s * 2 ** (len(watch.exits) - 1))
        watch.restart_at = now + delay
        self.say(
            f"{proc.name} exited with {code}; restarting it in {delay:g} s "
            f"(exit {len(watch.exits)} of {p.max_exits} allowed in {p.window_s:g} s; log {proc.log_path})"
        )
