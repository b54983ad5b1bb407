"""`kairos up` without --workdir runs in a temporary folder of its own and removes it however it
ends: Ctrl-C, SIGHUP (the terminal closed), SIGTERM while it is still starting, a start-up
failure, a bad setting. Each run gets a TMPDIR of its own, which must be empty afterwards, and
no process it started may outlive it. (SIGTERM once it serves: tests/e2e/test_installed_wheel.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kairos.launcher.processes import free_port
from tests.e2e.test_up import Output
from tests.process_tree import Descendants
from tests.waiting import wait_until

KAIROS = (sys.executable, "-m", "kairos.launcher.cli")


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp)}


def _up(tmp: Path, *args: str) -> subprocess.Popen[str]:
    """`kairos up ARGS` in its own process group (a shell job's: what Ctrl-C signals)."""
    return subprocess.Popen(
        [*KAIROS, "up", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(tmp),
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str], tree: Descendants) -> None:
    """After a failed assertion too: SIGTERM, SIGKILL if it hangs; then no process of it is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    tree.stop()
    try:
        wait_until(lambda: not tree.left(), what="no process of `kairos up` left")
    except AssertionError:
        assert tree.left() == [], "processes `kairos up` started outlived it"


def _ctrl_c(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def _hang_up(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGHUP)


@pytest.mark.parametrize("stop", [pytest.param(_ctrl_c, id="Ctrl-C"), pytest.param(_hang_up, id="SIGHUP")])
def test_a_serving_cluster_stopped_leaves_no_temporary_folder(
    tmp_path: Path, model_dir: Path, stop: Callable[[subprocess.Popen[str]], None]
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _up(tmp, "--port", str(free_port()), "--model-dir", str(model_dir), "--time-scale", "5")
    tree = Descendants(proc.pid)
    out = Output(proc)
    try:
        out.until("Ctrl-C stops everything", 120)
        (folder,) = tmp.iterdir()
        assert folder.name.startswith("kairos-up-")
        assert f"logs in {folder / 'logs'}" in "".join(out.lines)
        assert (folder / "prometheus-targets.json").is_file() and (folder / "logs").is_dir()
        assert tree.processes(), "the cluster's processes run while it serves"
        stop(proc)
        assert proc.wait(timeout=60) == 0
    finally:
        _finish(proc, tree)
    assert list(tmp.iterdir()) == []
    assert f"removed {folder}" in out.until("removed ", 10)


def test_sigterm_while_starting_leaves_no_temporary_folder(tmp_path: Path, model_dir: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _up(tmp, "--port", str(free_port()), "--model-dir", str(model_dir), "--time-scale", "5")
    tree = Descendants(proc.pid)
    out = Output(proc)
    try:
        out.until("starting 2P2D", 60)
        assert len(list(tmp.iterdir())) == 1
        proc.send_signal(signal.SIGTERM)
        # It finishes starting what it started, then stops it all: 130, as for an interrupted start.
        assert proc.wait(timeout=180) == 130
    finally:
        _finish(proc, tree)
    assert list(tmp.iterdir()) == []
    assert "Kairos gateway ready" not in "".join(out.lines)


@pytest.mark.parametrize("failure", ["port in use", "no vLLM environment"])
def test_a_failed_start_leaves_no_temporary_folder(tmp_path: Path, model_dir: Path, failure: str) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = {
            "port in use": ["--port", str(port)],
            "no vLLM environment": ["--backend", "vllm", "--vllm-python", str(tmp_path / "none" / "python")],
        }[failure]
        proc = subprocess.run(
            [*KAIROS, "up", "--model-dir", str(model_dir), *args],
            capture_output=True,
            text=True,
            env=_env(tmp),
            timeout=120,
        )
    expected = {
        "port in use": (1, f"the gateway port {port} on 127.0.0.1 is in use"),
        "no vLLM environment": (2, f"no vLLM environment at {tmp_path / 'none' / 'python'}"),
    }[failure]
    assert (proc.returncode, expected[1] in proc.stderr) == (expected[0], True), proc.stderr
    assert list(tmp.iterdir()) == []
    assert "removed " in proc.stdout
