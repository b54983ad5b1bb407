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
  (``known_tokens``), and refuses it otherwise, answering those promises (age, tokens, member) so the
  caller can add them to its view and decide again.

A granted promise is also PUBLISHed on ``kairos:promises`` (by the script, so never one that was
not granted), and every replica's :class:`PromiseListener` adds the others' to its view as they
are made: replicas that would all pick the same best node learn of each other's deflections in
a fraction of a millisecond instead of through a refused promise and a second decision. A
message lost (a dropped subscription, a replica that just started) costs only that refusal.

A decision therefore always counts every deflection on its node, its own and the others', as
the single-dispatcher overlay does; several deflections may go to one node between two
heartbeats (``max_pending_deflections=None``) and replicas never overcommit its step budget,
where the earlier ``SET NX PX`` lock allowed one deflection per node per TTL, even from the
dispatcher that held it. A promise is a budget: the prompt tokens it will prefill there.

Promise members are ``owner|seq|tokens`` (score: Redis's clock in ms); only this script reads
and writes them. A member names its promise everywhere: in a refusal's answer and in the channel's
messages (``{"node": node_id, "promise": member}``), so a replica counts each promise once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from kairos.common.contracts import REDIS_PROMISE_CHANNEL, REDIS_RESERVATION_KEY, RESERVATION_MAX_TTL_S
from kairos.common.redis_client import REDIS_ERRORS, Outage, describe

log = logging.getLogger(__name__)

# KEYS[1]: the node's promise set. ARGV: owner, member id, tokens, known foreign tokens,
# since_ms (promises younger than this are not in the caller's heartbeat), ttl_ms, the promise
# channel, the node id. Returns {granted (0/1), forged (0/1), {age_ms, tokens, member, ...}} of
# the foreign promises younger than since_ms; a granted promise is published on the channel.
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
    foreign[#foreign + 1] = m
  end
end
if sum > known then return {0, forged, foreign} end
local member = owner .. '|' .. id .. '|' .. tokens
redis.call('ZADD', key, now, member)
redis.call('PEXPIRE', key, ttl)
redis.call('PUBLISH', ARGV[7], cjson.encode({node = ARGV[8], promise = member}))
return {1, forged, foreign}
"""


@dataclass(frozen=True, slots=True)
class Promise:
    """Another dispatcher's deflection onto a node: how long ago (s), how many prompt tokens, and
    its member in the node's promise set (its name wherever it is heard of)."""

    age_s: float
    tokens: int
    member: str = ""


@dataclass(frozen=True, slots=True)
class HeardPromise:
    """A promise as the channel tells it: onto ``node_id``, by ``owner``."""

    node_id: str
    owner: str
    tokens: int
    member: str


def parse_member(member: str) -> tuple[str, int] | None:
    """``(owner, tokens)`` of a promise member ``owner|seq|tokens`` (the script's pattern
    ``^(.+)|%d+|(%d+)$``); None if it is not one."""
    parts = member.rsplit("|", 2)
    if len(parts) != 3:
        return None
    owner, seq, tokens = parts
    if not owner or not (seq.isascii() and seq.isdigit()) or not (tokens.isascii() and tokens.isdigit()):
        return None
    return owner, int(tokens)


def decode_promise_message(raw: bytes | str) -> HeardPromise | None:
    """The promise a channel message names, or None for anything the script would not publish
    (a client other than a dispatcher may publish there when Redis runs without ACLs)."""
    try:
        message = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(message, dict):
        return None
    node_id, member = message.get("node"), message.get("promise")
    if not isinstance(node_id, str) or not node_id or not isinstance(member, str):
        return None
    parsed = parse_member(member)
    if parsed is None:
        return None
    owner, tokens = parsed
    return HeardPromise(node_id, owner, tokens, member)


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
                keys=[key],
                args=[
                    *(owner, next(self._ids), tokens, known_tokens, since_ms, self.ttl_ms),
                    *(REDIS_PROMISE_CHANNEL, node_id),
                ],
                client=client,
            )
        except REDIS_ERRORS as exc:
            self._on_error()
            if isinstance(exc, ResponseError):  # Redis answered with a refusal: an ACL of an earlier version
                self._outage.fail(
                    "redis at %s refuses the promise script (%s): check the dispatchers' ACL user against "
                    "kairos.common.redis_acl; not deflecting until it takes promises",
                    self._source,
                    describe(exc),
                )
            else:
                self._outage.fail(
                    "redis unreachable at %s for reservations: %s; not deflecting until it answers",
                    self._source,
                    describe(exc),
                )
            return REFUSED
        self._outage.ok("redis at %(url)s takes reservations again", url=self._source)
        if forged:
            self._forged(key)
        promises = tuple(
            Promise(int(age_ms) / 1000, int(promised), _text(member))
            for age_ms, promised, member in zip(foreign[::3], foreign[1::3], foreign[2::3], strict=True)
        )
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


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class PromiseListener:
    """Hears the promises every dispatcher makes (``kairos:promises``) on a connection of its
    own and hands each to ``on_promise``, until cancelled. A failed subscription (Redis down, or
    a credential without the channel) is retried every ``retry_s``, logged once per outage:
    meanwhile the other replicas' promises reach the view through refused ones, as before."""

    def __init__(
        self,
        connect: Callable[[], aioredis.Redis],
        on_promise: Callable[[HeardPromise], None],
        source: str,
        *,
        retry_s: float,
        on_malformed: Callable[[], None] = lambda: None,
    ) -> None:
        self._connect = connect
        self._on_promise = on_promise
        self._on_malformed = on_malformed  # counts a message no dispatcher published
        self._source = source
        self._retry_s = retry_s
        self._outage = Outage(log)
        self.subscribed = asyncio.Event()  # set while the subscription holds

    async def run(self) -> None:
        while True:
            try:
                await self._listen()
            except REDIS_ERRORS as exc:
                self.subscribed.clear()
                self._outage.fail(
                    "not hearing other dispatchers' promises from redis at %s (%s): they reach this view "
                    "only through refused promises until it answers",
                    self._source,
                    describe(exc),
                )
            await asyncio.sleep(self._retry_s)

    async def _listen(self) -> None:
        client = self._connect()
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(REDIS_PROMISE_CHANNEL)
            self.subscribed.set()
            self._outage.ok("hearing other dispatchers' promises from redis at %(url)s again", url=self._source)
            while True:
                # A bounded wait, not the client's command timeout: the channel may be quiet.
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self._retry_s)
                if message is None or message.get("type") != "message":
                    continue
                heard = decode_promise_message(message["data"])
                if heard is None:
                    self._on_malformed()
                else:
                    self._on_promise(heard)
        finally:
            self.subscribed.clear()
            await pubsub.aclose()
            await client.aclose()
