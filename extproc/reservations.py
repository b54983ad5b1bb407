"""Deflection reservations shared by dispatcher replicas: ``SET kairos:reserve:{node} NX PX``.

Two replicas that see the same idle decode node between two heartbeats would both deflect to
it; the one that takes the key first deflects, the other sees the node as taken until the key
expires (about one heartbeat period, by when the node's heartbeat shows the deflection).

A key that no dispatcher can have set (no expiry, or one beyond
:data:`~kairos.common.contracts.RESERVATION_MAX_TTL_S`) would stop deflection to its node for
good: the dispatcher that finds one takes it over, logs it once and counts it
(``kairos_dispatcher_reservations_forged_total``). With Redis ACLs only dispatchers may write
these keys at all; this covers a shared password.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from kairos.common.contracts import REDIS_RESERVATION_KEY, RESERVATION_MAX_TTL_S
from kairos.common.redis_client import REDIS_ERRORS, Outage, describe

log = logging.getLogger(__name__)


class ReservationClient:
    """Takes reservations on a Redis client it is handed (the cluster view's own)."""

    def __init__(
        self,
        ttl_ms: int,
        on_error: Callable[[], None],
        source: str,
        on_forged: Callable[[], None] = lambda: None,
    ) -> None:
        if not 1 <= ttl_ms <= RESERVATION_MAX_TTL_S * 1000:
            raise ValueError(f"ttl_ms must be 1 to {RESERVATION_MAX_TTL_S * 1000:g}, got {ttl_ms}")
        self.ttl_ms = ttl_ms
        self._on_error = on_error  # counts a failed round trip
        self._on_forged = on_forged  # counts a forged reservation taken over
        self._forged_logged = False
        self._outage = Outage(log)
        self._source = source  # the (redacted) Redis URL, for log lines

    async def try_reserve(self, client: aioredis.Redis, node_id: str, owner: str) -> bool:
        """True if this call took ``node_id``'s reservation; False if another owner holds it or
        Redis is unreachable (never deflect on a guess). Of several dispatchers racing for one
        node within the TTL, exactly one wins."""
        key = REDIS_RESERVATION_KEY.format(node_id=node_id)
        try:
            acquired = await client.set(key, owner, nx=True, px=self.ttl_ms)
            if not acquired:
                # Taken: by a dispatcher (an expiry within the limit), or forged. Only a conflict
                # pays this second round trip.
                pttl = await client.pttl(key)
                if pttl == -1 or pttl > RESERVATION_MAX_TTL_S * 1000:
                    self._forged(key, pttl)
                    acquired = await client.set(key, owner, px=self.ttl_ms)
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

    def _forged(self, key: str, pttl: int) -> None:
        self._on_forged()
        if not self._forged_logged:
            self._forged_logged = True
            log.warning(
                "%s held %s, which no dispatcher sets (a reservation expires within %g s): taking it over; "
                "is Redis open to writers other than the dispatchers? (logged once; "
                "kairos_dispatcher_reservations_forged_total counts them)",
                key,
                "with no expiry" if pttl == -1 else f"for {pttl / 1000:g} s",
                RESERVATION_MAX_TTL_S,
            )
