"""Every process a test's child starts, however deep, so that the test can check that none
outlives it: :class:`Descendants` polls /proc on a thread of its own while the child runs, so a
grandchild that its parent left behind (re-parented to init) is still known by then."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True)
class Process:
    pid: int
    start_ticks: int  # /proc/PID/stat's starttime: a reused pid has another
    args: str


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, starttime) of a live process, else None."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ", whose comm may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def _args(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> set[Process]:
    """The live descendants of ``root`` now (not ``root`` itself)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[1], []).append((int(entry.name), stat[2]))
    found: set[Process] = set()
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), ()):
            # No command line: a zombie, or one that ended between the two reads. It has exited,
            # so there is nothing of it to check (it is recorded, if at all, while it runs).
            if args := _args(pid):
                found.add(Process(pid, start, args))
            todo.append(pid)
    return found


def alive(process: Process) -> bool:
    """Still running (a zombie has exited: its parent has yet to reap it)."""
    stat = _stat(process.pid)
    return stat is not None and stat[2] == process.start_ticks and stat[0] != "Z"


class Descendants:
    """Records every descendant of ``root`` seen while it runs, every ``interval_s``."""

    def __init__(self, root: int, interval_s: float = 0.1) -> None:
        self.root = root
        self.seen: set[Process] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, args=(interval_s,), daemon=True)
        self._thread.start()

    def _poll(self, interval_s: float) -> None:
        while _stat(self.root) is not None and not self._stop.is_set():
            found = descendants(self.root)
            with self._lock:
                self.seen |= found
            self._stop.wait(interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def processes(self) -> list[Process]:
        """Every descendant seen so far."""
        with self._lock:
            return sorted(self.seen, key=lambda p: p.pid)

    def left(self) -> list[Process]:
        """Those seen that still run."""
        return [p for p in self.processes() if alive(p)]
