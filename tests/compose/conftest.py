"""The compose tier: compose/docker-compose.yml run for real, on a Docker daemon of its own.

Needs root and Debian's docker.io, docker-compose and debootstrap (scripts/test.sh installs them);
without them the tier skips, unless KAIROS_REQUIRE_COMPOSE=1 (scripts/test.sh sets it), where it
fails. Each step's wall time is printed at the end of the run (tests/timings.py).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import timings
from tests.compose.docker_daemon import ROOT, Compose, DockerDaemon, missing_tools
from tests.waiting import wait_until

COMPOSE_DIR = ROOT / "compose"
BASE_IMAGE = "kairos-base:bookworm"
PROJECT = "kairostest"
# Every port the cluster listens on (compose/docker-compose.yml; host networking, 127.0.0.1).
PORTS = (8000, 6379, 8100, 8101, 8102, 8103, 8200, 8201, 9000, 9001, 9100, 9101, 9901)
SERVICES = (
    "redis", "p0", "p1", "d0", "d1", "d0-sidecar", "d1-sidecar", "p0-heartbeat", "p1-heartbeat",
    "d0-heartbeat", "d1-heartbeat", "dispatcher0", "dispatcher1", "envoy",
)  # fmt: skip


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the compose tier starts its own dockerd: it needs root"
    missing = missing_tools()
    if missing:
        return f"missing Debian packages: {' '.join(missing)} (scripts/test.sh installs them)"
    return None


def _step(label: str, started: float) -> None:
    timings.record(f"tests/compose: {label}", time.monotonic() - started)


@pytest.fixture(scope="session")
def docker_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerDaemon]:
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("KAIROS_REQUIRE_COMPOSE") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    started = time.monotonic()
    daemon = DockerDaemon(tmp_path_factory.mktemp("docker"))
    try:
        daemon.start()
        _step("dockerd start", started)
        yield daemon
    finally:
        processes, mounts = daemon.stop()
        assert (processes, mounts) == ([], []), "processes or mounts of the test's dockerd outlived it"
        assert (daemon.leftover_processes(), daemon.leftover_mounts()) == ([], [])


@pytest.fixture(scope="session")
def images(docker_daemon: DockerDaemon) -> None:
    """The local base image (debootstrap, cached) and the dependencies' wheels (cached)."""
    started = time.monotonic()
    env = {**docker_daemon.env, "DOCKER": "docker"}
    for script in (["bash", str(COMPOSE_DIR / "base_image.sh"), BASE_IMAGE], ["bash", str(COMPOSE_DIR / "wheels.sh")]):
        proc = subprocess.run(script, env=env, capture_output=True, text=True, timeout=1200, check=False)
        assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    _step("base image and wheels", started)


@pytest.fixture(scope="session")
def env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What compose/setup.sh writes to compose/.env, here a fresh password per run."""
    path = tmp_path_factory.mktemp("compose-env") / "env"
    path.write_text(f"KAIROS_REDIS_PASSWORD={secrets.token_hex(16)}\n")
    return path


@pytest.fixture(scope="session")
def redis_password(env_file: Path) -> str:
    return env_file.read_text().strip().partition("=")[2]


def compose_env() -> dict[str, str]:
    return {"KAIROS_BASE_IMAGE": BASE_IMAGE, "KAIROS_REDIS_IMAGE": BASE_IMAGE}


def all_healthy(compose: Compose) -> bool:
    states = compose.states()
    return all(states.get(service, {}).get("health") == "healthy" for service in SERVICES)


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.fixture(scope="session")
def cluster(docker_daemon: DockerDaemon, images: None, env_file: Path) -> Iterator[Compose]:
    """The loopback compose cluster, built and up with every service healthy; down afterwards,
    with no container, network or volume left."""
    compose = Compose(
        docker_daemon,
        [COMPOSE_DIR / "docker-compose.yml", COMPOSE_DIR / "docker-compose.loopback.yml"],
        env_file,
        PROJECT,
        compose_env(),
    )
    compose.run("down", "--volumes", "--remove-orphans", "--timeout", "5")  # a crashed run's leftovers
    busy = [port for port in PORTS if _port_in_use(port)]
    assert not busy, f"ports the compose cluster needs are taken on 127.0.0.1: {busy}"
    started = time.monotonic()
    compose.run("build", "model")  # one image for every Kairos service; the others reuse it
    _step("image build", started)
    try:
        started = time.monotonic()
        compose.run("up", "--detach", "--no-build")
        wait_until(lambda: all_healthy(compose), timeout_s=420, what="every compose service healthy", interval_s=1.0)
        _step("up until every service is healthy", started)
        yield compose
    finally:
        started = time.monotonic()
        logs = compose.run("logs", "--no-color", "--tail", "50", check=False).stdout
        (docker_daemon.folder / "compose.log").write_text(logs)
        compose.run("down", "--volumes", "--remove-orphans", "--timeout", "40")
        _step("down", started)
        assert docker_daemon.docker("ps", "-aq").stdout.strip() == "", "containers left after down"
        networks = docker_daemon.docker("network", "ls", "--format", "{{.Name}}").stdout.split()
        assert sorted(networks) == ["host", "none"], f"networks left after down: {networks}"
        assert docker_daemon.docker("volume", "ls", "-q").stdout.strip() == "", "volumes left after down"
