"""Deflection promises shared by dispatcher replicas: a sorted set per decode node,
``kairos:reserve:{node}``, of the prefills each dispatcher has deflected there lately.

A dispatcher's own view shows its own deflections from the moment it sends them (the tracker's
overlay), but another replica's only once the node's next heartbeat does. So a deflection is
*promised* before it is sent: one script, atomic in Redis, that

* drops promises older than the TTL (by then the node's heartbeat shows them) and any that no
  dispatcher can have written (dated in Redis's future, unparseable, or a key of another type;
  counted in ``kairos_dispatcher_reservations_forged_total`` and logged once);
* sums the promises *other* dispatchers made since the node's last heartbeat the caller has read
  (``since_ms`` ago: the heartbeat's age plus the dispatch grace, the tracker's own rule);
* grants the promise when that sum is no more than what the caller's decision already counted
  (``known_tokens``), and refuses it otherwise, answering those promises (age and tokens) so the
  caller can add them to its view and decide again.

A decision therefore always counts every deflection on its node, its own and the others', as
the single-dispatcher overlay does; several deflections may go to one node between two
heartbeats (``max_pending_deflections=None``) and replicas never overcommit its step budget,
where the earlier ``SET NX PX`` lock allowed one deflection per node per TTL, even from the
dispatcher that held it. A promise is a budget: the prompt tokens it will prefill there.

Promise members are ``owner|seq|tokens`` (score: Redis's clock in ms); only this script reads
and writes them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from kairos.common.contracts import REDIS_RESERVATION_KEY, RESERVATION_MAX_TTL_S
from kairos.common.redis_client import REDIS_ERRORS, Outage, describe

log = logging.getLogger(__name__)

# KEYS[1]: the node's promise set. ARGV: owner, member id, tokens, known foreign tokens,
# since_ms (promises younger than this are not in the caller's heartbeat), ttl_ms.
# Returns {granted (0/1), forged (0/1), {age_ms, tokens, age_ms, tokens, ...}} of the foreign
# promises younger than since_ms.
PROMISE_SCRIPT = """
local key, owner, id = KEYS[1], ARGV[1], ARGV[2]
local tokens, known = tonumber(ARGV[3]), tonumber(ARGV[4])
local since, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local forged = 0
local kind = redis.call('TYPE', key)['ok']
if kind ~= 'none' and kind ~= 'zset' then
  redis.call('DEL', key)
  forged = 1
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. (now - ttl))
if redis.call('ZREMRANGEBYSCORE', key, '(' .. now, '+inf') > 0 then forged = 1 end
local foreign, sum = {}, 0
local members = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
for i = 1, #members, 2 do
  local m, at = members[i], tonumber(members[i + 1])
  local who, n = string.match(m, '^(.+)|%d+|(%d+)$')
  if who == nil then
    redis.call('ZREM', key, m)
    forged = 1
  elseif who ~= owner and at > now - since then
    n = tonumber(n)
    sum = sum + n
    foreign[#foreign + 1] = now - at
    foreign[#foreign + 1] = n
  end
end
if sum > known then return {0, forged, foreign} end
redis.call('ZADD', key, now, owner .. '|' .. id .. '|' .. tokens)
redis.call('PEXPIRE', key, ttl)
return {1, forged, foreign}
"""


@dataclass(frozen=True, slots=True)
class Promise:
    """Another dispatcher's deflection onto a node: how long ago (s) and how many prompt tokens."""

    age_s: float
    tokens: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """The answer to a promise. Refused with ``foreign`` set: other dispatchers promised more
    than the decision counted (add them and decide again). Refused with none: Redis did not
    answer (never deflect on a guess)."""

    granted: bool
    foreign: tuple[Promise, ...] = ()


REFUSED = Reservation(False)


class ReservationClient:
    """Makes promises on a Redis client it is handed (the cluster view's own)."""

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
        self._on_forged = on_forged  # counts a forged promise set cleaned
        self._forged_logged = False
        self._outage = Outage(log)
        self._source = source  # the (redacted) Redis URL, for log lines
        self._ids = itertools.count()
        self._script: AsyncScript | None = None  # hashed once; loaded into Redis on first use

    async def try_reserve(
        self,
        client: aioredis.Redis,
        node_id: str,
        owner: str,
        tokens: int,
        known_tokens: int,
        since_s: float,
    ) -> Reservation:
        """Promise ``tokens`` of deflected prefill on ``node_id``; see the module docstring.
        ``known_tokens``: other dispatchers' promises the decision counted; ``since_s``: the age
        of the node's heartbeat the decision read, plus the dispatch grace."""
        key = REDIS_RESERVATION_KEY.format(node_id=node_id)
        since_ms = min(self.ttl_ms, max(0, round(since_s * 1000)))
        try:
            if self._script is None:
                self._script = client.register_script(PROMISE_SCRIPT)
            granted, forged, foreign = await self._script(
                keys=[key], args=[owner, next(self._ids), tokens, known_tokens, since_ms, self.ttl_ms], client=client
            )
        except REDIS_ERRORS as exc:
            self._on_error()
            self._outage.fail(
                "redis unreachable at %s for reservations: %s; not deflecting until it answers",
                self._source,
                describe(exc),
            )
            return REFUSED
        self._outage.ok("redis at %(url)s takes reservations again", url=self._source)
        if forged:
            self._forged(key)
        promises = tuple(Promise(int(foreign[i]) / 1000, int(foreign[i + 1])) for i in range(0, len(foreign), 2))
        return Reservation(bool(granted), promises)

    def _forged(self, key: str) -> None:
        self._on_forged()
        if not self._forged_logged:
            self._forged_logged = True
            log.warning(
                "%s held promises no dispatcher writes (another type, an unparseable member, or one "
                "dated in the future): removed them; is Redis open to writers other than the "
                "dispatchers? (logged once; kairos_dispatcher_reservations_forged_total counts them)",
                key,
            )
