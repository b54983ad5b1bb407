"""A real redis-server for tests, on a free loopback port, that a test can stop and restart.

    with RedisServer() as server:          # started on a free 127.0.0.1 port
        client = redis.Redis.from_url(server.url)
        server.stop()                      # an outage, mid-test
        server.start()                     # back on the SAME port (empty: no persistence)

Each server runs in its own temporary directory with persistence off (``--save ''``,
``--appendonly no``), is stopped by its PID (SIGTERM, then SIGKILL after a grace period) and
never outlives the test: ``stop()`` runs on context exit and at interpreter exit.

Tests get a started one from the suite-wide ``redis`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import weakref
from pathlib import Path

from kairos.launcher.processes import ManagedProcess, ProcessError, free_port
from kairos.launcher.servers import redis_answers, redis_process, throwaway_redis_options

_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()


class RedisServer:
    """One redis-server process on 127.0.0.1; ``port`` stays the same across stop()/start()."""

    def __init__(self, port: int | None = None, *, start_timeout_s: float = 10.0) -> None:
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.start_timeout_s = start_timeout_s
        self._proc: ManagedProcess | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="kairos-redis-"))
        _live.add(self)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.alive()

    def start(self) -> RedisServer:
        """Start the server (again) on ``self.port`` and wait until it answers PING."""
        if self.running:
            return self
        failure = ""
        for _attempt in range(5):
            options = throwaway_redis_options("127.0.0.1", self.port, self._dir)
            self._proc = redis_process(options, self._dir / "redis.log", ready=redis_answers("127.0.0.1", self.port))
            self._proc.start()
            try:
                self._proc.wait_ready(self.start_timeout_s)
            except ProcessError as exc:  # exited (the port was taken, a bad flag) or never answered
                failure = exc.message
                self.stop()
                if self._fixed_port:
                    break
                self.port = free_port()  # someone took the port between the probe and the bind
                continue
            self._fixed_port = True  # a restart must come back on the same port
            return self
        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}: {failure}")

    def stop(self) -> None:
        """Stop the server by its PID: SIGTERM, then SIGKILL after 5 s. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stop(grace_s=5.0)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        server.close()


class SecuredRedisServer:
    """A redis-server as ``kairos up`` starts it (:class:`kairos.launcher.redis_setup.RedisSetup`):
    ACL users with generated passwords, ``default`` off, and with ``tls`` TLS only. Stopped by its
    PID like :class:`RedisServer`.

        with SecuredRedisServer(tmp_path, ["p0", "d0"], tls=True) as server:
            server.setup.node_url("p0")     # rediss://kairos-node-p0:...@127.0.0.1:PORT/0?ssl_ca_certs=...
    """

    def __init__(self, folder: Path, node_ids: list[str], *, tls: bool = False, start_timeout_s: float = 10.0) -> None:
        from kairos.launcher.redis_setup import RedisSetup

        self.port = free_port()
        self.setup = RedisSetup.create(folder, self.port, node_ids, tls=tls)
        self.start_timeout_s = start_timeout_s
        self._proc: ManagedProcess | None = None
        self._log = folder / "redis.log"

    def _answers(self) -> bool:
        import redis

        client = redis.Redis.from_url(self.setup.admin_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def start(self) -> SecuredRedisServer:
        self._proc = redis_process(self.setup.server_options(), self._log, ready=self._answers)
        self._proc.start()
        try:
            self._proc.wait_ready(self.start_timeout_s)
        except ProcessError as exc:
            self.stop()
            raise RuntimeError(f"secured redis-server did not start: {exc.message}") from None
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stop(grace_s=5.0)

    def __enter__(self) -> SecuredRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
