"""Deflection reservations shared by dispatcher replicas: ``SET kairos:reserve:{node} NX PX``.

Two replicas that see the same idle decode node between two heartbeats would both deflect to
it; the one that takes the key first deflects, the other sees the node as taken until the key
expires (about one heartbeat period, by when the node's heartbeat shows the deflection).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from kairos.common.contracts import REDIS_RESERVATION_KEY
from kairos.common.redis_client import REDIS_ERRORS, Outage, describe

log = logging.getLogger(__name__)


class ReservationClient:
    """Takes reservations on a Redis client it is handed (the cluster view's own)."""

    def __init__(self, ttl_ms: int, on_error: Callable[[], None], source: str) -> None:
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        self.ttl_ms = ttl_ms
        self._on_error = on_error  # counts a failed round trip
        self._outage = Outage(log)
        self._source = source  # the (redacted) Redis URL, for log lines

    async def try_reserve(self, client: aioredis.Redis, node_id: str, owner: str) -> bool:
        """True if this call took ``node_id``'s reservation; False if another owner holds it or
        Redis is unreachable (never deflect on a guess). Of several dispatchers racing for one
        node within the TTL, exactly one wins."""
        key = REDIS_RESERVATION_KEY.format(node_id=node_id)
        try:
            acquired = await client.set(key, owner, nx=True, px=self.ttl_ms)
        except REDIS_ERRORS as exc:
            self._on_error()
            self._outage.fail(
                "redis unreachable at %s for reservations: %s; not deflecting until it answers",
                self._source,
                describe(exc),
            )
            return False
        self._outage.ok("redis at %(url)s takes reservations again", url=self._source)
        return bool(acquired)
