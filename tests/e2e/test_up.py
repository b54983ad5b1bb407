"""`kairos up` as a user runs it: the printed curl line works, and SIGTERM or Ctrl-C leaves nothing behind."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig
from kairos.launcher.processes import free_port
from tests.waiting import wait_until


def _processes() -> list[str]:
    """Every live process as "pid args", untruncated."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _stop(proc: subprocess.Popen[str]) -> None:
    """After a failed assertion: SIGTERM, so `kairos up` stops its cluster; SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _ctrl_c(proc: subprocess.Popen[str]) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)


@pytest.mark.parametrize(
    "stop",
    [pytest.param(lambda proc: proc.send_signal(signal.SIGTERM), id="SIGTERM"), pytest.param(_ctrl_c, id="Ctrl-C")],
)
def test_kairos_up_serves_the_printed_curl_line_and_stops_cleanly(
    tmp_path: Path, model_dir: Path, stop: Callable[[subprocess.Popen[str]], None]
) -> None:
    port = free_port()
    workdir = tmp_path / "up"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kairos.launcher.cli", "--log-level", "debug", "up", "--port", str(port),
         "--workdir", str(workdir), "--model-dir", str(model_dir), "--time-scale", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, as a shell job has
    )
    lines: list[str] = []
    try:
        curl = _read_until(proc, lines, "curl ", 90).strip()
        assert f"127.0.0.1:{port}" in curl
        result = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=30, check=True)
        assert "HTTP/1.1 200" in result.stdout and '"completion_tokens":16' in result.stdout
        # The printed `kairos top` line shows the cluster; the Prometheus targets file lists its dispatcher.
        watch = shlex.split(_read_until(proc, lines, "kairos top --dispatcher", 30).split(":", 1)[1])
        assert watch[:2] == ["kairos", "top"]
        shown = subprocess.run([sys.executable, "-m", "kairos", *watch[1:], "--iterations", "1", "--plain"],
                               capture_output=True, text=True, timeout=60, check=True).stdout
        assert [line.split()[:2] for line in shown.splitlines() if line[:2] in ("p0", "p1", "d0", "d1")] == [
            ["d0", "decode"], ["d1", "decode"], ["p0", "prefill"], ["p1", "prefill"]], shown
        targets = (workdir / "prometheus-targets.json").read_text()
        assert watch[-1].removeprefix("http://") in targets
        # --log-level reaches every process: the dispatcher's decision line, the sidecar's timing line.
        logs = workdir / "logs"
        assert "DEBUG kairos.extproc.dispatcher: request " in (logs / "dispatcher0.log").read_text()
        assert any(" path=" in f.read_text() for f in logs.glob("d*-sidecar.log"))

        ours = [a for a in _processes() if str(workdir) in a or str(model_dir) in a]
        assert ours, "the cluster's processes should be visible while it runs"

        stop(proc)
        assert proc.wait(timeout=30) == 0
    finally:
        _stop(proc)

    def left() -> list[str]:
        return [a for a in _processes() if str(workdir) in a or (str(model_dir) in a and "pytest" not in a)]

    # `kairos up` exited 0 after stopping its cluster; a child may still be going away for a moment.
    try:
        wait_until(lambda: not left(), what="no process of the cluster left")
    except AssertionError:
        assert left() == [], left()
    assert os.path.exists(workdir / "logs")


def _read_until(proc: subprocess.Popen[str], lines: list[str], marker: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if marker in line:
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {marker!r} in:\n{''.join(lines)}")


def test_kairos_up_with_a_nodes_file_fronts_nodes_started_elsewhere(tmp_path: Path, model_dir: Path) -> None:
    """The gateway alone (Redis, dispatcher, Envoy) for nodes whose agents run on their own: the
    nodes' publishers report to its Redis and requests reach their sidecar."""
    redis_port, port = free_port(), free_port()
    elsewhere = LocalCluster(
        LocalClusterConfig(
            prefill_nodes=1, decode_nodes=1, model_dir=str(model_dir), time_scale=5, redis_port=redis_port
        ),
        tmp_path / "nodes",
    )
    elsewhere.model_dir, elsewhere.redis_port = model_dir, redis_port
    elsewhere.nodes = elsewhere.plan_nodes()
    nodes_file = tmp_path / "nodes.yaml"
    nodes_file.write_text(
        "prefill:\n"
        + "".join(f"  - {{id: {n.node_id}, url: '{n.url}'}}\n" for n in elsewhere.nodes if n.role == "prefill")
        + "decode:\n"
        + "".join(
            f"  - {{id: {n.node_id}, url: '{n.url}', sidecar: '{n.sidecar_url}'}}\n"
            for n in elsewhere.nodes
            if n.role == "decode"
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kairos.launcher.cli", "up", "--nodes", str(nodes_file), "--port", str(port),
         "--redis-port", str(redis_port), "--workdir", str(tmp_path / "up"), "--model-dir", str(model_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    try:
        _read_until(proc, lines, "waiting for heartbeats from p0, d0", 60)
        elsewhere.start_nodes()
        _read_until(proc, lines, "heartbeats from all 2 nodes", 60)
        curl = _read_until(proc, lines, "curl ", 30).strip()
        result = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=30, check=True)
        assert "HTTP/1.1 200" in result.stdout and '"completion_tokens":16' in result.stdout
        assert "x-kairos-decode-node: d0" in result.stdout.lower()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        _stop(proc)
        elsewhere.stop()
    assert all(n.engine is not None and not n.engine.alive() for n in elsewhere.nodes)
