"""bench/harness/priorities.py's ``Priorities``, the "fair" harness of bench/live/scale.py and
bench/live/replay.py: the stand-ins for other machines go above the gateway and come back down,
and a stand-in that died on the way does not stop the others from being restored."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bench.harness.priorities import Priorities


def _may_raise_priorities() -> bool:
    """Whether this process may raise a child to SCHED_RR and itself a nice step (root with
    CAP_SYS_NICE; a container may be root without it): the fair harness's two rights."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.sched_setscheduler(child.pid, os.SCHED_RR, os.sched_param(1))
        os.setpriority(os.PRIO_PROCESS, 0, base - 1)
    except PermissionError:
        return False
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, base)
        child.kill()
        child.wait()
    return True


@pytest.fixture(scope="module")
def rights() -> None:
    if not _may_raise_priorities():
        pytest.skip("raising a process's priority needs root with CAP_SYS_NICE")


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture
def own_nice() -> Iterator[int]:
    """This process's nice value, put back after the test whatever it did."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    yield base
    os.setpriority(os.PRIO_PROCESS, 0, base)


def test_the_fair_gap_raises_the_stand_ins_and_closing_it_restores_them(rights, sleepers, own_nice) -> None:
    pids = [p.pid for p in sleepers]
    priorities = Priorities(pids, "sleepers")
    said = priorities.open_gap(10)
    raised = max(-20, own_nice - 10)
    assert said == f"nice {raised}; sleepers SCHED_RR"
    assert os.getpriority(os.PRIO_PROCESS, 0) == raised  # the client
    for pid in pids:
        assert os.sched_getscheduler(pid) & ~os.SCHED_RESET_ON_FORK == os.SCHED_RR
        assert os.getpriority(os.PRIO_PROCESS, pid) == raised
    priorities.close_gap()
    assert os.getpriority(os.PRIO_PROCESS, 0) == own_nice
    for pid in pids:
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, pid) == own_nice


def test_the_shared_harness_changes_nothing(sleepers, own_nice) -> None:
    pids = [p.pid for p in sleepers]
    priorities = Priorities(pids, "sleepers")
    assert priorities.open_gap(0) == f"nice {own_nice}"
    for pid in pids:
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, pid) == own_nice
    priorities.close_gap()
    assert os.getpriority(os.PRIO_PROCESS, 0) == own_nice


def test_a_stand_in_that_died_does_not_keep_the_others_raised(rights, sleepers, own_nice) -> None:
    first, second = sleepers
    priorities = Priorities([first.pid, second.pid], "sleepers")
    priorities.open_gap(10)
    first.kill()
    first.wait()  # reaped: its pid names no process now
    priorities.close_gap()
    assert os.sched_getscheduler(second.pid) == os.SCHED_OTHER
    assert os.getpriority(os.PRIO_PROCESS, second.pid) == own_nice
