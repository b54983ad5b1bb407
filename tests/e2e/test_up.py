"""`kairos up` as a user runs it: the printed curl line works, and SIGTERM or Ctrl-C leaves nothing behind."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

import redis
from kairos.extproc.config import SOURCE as DISPATCHER
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig
from kairos.launcher.processes import free_port
from kairos.launcher.redis_setup import RedisSetup
from tests.waiting import wait_until

KAIROS = (sys.executable, "-m", "kairos.launcher.cli")  # the `kairos` command of this interpreter


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


def _kairos_up(*args: str, new_session: bool = False) -> subprocess.Popen[str]:
    """`kairos up ARGS` with its output on a pipe; ``new_session``: its own process group, as a
    shell job has (what Ctrl-C signals)."""
    return subprocess.Popen(
        [*KAIROS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


@pytest.mark.parametrize(
    "stop",
    [pytest.param(lambda proc: proc.send_signal(signal.SIGTERM), id="SIGTERM"), pytest.param(_ctrl_c, id="Ctrl-C")],
)
def test_kairos_up_serves_the_printed_curl_line_and_stops_cleanly(
    tmp_path: Path, model_dir: Path, stop: Callable[[subprocess.Popen[str]], None]
) -> None:
    port = free_port()
    workdir = tmp_path / "up"
    proc = _kairos_up(
        "--log-level", "debug", "up", "--port", str(port), "--workdir", str(workdir),
        "--model-dir", str(model_dir), "--time-scale", "5", new_session=True,
    )  # fmt: skip
    out = Output(proc)
    try:
        curl = out.until("curl ", 90).strip()
        assert f"127.0.0.1:{port}" in curl
        result = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=30, check=True)
        assert "HTTP/1.1 200" in result.stdout and '"completion_tokens":16' in result.stdout
        # The printed `kairos top` line shows the cluster; the Prometheus targets file lists its dispatcher.
        watch = shlex.split(out.until("kairos top --dispatcher", 30).split(":", 1)[1])
        assert watch[:2] == ["kairos", "top"]
        shown = subprocess.run(
            [sys.executable, "-m", "kairos", *watch[1:], "--iterations", "1", "--plain"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert [line.split()[:2] for line in shown.splitlines() if line[:2] in ("p0", "p1", "d0", "d1")] == [
            ["d0", "decode"],
            ["d1", "decode"],
            ["p0", "prefill"],
            ["p1", "prefill"],
        ], shown
        targets = (workdir / "prometheus-targets.json").read_text()
        assert watch[-1].removeprefix("http://") in targets
        # --log-level reaches every process: the dispatcher's decision line, the sidecar's timing line.
        logs = workdir / "logs"
        assert "DEBUG kairos.extproc.dispatcher: request " in (logs / "dispatcher0.log").read_text()
        assert any(" path=" in f.read_text() for f in logs.glob("d*-sidecar.log"))

        ours = [a for a in _processes() if str(workdir) in a or str(model_dir) in a]
        assert ours, "the cluster's processes should be visible while it runs"
        # Redis requires a credential, and none is on any command line that ps shows.
        redis_line = next(line for line in out.lines if line.startswith("Redis at "))
        port = int(re.search(r"redis://127\.0\.0\.1:(\d+)/0", redis_line).group(1))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=10).ping()
        setup = RedisSetup.load(workdir / "redis")
        assert redis.Redis.from_url(setup.admin_url, socket_timeout=10).ping()
        assert not [a for a in _processes() if any(pw in a for pw in setup.passwords.values())]

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


class Output:
    """A process's stdout, read on a thread of its own: a wait for a line keeps its timeout even
    while the process prints nothing (a blocking readline would wait for as long as it is silent)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.lines: list[str] = []  # what the waits have read so far
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            self._queue.put(line)
        self._queue.put(None)  # end of output

    def until(self, marker: str, timeout_s: float) -> str:
        """The first line from here on that holds ``marker``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)  # the end stays the end for the next wait
                break
            self.lines.append(line)
            if marker in line:
                return line
        raise AssertionError(f"no {marker!r} within {timeout_s:g} s in:\n{''.join(self.lines)}")


def test_kairos_up_with_a_nodes_file_fronts_nodes_started_elsewhere(tmp_path: Path, model_dir: Path) -> None:
    """The gateway alone (Redis, dispatcher, Envoy) for nodes whose agents run on their own: the
    nodes' publishers report to its Redis with the credentials it wrote for each node (what the
    README's remote-node recipe copies to each node) and requests reach their sidecar."""
    redis_port, port = free_port(), free_port()
    elsewhere = LocalCluster(
        LocalClusterConfig(
            prefill_nodes=1, decode_nodes=1, model_dir=str(model_dir), time_scale=5, redis_port=redis_port
        ),
        tmp_path / "nodes",
    )
    elsewhere.model_dir, elsewhere.redis_port = model_dir, redis_port
    elsewhere.gateway_port = port  # the sidecars fan batches out through the gateway (--gateway)
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
    proc = _kairos_up(
        "up", "--nodes", str(nodes_file), "--port", str(port), "--redis-port", str(redis_port),
        "--workdir", str(tmp_path / "up"), "--model-dir", str(model_dir),
    )  # fmt: skip
    out = Output(proc)
    try:
        out.until("waiting for heartbeats from p0, d0", 60)
        printed = "".join(out.lines)
        for node in elsewhere.nodes:  # each node's credentials file, named in the output
            env_file = tmp_path / "up" / "redis" / "credentials" / f"{node.node_id}.env"
            assert f"  {node.node_id}: {env_file}" in printed
            assert f"redis://kairos-node-{node.node_id}:" in env_file.read_text()
        elsewhere.redis_setup = RedisSetup.load(tmp_path / "up" / "redis")  # what those files hold
        elsewhere.start_nodes()
        out.until("heartbeats from all 2 nodes", 60)
        curl = out.until("curl ", 30).strip()
        result = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=30, check=True)
        assert "HTTP/1.1 200" in result.stdout and '"completion_tokens":16' in result.stdout
        assert "x-kairos-decode-node: d0" in result.stdout.lower()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        _stop(proc)
        elsewhere.stop()
    assert all(n.engine is not None and not n.engine.alive() for n in elsewhere.nodes)


def _child(parent: int, *needles: str) -> tuple[int, str]:
    """The one child of ``parent`` whose command line holds every needle: its pid and arguments."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True)
    found = [
        (int(pid), args)
        for pid, ppid, args in (line.split(None, 2) for line in out.stdout.splitlines())
        if int(ppid) == parent and all(n in args for n in needles)
    ]
    assert len(found) == 1, found
    return found[0]


def test_kairos_up_restarts_a_killed_engine_keeps_serving_and_refuses_a_second_gateway_on_its_port(
    tmp_path: Path, model_dir: Path
) -> None:
    """A supervisor, not a tripwire: kill -9 of one engine takes that node out of the view, the
    launcher starts it again and the node comes back, while the gateway answers throughout; and
    a second `kairos up` on the same port refuses to start instead of sharing the port."""
    port = free_port()
    workdir = tmp_path / "up"
    proc = _kairos_up(
        "up", "--port", str(port), "--workdir", str(workdir), "--model-dir", str(model_dir),
        "--time-scale", "5", new_session=True,
    )  # fmt: skip
    out = Output(proc)
    try:
        curl = shlex.split(out.until("curl ", 90).strip())
        _, dispatcher = _child(proc.pid, "kairos.extproc")
        config_file = dispatcher.split("--config ")[1].split()[0]  # the settings kairos up gave it
        metrics_port = DISPATCHER.load(config_file, environ={}).metrics_port

        def fresh() -> set[str]:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/nodes", timeout=10) as resp:
                return {n["id"] for n in json.load(resp)["nodes"] if not n["stale"]}

        engine, _ = _child(proc.pid, "kairos.sim.emulated_vllm", "/d1-vllm.yaml")
        os.kill(engine, signal.SIGKILL)
        wait_until(lambda: "d1" not in fresh(), what="d1 leaving the dispatcher's view")
        # Meanwhile the rest serves: the request goes to d0.
        served = subprocess.run(curl, capture_output=True, text=True, timeout=30, check=True).stdout
        assert "HTTP/1.1 200" in served and '"completion_tokens":16' in served
        wait_until(lambda: fresh() == {"p0", "p1", "d0", "d1"}, timeout_s=60, what="d1 back in the view")
        restarted, _ = _child(proc.pid, "kairos.sim.emulated_vllm", "/d1-vllm.yaml")
        assert restarted != engine
        out.until("d1-vllm restarted", 10)
        assert any("d1-vllm exited with -9; restarting" in line for line in out.lines), out.lines
        assert proc.poll() is None

        second = subprocess.run(
            [*KAIROS, "up", "--port", str(port), "--workdir", str(tmp_path / "second"), "--model-dir", str(model_dir)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode != 0
        assert f"the gateway port {port} on 127.0.0.1 is in use" in second.stderr, second.stderr
        assert "HTTP/1.1 200" in subprocess.run(curl, capture_output=True, text=True, timeout=30, check=True).stdout

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        _stop(proc)
    ours = (str(workdir), str(model_dir))
    wait_until(
        lambda: not [a for a in _processes() if any(o in a for o in ours) and "pytest" not in a],
        what="no process of the cluster left",
    )
