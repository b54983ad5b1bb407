"""The dispatcher's live cluster view, kept fresh from the nodes' Redis heartbeats.

A background task polls Redis every ``poll_s`` (at least twice per heartbeat period): a SCAN of
``kairos:node:*`` every few polls finds the nodes, one MGET per poll reads all their heartbeats.
Each heartbeat with a new ``seq`` updates the :class:`~kairos.core.view.ClusterTracker`, stamped with
the LOCAL monotonic time at which this dispatcher first saw that seq. Ages therefore never
depend on the publisher's clock (its ``sent_at`` is informational): a node whose clock runs an
hour ahead is as fresh as its beats are new. Nodes whose key disappeared (expired: the node or
its engine died) leave the view.

The request hot path never touches Redis: :meth:`RedisClusterView.view` returns the tracker's
in-memory view and :meth:`RedisClusterView.record` adds a dispatch to its overlay. Only a
deflection costs one round trip, for :meth:`RedisClusterView.try_reserve`.

Degraded modes (design principle 6):

* Redis unreachable after it had answered: ``degraded`` is True, the last good view is kept as it
  is. Its nodes' ages grow, so they turn stale: the decision core stops deflecting to them but
  still routes keep requests to them. When Redis answers again the view heals by itself.
* Redis never reachable since start: the view is built from the config's static node lists
  (``fallback_prefill``, ``fallback_decode``) with zero load and ``reported_at`` = now at every
  poll, and decode nodes report a KV capacity of 0 so that no prompt fits: Algorithm 1 can never
  deflect, and the keep path picks nodes by the dispatcher's own recent dispatches and then by
  node id. This is plain P/D routing.
* Reservations while Redis is unreachable return False: never deflect on a guess.

TTFT feedback: when given a :class:`~kairos.extproc.feedback.TtftFeedback`, each successful poll also
reads the sidecars' new entries of the ``kairos:ttft-feedback`` stream (one non-blocking XREAD
from the last id read; at start-up it begins at the stream's end, as ``$`` would). A failed
XREAD only pauses the feedback: it never marks the view degraded.

Every Redis failure counts in
``kairos_dispatcher_redis_errors_total{operation="poll"|"reserve"|"feedback"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kairos.common.contracts import (
    HEARTBEAT_PERIOD_S,
    HEARTBEAT_TTL_S,
    REDIS_NODE_KEY,
    REDIS_NODE_PATTERN,
    REDIS_RESERVATION_KEY,
    REDIS_TTFT_FEEDBACK_STREAM,
    Heartbeat,
    MalformedHeartbeat,
    parse_heartbeat,
)
from kairos.common.errors import ConfigError, NoHealthyNodeError
from kairos.core.decision import Decision
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.core.view import ClusterTracker
from kairos.extproc.feedback import TtftFeedback

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
_KEY_PREFIX = REDIS_NODE_KEY.format(node_id="")
_REDIS_ERRORS = (RedisError, OSError)  # OSError covers refused sockets and asyncio timeouts
_FEEDBACK_BATCH = 1000  # stream entries per XREAD: 20,000 samples/s at 50 ms polls


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
class StaticNode(NamedTuple):
    """A node of the static fallback lists."""

    node_id: str
    role: str  # "prefill" or "decode"
    url: str  # host:port of the node's vLLM server
    sidecar: str  # host:port of the decode sidecar ("" on prefill nodes)


def _check_hostport(what: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: expected host:port, got {value!r}")


def parse_static_node(role: str, entry: str) -> StaticNode:
    """A fallback list entry: ``p0=127.0.0.1:8001`` (prefill: its vLLM server); ``d0=127.0.0.1:8201``
    (decode: the sidecar the dispatcher routes to) or ``d0=127.0.0.1:8101+127.0.0.1:8201`` (decode:
    its vLLM server, then its sidecar)."""
    node_id, sep, rest = (x.strip() for x in entry.partition("="))
    if not sep or not node_id:
        raise ConfigError(f"fallback {role} node {entry!r}: expected id=host:port")
    if role == PREFILL:
        url, sidecar = rest, ""
        _check_hostport(f"fallback prefill node {node_id} url", url)
    else:
        url, plus, sidecar = (x.strip() for x in rest.partition("+"))
        if not plus:
            url, sidecar = "", rest
        elif url:
            _check_hostport(f"fallback decode node {node_id} url", url)
        _check_hostport(f"fallback decode node {node_id} sidecar", sidecar)
    return StaticNode(node_id, role, url, sidecar)


@dataclass(frozen=True, slots=True)
class ClusterViewConfig:
    """How the dispatcher keeps its cluster view fresh from Redis."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    poll_s: float = 0.05  # one MGET of all heartbeats per poll: at least two polls per heartbeat
    scan_every_polls: int = 4  # SCAN kairos:node:* every this many polls (new nodes join this late at most)
    stale_after_s: float = 0.35  # no new seq for this long: the node is stale (pass the decider the same value)
    redis_timeout_s: float = 0.2  # connect and command timeout of each round trip
    # Long enough for the deflected request to reach its node and show in a heartbeat the
    # dispatchers have read (hop + one beat + one poll, with slack on a loaded host).
    reservation_ttl_s: float = 3 * HEARTBEAT_PERIOD_S
    # After Redis answers again (or for the first time), nodes missing from it are kept this long
    # (aging, so stale) before removal: publishers need up to one period to re-publish into a
    # restarted, empty Redis, and the view should not flash empty meanwhile.
    recovery_grace_s: float = HEARTBEAT_TTL_S
    # A node whose key holds a malformed heartbeat keeps its last good state (aging) until that
    # state is this old, then leaves the view, as if its key had expired.
    forget_malformed_after_s: float = HEARTBEAT_TTL_S
    # When every heartbeat of a role expires at once (more likely a starved host or a stalled
    # agent than every node dying together), those nodes stay in the view, stale (never deflected
    # to, used only when no fresh node of the role exists), for this long before they are dropped.
    last_resort_s: float = 30.0
    # Used only while Redis has never been reachable: plain P/D routing over these nodes.
    fallback_prefill: tuple[str, ...] = ()  # "id=host:port" of each prefill vLLM
    fallback_decode: tuple[str, ...] = ()  # "id=sidecar_host:port" or "id=vllm_host:port+sidecar_host:port"

    def __post_init__(self) -> None:
        if urlsplit(self.redis_url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"redis_url: expected a redis://, rediss:// or unix:// URL, got {self.redis_url!r}")
        if not self.poll_s > 0:
            raise ConfigError(f"poll_s must be > 0, got {self.poll_s}")
        if not self.stale_after_s > self.poll_s:
            raise ConfigError(
                f"stale_after_s={self.stale_after_s} must exceed poll_s={self.poll_s}"
                " (nodes would go stale between polls)"
            )
        if self.scan_every_polls < 1:
            raise ConfigError(f"scan_every_polls must be >= 1, got {self.scan_every_polls}")
        if not self.redis_timeout_s > 0:
            raise ConfigError(f"redis_timeout_s must be > 0, got {self.redis_timeout_s}")
        if not self.reservation_ttl_s >= 0.001:
            raise ConfigError(f"reservation_ttl_s must be >= 0.001 (1 ms), got {self.reservation_ttl_s}")
        if not self.last_resort_s >= 0:
            raise ConfigError(f"last_resort_s must be >= 0, got {self.last_resort_s}")
        if not self.recovery_grace_s >= 0 or not self.forget_malformed_after_s >= 0:
            raise ConfigError(
                f"recovery_grace_s={self.recovery_grace_s} and "
                f"forget_malformed_after_s={self.forget_malformed_after_s} must be >= 0"
            )
        ids = [n.node_id for n in self.static_nodes()]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ConfigError(f"fallback node ids must be unique, repeated: {dupes}")

    def static_nodes(self) -> tuple[StaticNode, ...]:
        return tuple(parse_static_node(PREFILL, e) for e in self.fallback_prefill) + tuple(
            parse_static_node(DECODE, e) for e in self.fallback_decode
        )

    @property
    def reservation_ttl_ms(self) -> int:
        return max(1, round(self.reservation_ttl_s * 1000))


# ---------------------------------------------------------------------------------------------
# Heartbeats
# ---------------------------------------------------------------------------------------------
class NodeAddress(NamedTuple):
    """Where a node is reached; the dispatcher routes to ``sidecar`` and names ``url`` of the
    prefill node in the keep header."""

    role: str
    url: str
    sidecar: str
    model: str


# ---------------------------------------------------------------------------------------------
# Metrics and small helpers
# ---------------------------------------------------------------------------------------------
_ERROR_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()


def redis_error_counter(registry: CollectorRegistry = REGISTRY) -> Counter:
    """``kairos_dispatcher_redis_errors_total{operation}``, registered once per registry."""
    counter = _ERROR_COUNTERS.get(registry)
    if counter is None:
        counter = Counter(
            "kairos_dispatcher_redis_errors",
            "Failed Redis round trips of the dispatcher's cluster view (poll), reservations (reserve) "
            "and TTFT feedback reads (feedback)",
            ["operation"],
            registry=registry,
        )
        for operation in ("poll", "reserve", "feedback"):
            counter.labels(operation=operation)  # export every series from the start, at 0
        _ERROR_COUNTERS[registry] = counter
    return counter


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``, fit for a log line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, f"{parts.username or ''}:***@{host}", parts.path, parts.query, parts.fragment))


def default_owner() -> str:
    """A reservation owner unique to this dispatcher process: ``hostname:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().rstrip(".")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(slots=True)
class _Node:
    """What the view remembers of a node between polls."""

    role: str
    seq: int
    sent_at: float
    reported_at: float  # local clock when this (seq, sent_at) was first seen
    from_redis: bool  # False for a static fallback node


# ---------------------------------------------------------------------------------------------
# The live view
# ---------------------------------------------------------------------------------------------
class RedisClusterView:
    """The cluster as Redis heartbeats show it, plus this dispatcher's dispatches since.

    ``clock`` is the time base of ``reported_at``; pass the decision core ``now=view.now()`` (and
    the same clock's time to :meth:`record`). Start with ``await view.start()`` (one poll is done
    before it returns) and end with ``await view.stop()``, or use ``async with``.
    """

    def __init__(
        self,
        config: ClusterViewConfig,
        tracker: ClusterTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        registry: CollectorRegistry = REGISTRY,
        feedback: TtftFeedback | None = None,
    ) -> None:
        self.config = config
        self.feedback = feedback  # None: the TTFT feedback stream is not read
        self.tracker = tracker if tracker is not None else ClusterTracker()
        self._clock = clock
        self._errors = redis_error_counter(registry)
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._nodes: dict[str, _Node] = {}
        self._malformed_ids: set[str] = set()  # keys holding a malformed value (logged once each)
        self._last_resort_roles: set[str] = set()  # roles whose every key expired (logged once each)
        self._addresses: dict[str, NodeAddress] = {}
        self._keys: list[str] = []  # heartbeat keys found by the last SCAN (plus none since)
        self._polls = 0
        self._scan_due = True
        self._connected_once = False
        self._connected_at: float | None = None  # clock time of the first success after an outage
        self._outage_since: float | None = None
        self._outage_failures = 0
        self._reserve_failing = False
        self._feedback_last_id: bytes | None = None  # None: find the stream's end first ("$")
        self._feedback_failing = False
        self._bug_logged = False
        self._stopping = False
        self._url = redact_url(config.redis_url)
        self.degraded = False  # Redis did not answer the last poll
        self.static_fallback = False  # the view comes from the static lists (Redis never answered)

    # -- hot path: memory only -------------------------------------------------------------------
    def now(self) -> float:
        """The view's clock: the time base of every ``reported_at`` (pass it to the decision)."""
        return self._clock()

    def view(self) -> ClusterView:
        """The current view (heartbeats + own dispatches); no I/O."""
        return self.tracker.view()

    def record(self, decision: Decision, now: float) -> None:
        """Account for a dispatch until a heartbeat shows it."""
        self.tracker.record(decision, now)

    def addresses(self) -> Mapping[str, NodeAddress]:
        """node_id -> (role, url, sidecar, model) of every node in the view (read-only, live)."""
        return MappingProxyType(self._addresses)

    def address(self, node_id: str) -> NodeAddress | None:
        return self._addresses.get(node_id)

    def stale_node_ids(self) -> tuple[str, ...]:
        """Nodes with no new heartbeat for ``stale_after_s`` (not deflection targets)."""
        now = self.now()
        return tuple(i for i, n in self._nodes.items() if now - n.reported_at > self.config.stale_after_s)

    def nodes_report(self) -> dict[str, Any]:
        """What this dispatcher routes on, for operators and start-up scripts (``GET /nodes``):
        every node in the view with its role, heartbeat age and staleness, and whether the view
        is degraded (Redis lost) or built from the static lists (Redis never answered)."""
        now = self.now()
        nodes = [
            {
                "id": node_id,
                "role": node.role,
                "age_s": round(max(0.0, now - node.reported_at), 3),
                "stale": now - node.reported_at > self.config.stale_after_s,
                "from_redis": node.from_redis,
            }
            for node_id, node in sorted(self._nodes.items())
        ]
        return {
            "status": "degraded" if self.degraded else "ok",
            "static_fallback": self.static_fallback,
            "nodes": nodes,
        }

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Poll once, then keep polling in a background task until :meth:`stop`."""
        if self.running:
            return
        log.info(
            "cluster view from %s: poll every %.0f ms, SCAN %s every %d polls, stale after %.0f ms%s",
            self._url,
            self.config.poll_s * 1000,
            REDIS_NODE_PATTERN,
            self.config.scan_every_polls,
            self.config.stale_after_s * 1000,
            f"; static fallback: {', '.join(n.node_id for n in self.config.static_nodes())}"
            if self.config.fallback_prefill or self.config.fallback_decode
            else "",
        )
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="kairos-cluster-view")

    async def stop(self) -> None:
        """Stop polling and close the Redis connections; the last view stays readable."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            # Cancel until it is done: on Python 3.11 a cancellation that lands while a redis-py
            # wait_for completes can be swallowed; the loop also checks _stopping.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._stopping = False
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def __aenter__(self) -> RedisClusterView:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_ready(self, timeout: float) -> None:
        """Return once at least one prefill and one decode node are in the view; raise
        :class:`~kairos.common.errors.NoHealthyNodeError` after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if not self.running:
                await self.poll_once()
            view = self.view()
            if view.prefill and view.decode:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise NoHealthyNodeError(
                    f"cluster not ready after {timeout} s: {len(view.prefill)} prefill and {len(view.decode)} "
                    f"decode nodes known from {self._url}{' (unreachable)' if self.degraded else ''}"
                )
            await asyncio.sleep(min(self.config.poll_s, remaining))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.config.poll_s
        start, slot = loop.time(), 0
        while not self._stopping:
            slot = max(slot + 1, math.floor((loop.time() - start) / period) + 1)  # skip overrun slots
            await asyncio.sleep(max(0.0, start + slot * period - loop.time()))
            try:
                await self.poll_once()
            except Exception:  # a bug must not kill the view: log it (once) and poll again
                if not self._bug_logged:
                    self._bug_logged = True
                    log.exception("cluster view poll failed unexpectedly; keeping the last view and retrying")
                else:
                    log.debug("cluster view poll failed again", exc_info=True)
            else:
                self._bug_logged = False

    def _redis(self) -> aioredis.Redis:
        if self._client is None:
            # Fail fast and retry at the next poll: a hidden retry with backoff would hold the view.
            self._client = aioredis.Redis.from_url(
                self.config.redis_url,
                socket_timeout=self.config.redis_timeout_s,
                socket_connect_timeout=self.config.redis_timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        return self._client

    # -- polling ---------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        """One poll: SCAN (every few polls), MGET, apply to the tracker. Never raises on Redis errors."""
        client = self._redis()
        # SCAN every few polls, and at every poll while recovering (publishers are re-publishing).
        scan = self._scan_due or self._in_grace(self.now()) or self._polls % self.config.scan_every_polls == 0
        self._polls += 1
        try:
            if scan:
                found = {k.decode() async for k in client.scan_iter(match=REDIS_NODE_PATTERN, count=1000)}
                keys = sorted(found)
            else:
                keys = self._keys
            values = await client.mget(keys) if keys else []
        except _REDIS_ERRORS as exc:
            self._poll_failed(exc)
            return
        now = self.now()
        self._poll_succeeded(now)
        self._apply(keys, values, now)
        if self.feedback is not None:
            await self._read_feedback(client, self.feedback)

    async def _read_feedback(self, client: aioredis.Redis, feedback: TtftFeedback) -> None:
        """Hand the feedback stream's new entries to ``feedback``. XREAD without BLOCK: a poll
        must not wait. "$" means nothing to a non-blocking XREAD (it would always answer empty),
        so the first read finds the stream's last id with XREVRANGE and continues from there."""
        try:
            if self._feedback_last_id is None:
                last = await client.xrevrange(REDIS_TTFT_FEEDBACK_STREAM, count=1)
                self._feedback_last_id = last[0][0] if last else b"0-0"
            reply = await client.xread({REDIS_TTFT_FEEDBACK_STREAM: self._feedback_last_id}, count=_FEEDBACK_BATCH)
        except _REDIS_ERRORS as exc:
            self._errors.labels(operation="feedback").inc()
            if not self._feedback_failing:
                self._feedback_failing = True
                log.warning(
                    "cannot read the TTFT feedback stream %s at %s: %s; the model-error metrics pause until it "
                    "reads again (routing is not affected)",
                    REDIS_TTFT_FEEDBACK_STREAM,
                    self._url,
                    _describe(exc),
                )
            return
        if self._feedback_failing:
            self._feedback_failing = False
            log.info("reading the TTFT feedback stream %s again", REDIS_TTFT_FEEDBACK_STREAM)
        # RESP2 answers [[stream, entries]], a RESP3 connection may answer {stream: entries}.
        for _stream, entries in reply.items() if isinstance(reply, dict) else reply or ():
            if entries:
                self._feedback_last_id = entries[-1][0]
                feedback.add_entries(entries)

    def _poll_failed(self, exc: BaseException) -> None:
        self._errors.labels(operation="poll").inc()
        self.degraded = True
        self._scan_due = True
        self._outage_failures += 1
        now = self.now()
        first = self._outage_since is None
        if first:
            self._outage_since = now
        if not self._connected_once:
            self._apply_static(now)
            if first:
                log.warning(
                    "redis unreachable at %s: %s; no heartbeat seen yet, %s",
                    self._url,
                    _describe(exc),
                    f"using the static node lists, {self._count_text()}: plain P/D routing, no deflection"
                    if self._nodes
                    else "and no static nodes are configured: no node to route to",
                )
        elif first:
            log.warning(
                "redis unreachable at %s: %s; falling back to last view of %s, which turn stale after %.0f ms "
                "(no deflection, keep routing only) until redis answers",
                self._url,
                _describe(exc),
                self._count_text(),
                self.config.stale_after_s * 1000,
            )

    def _poll_succeeded(self, now: float) -> None:
        if self._outage_since is not None:
            log.info(
                "redis at %s answers%s after %.2f s unreachable (%d failed polls)%s",
                self._url,
                " again" if self._connected_once else "",
                now - self._outage_since,
                self._outage_failures,
                "; leaving the static node lists" if self.static_fallback else "",
            )
        if self._outage_since is not None:
            self._connected_at = now  # start of the recovery grace
        self._outage_since, self._outage_failures = None, 0
        self._connected_once = True
        self.degraded = False
        self.static_fallback = False
        self._scan_due = False

    def _count_text(self) -> str:
        roles = [n.role for n in self._nodes.values()]
        return f"{len(roles)} nodes ({roles.count(PREFILL)} prefill, {roles.count(DECODE)} decode)"

    def _apply(self, keys: Sequence[str], values: Sequence[bytes | None], now: float) -> None:
        seen: set[str] = set()
        present: list[str] = []
        for key, raw in zip(keys, values, strict=True):
            if raw is None:  # expired (or deleted) since the SCAN
                continue
            present.append(key)
            node_id = key[len(_KEY_PREFIX) :]
            seen.add(node_id)
            try:
                hb = parse_heartbeat(raw, node_id)
            except MalformedHeartbeat as exc:
                self._malformed(node_id, key, exc, now)
                continue
            self._heartbeat(hb, now)
        self._keys = present
        self._malformed_ids &= seen
        in_grace = self._in_grace(now)
        roles_seen = {self._nodes[i].role for i in seen if i in self._nodes}
        for node_id in [i for i in self._nodes if i not in seen]:
            node = self._nodes[node_id]
            if in_grace:
                continue  # Redis just came back: give publishers time to re-publish
            if node.from_redis and node.role not in roles_seen and now - node.reported_at < self.config.last_resort_s:
                self._keep_as_last_resort(node_id, node.role)
                continue
            reason = "its heartbeat key expired" if node.from_redis else "it is a static node and redis now answers"
            self._remove(node_id, reason)
        self._last_resort_roles &= {self._nodes[i].role for i in self._nodes if i not in seen}

    def _keep_as_last_resort(self, node_id: str, role: str) -> None:
        if role not in self._last_resort_roles:
            self._last_resort_roles.add(role)
            log.warning(
                "every %s heartbeat expired at once: keeping the last known %s nodes (stale: keep routing only) "
                "for up to %.0f s as a last resort, until one beats again",
                role,
                role,
                self.config.last_resort_s,
            )

    def _in_grace(self, now: float) -> bool:
        return self._connected_at is not None and now - self._connected_at < self.config.recovery_grace_s

    def _heartbeat(self, hb: Heartbeat, now: float) -> None:
        if hb.node_id in self._malformed_ids:
            self._malformed_ids.discard(hb.node_id)
            log.info("node %s: valid heartbeat again (seq %d)", hb.node_id, hb.seq)
        node = self._nodes.get(hb.node_id)
        if node is not None and node.from_redis and (node.seq, node.sent_at) == (hb.seq, hb.sent_at):
            return  # same beat as last poll: its reported_at keeps aging
        if node is not None and node.role != hb.role:
            self._remove(hb.node_id, f"it now reports role {hb.role}")
            node = None
        if node is None or not node.from_redis:
            log.info(
                "node %s joined: %s at %s%s, model %s, seq %d",
                hb.node_id,
                hb.role,
                hb.url,
                f", sidecar {hb.sidecar}" if hb.sidecar else "",
                hb.model or "?",
                hb.seq,
            )
        self._nodes[hb.node_id] = _Node(hb.role, hb.seq, hb.sent_at, now, from_redis=True)
        self._addresses[hb.node_id] = NodeAddress(hb.role, hb.url, hb.sidecar, hb.model)
        if hb.role == PREFILL:
            self.tracker.update_prefill(
                PrefillNodeState(hb.node_id, hb.queued_prefill_tokens, chunk_tokens=hb.max_step_tokens, reported_at=now)
            )
        else:
            self.tracker.update_decode(
                DecodeNodeState(
                    hb.node_id,
                    hb.decode_tokens,
                    hb.kv_tokens,
                    hb.kv_capacity_tokens,
                    reported_at=now,
                    prefill_backlog_tokens=hb.scheduled_prefill_tokens,
                )
            )

    def _malformed(self, node_id: str, key: str, exc: MalformedHeartbeat, now: float) -> None:
        if node_id not in self._malformed_ids:
            self._malformed_ids.add(node_id)
            log.warning("ignoring malformed heartbeat in %s: %s (logged once until it is valid again)", key, exc)
        node = self._nodes.get(node_id)
        if node is not None and now - node.reported_at >= self.config.forget_malformed_after_s:
            self._remove(node_id, f"no valid heartbeat for {now - node.reported_at:.2f} s")

    def _remove(self, node_id: str, reason: str) -> None:
        node = self._nodes.pop(node_id, None)
        self._addresses.pop(node_id, None)
        self.tracker.remove(node_id)
        if node is not None:
            log.info("node %s (%s) left the view: %s", node_id, node.role, reason)

    def _apply_static(self, now: float) -> None:
        """Static fallback (Redis never answered): zero load, fresh every poll, never deflectable."""
        for n in self.config.static_nodes():
            self._nodes[n.node_id] = _Node(n.role, -1, math.nan, now, from_redis=False)
            self._addresses[n.node_id] = NodeAddress(n.role, n.url, n.sidecar, "")
            if n.role == PREFILL:
                # chunk_tokens is unknown; 1 token per step keeps the field valid and is never used
                # to choose between static nodes, which all have the same (empty) queue.
                self.tracker.update_prefill(PrefillNodeState(n.node_id, (), chunk_tokens=1, reported_at=now))
            else:
                # kv_capacity_tokens=0: no prompt fits, so the decision core never deflects here.
                self.tracker.update_decode(DecodeNodeState(n.node_id, 0, 0, 0, reported_at=now))
        self.static_fallback = bool(self._nodes)

    # -- reservations ----------------------------------------------------------------------------
    async def try_reserve(self, node_id: str, owner: str) -> bool:
        """Take ``kairos:reserve:{node_id}`` for ``reservation_ttl_s`` (SET NX PX). True if this
        call took it; False if another owner holds it or Redis is unreachable (never deflect on a
        guess). Of several dispatchers racing for one node within the TTL, exactly one wins."""
        if self.degraded:
            return False
        key = REDIS_RESERVATION_KEY.format(node_id=node_id)
        try:
            acquired = await self._redis().set(key, owner, nx=True, px=self.config.reservation_ttl_ms)
        except _REDIS_ERRORS as exc:
            self._errors.labels(operation="reserve").inc()
            if not self._reserve_failing:
                self._reserve_failing = True
                log.warning(
                    "redis unreachable at %s for reservations: %s; not deflecting until it answers",
                    self._url,
                    _describe(exc),
                )
            return False
        if self._reserve_failing:
            self._reserve_failing = False
            log.info("redis at %s takes reservations again", self._url)
        return bool(acquired)
