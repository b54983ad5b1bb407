"""Redis helpers every Kairos process shares: one client set-up, URL redaction, outage logging.

- :func:`fail_fast_client`: bounded command and connect times and no hidden retries, because
  every caller (the dispatcher's poller, the heartbeat publisher, the sidecar's feedback writer)
  already retries on its own period, and a retry with backoff would hold its loop;
  :func:`fail_fast_sync_client`: the same for a blocking client that one worker thread owns (the
  dispatcher's view poll, whose reads must not wait on an event loop busy with requests).
- :func:`redact_url`: a Redis URL fit for a log line; :func:`with_credentials`: a URL with a
  user and password (ACL users: :mod:`kairos.common.redis_acl`).

URLs: ``redis://user:password@host:port/0``, or ``rediss://...`` for TLS with redis-py's options
in the query, e.g. ``rediss://kairos-node-p0:PASS@gw:6380/0?ssl_ca_certs=/etc/kairos/redis-ca.pem``.
- :class:`Outage`: log the first failure of an outage at WARNING and its end at INFO, nothing
  in between, so a Redis restart costs two log lines, not one per poll.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.client import Redis as SyncRedis
from redis.exceptions import RedisError
from redis.retry import Retry as SyncRetry

from kairos.common import defaults
from kairos.common.errors import ConfigError

# What a failed Redis round trip raises: OSError covers refused sockets and asyncio timeouts.
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError)

REDIS_URL_SCHEMES = ("redis", "rediss", "unix")


def check_redis_url(name: str, value: str) -> None:
    """Raise :class:`~kairos.common.errors.ConfigError` unless ``value`` is a Redis URL."""
    if urlsplit(value).scheme not in REDIS_URL_SCHEMES:
        raise ConfigError(f"{name}: expected a redis://, rediss:// or unix:// URL, got {redact_url(value)!r}")


def connect_timeout_s(timeout_s: float) -> float:
    """A fail-fast client's connect budget: :data:`~kairos.common.defaults.REDIS_CONNECT_TIMEOUT_S`,
    or its command budget where that is longer."""
    return max(timeout_s, defaults.REDIS_CONNECT_TIMEOUT_S)


def fail_fast_client(url: str, timeout_s: float) -> aioredis.Redis:
    """A client whose every command gives up after ``timeout_s``, never retried, and whose
    connect (TCP, TLS) after :func:`connect_timeout_s`. redis-py reconnects by itself on the next
    command after an error."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s(timeout_s),
        retry=Retry(NoBackoff(), 0),
    )


def fail_fast_sync_client(url: str, timeout_s: float) -> SyncRedis:
    """:func:`fail_fast_client`'s settings on a blocking client (one thread's own: not shared)."""
    return SyncRedis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s(timeout_s),
        retry=SyncRetry(NoBackoff(), 0),
    )


def redact_url(url: str) -> str:
    """The URL with any password (in its user part or a ``password=`` query) replaced by ``***``,
    fit for a log line."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rsplit('@', 1)[1]}"
    if "password" in {k for k, _ in parse_qsl(query, keep_blank_values=True)}:
        pairs = [(k, "***" if k == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        query = urlencode(pairs, safe="*/:")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def with_credentials(url: str, username: str, password: str) -> str:
    """``url`` with ``username:password@`` (percent-encoded) in place of any user part it had."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"credentials go into a redis:// or rediss:// URL, got {redact_url(url)!r}")
    host = parts.netloc.rsplit("@", 1)[-1]
    userinfo = f"{quote(username, safe='')}:{quote(password, safe='')}"
    return urlunsplit((parts.scheme, f"{userinfo}@{host}", parts.path, parts.query, parts.fragment))


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, for one log line (no traceback)."""
    text = str(exc).strip().rstrip(".")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Outage:
    """Logs the first failure of an outage at WARNING and its end at INFO, nothing in between."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._clock = clock
        self.since: float | None = None  # clock time of the current outage's first failure
        self.failures = 0  # failures in the current outage

    def fail(self, message: str, *args: Any) -> bool:
        """Count a failure; log ``message`` if it starts an outage. True if it did."""
        self.failures += 1
        if self.since is not None:
            return False
        self.since = self._clock()
        self._log.warning(message, *args)
        return True

    def ok(self, message: str, **fields: Any) -> float | None:
        """End the outage, if any, logging ``message``: it may use %(after).2f (seconds) and
        %(failures)d besides ``fields``. Returns the outage's length, or None if there was none."""
        if self.since is None:
            return None
        after = self._clock() - self.since
        self._log.info(message, {"after": after, "failures": self.failures, **fields})
        self.since, self.failures = None, 0
        return after
