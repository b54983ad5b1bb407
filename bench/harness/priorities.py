"""The "fair" harness: the processes that stand for other machines (GPU hosts, Redis, the client)
above the gateway on shared cores, and the CPU seconds each process used."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

FAIR_NICE_GAP = 10  # nice steps between the stand-ins (and the load generator) and the gateway


def harness_name(gateway_nice: int) -> str:
    return "fair" if gateway_nice > 0 else "shared"


class Priorities:
    """CPU priorities of the stand-ins for other machines (bench/live/scale.py: the publishers, Redis
    and the upstream; bench/live/replay.py: the emulated nodes, their agents and Redis) and of this
    process (the load generator), above the gateway (Envoy, the dispatchers). Nice steps alone do not
    keep them from waiting for the gateway's CPUs on this kernel (6.18, EEVDF: a nice -10 process
    woke 48-51 ms late at p99 beside six busy loops on 2 cores), so where allowed (root) they also
    run SCHED_RR, which always runs before any normal process and is bounded by the kernel's
    real-time throttling (95% of each second): they use a few percent of a core each. Not this
    process: it starts the gateway, which must not inherit a real-time policy."""

    def __init__(self, stand_ins: list[int], label: str) -> None:
        self.started = stand_ins  # the processes this benchmark started that stand for other machines
        self.label = label  # what they are, for the record
        self.stand_ins = [0, *stand_ins]  # 0: this process (its main thread, the load generator's)
        self.base = os.getpriority(os.PRIO_PROCESS, 0)

    def _set(self, nice: int) -> None:
        for pid in self.stand_ins:
            with contextlib.suppress(ProcessLookupError):  # one that died is reported by its own check
                os.setpriority(os.PRIO_PROCESS, pid, nice)

    def _set_policy(self, policy: int, priority: int) -> None:
        for pid in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(pid, policy, os.sched_param(priority))

    def open_gap(self, gap: int) -> str:
        """Raise the stand-ins ``gap`` nice steps, and to SCHED_RR, as far as allowed; what they
        run at. A gateway already running keeps its priority; one started after this from this
        process needs ``nice -n gap`` to get it back (it inherits this process's nice value)."""
        try:
            self._set(max(-20, self.base - gap))
        except PermissionError:
            self._set(self.base)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        if gap <= 0:
            return f"nice {nice}"
        try:
            self._set_policy(os.SCHED_RR | os.SCHED_RESET_ON_FORK, 1)
        except PermissionError:
            return f"nice {nice}"
        return f"nice {nice}; {self.label} SCHED_RR"

    def close_gap(self) -> None:
        self._set_policy(os.SCHED_OTHER, 0)
        self._set(self.base)


class CpuMeter:
    """CPU seconds of named processes (all their threads) and of the whole machine."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")

    def _proc(self, pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime

    def _machine(self) -> tuple[float, float]:
        """(busy, total) CPU seconds of all cores since boot."""
        try:
            values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except OSError:
            return float("nan"), float("nan")
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        total = sum(values[:8])  # guest time is already inside user/nice
        return (total - idle) / self.tick, total / self.tick

    def snapshot(self) -> dict[str, float]:
        busy, total = self._machine()
        return {**{name: self._proc(pid) for name, pid in self.pids.items()}, "machine_busy": busy, "machine": total}

    @staticmethod
    def cores_used(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
        """Average cores each process used over ``wall_s``; ``machine_busy`` counts every process,
        other people's included; ``other`` is the machine's busy cores not in the named ones."""
        used = {k: round((after[k] - before[k]) / wall_s, 3) for k in before if k != "machine"}
        named = sum(v for k, v in used.items() if k != "machine_busy")
        used["other"] = round(used["machine_busy"] - named, 3)
        return used
