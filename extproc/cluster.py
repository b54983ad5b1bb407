"""The dispatcher's live cluster view: a thin Redis poller around the membership rules.

A poll thread polls Redis every ``poll_s`` (half a heartbeat period): a SCAN of
``kairos:node:*`` every few polls (and at every poll while recovering from an outage) finds the
nodes, one MGET per poll reads all their heartbeats. What came back, or the failure, goes to
:class:`~kairos.extproc.membership.Membership` with the view's clock time; it applies the rules
(staleness, recovery grace, last resort, malformed and role-changing nodes, static fallback,
degraded mode) and says what changed, which this module logs. Ages use this dispatcher's clock
at receipt, never the publisher's.

The poll's slots, SCAN and MGET run on that thread, with its own blocking client, not on the
event loop: under request load every ``await`` of an asyncio read waits behind the requests'
callbacks, and a 1,000-heartbeat MGET reply (about 300 KB) takes several reads, so the polls
began late, took long and skipped slots (``bench/scale.py``). The loop applies each read in one
callback (membership and the tracker stay the loop's alone); what follows a poll on the loop (KV
event subscriptions, the TTFT feedback read) never holds back the next one.

The request hot path never touches Redis: :meth:`RedisClusterView.view` returns the tracker's
in-memory view and :meth:`RedisClusterView.record` adds a dispatch to its overlay. Only a
deflection costs one round trip, for :meth:`RedisClusterView.try_reserve`
(:mod:`kairos.extproc.reservations`); while the view is degraded no reservation is granted.

With a :class:`~kairos.extproc.feedback.TtftFeedback`, each good poll also reads the sidecars'
new TTFT feedback (:class:`~kairos.extproc.feedback.FeedbackReader`). With a
:class:`~kairos.extproc.kv_events.KvEventConsumer`, the view keeps it subscribed to exactly the
nodes whose heartbeats advertise KV event sockets (``Membership.kv_event_endpoints``), after
every poll that changed them.

Every Redis failure counts in
``kairos_dispatcher_redis_errors_total{operation="poll"|"reserve"|"feedback"}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from redis.client import Redis as SyncRedis

from kairos.common.aio import cancel_and_wait
from kairos.common.config import part, setting
from kairos.common.contracts import (
    HEARTBEAT_PERIOD_S,
    REDIS_NODE_KEY,
    REDIS_NODE_PATTERN,
    RESERVATION_MAX_TTL_S,
    Role,
)
from kairos.common.errors import ConfigError, NoHealthyNodeError
from kairos.common.redis_client import (
    REDIS_ERRORS,
    check_redis_url,
    describe,
    fail_fast_client,
    fail_fast_sync_client,
    redact_url,
)
from kairos.core.decision import Decision
from kairos.core.state import ClusterView
from kairos.core.view import ClusterTracker
from kairos.extproc.feedback import FeedbackReader, TtftFeedback
from kairos.extproc.kv_events import KvEventConsumer
from kairos.extproc.membership import (
    Event,
    HeartbeatMalformed,
    HeartbeatRejected,
    HeartbeatsBack,
    HeartbeatsGone,
    HeartbeatValidAgain,
    LastResortKept,
    Membership,
    MembershipConfig,
    NodeAddress,
    NodeJoined,
    NodeLeft,
    RedisBack,
    RedisLost,
    RejectReason,
)
from kairos.extproc.metrics import (
    heartbeats_rejected_counter,
    promises_heard_counter,
    reservations_forged_counter,
    view_poll_metrics,
)
from kairos.extproc.reservations import REFUSED, HeardPromise, PromiseListener, Reservation, ReservationClient

log = logging.getLogger(__name__)

_KEY_PREFIX = REDIS_NODE_KEY.format(node_id="")
# What a poll's read gives the loop: (keys, values), or what the read raised.
_Read = tuple[list[str], list[bytes | None]] | Exception


@dataclass(frozen=True, slots=True)
class ClusterViewConfig:
    """How the dispatcher keeps its cluster view fresh from Redis."""

    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        help="redis:// or rediss:// URL of the heartbeats; with a password, better in the environment (not in ps)",
        flags=("--redis", "--redis-url"),
    )
    # One MGET of all heartbeats per poll, two polls per heartbeat period: a beat enters the view
    # at most poll_s after it was written, so no heartbeat is older than period + poll_s.
    poll_s: float = setting(HEARTBEAT_PERIOD_S / 2, help="read every heartbeat this often")
    scan_every_polls: int = setting(4, help="SCAN for new nodes every this many polls (they join this late at most)")
    # A connect: redis_client.connect_timeout_s.
    redis_timeout_s: float = setting(0.2, help="command timeout of each Redis round trip")
    # Long enough for the deflected request to reach its node and show in a heartbeat the
    # dispatchers have read (hop + one beat + one poll, with slack on a loaded host).
    reservation_ttl_s: float = setting(
        3 * HEARTBEAT_PERIOD_S, help="how long a decode node's reservation for a deflection holds"
    )
    # Off, the other replicas' promises reach the view only through refused promises.
    hear_promises: bool = setting(
        True, help="hear the other dispatcher replicas' promises as they are made (reservations.PromiseListener)"
    )
    membership: MembershipConfig = part(MembershipConfig, help="the membership rules")

    def __post_init__(self) -> None:
        check_redis_url("redis_url", self.redis_url)
        if not self.poll_s > 0:
            raise ConfigError(f"poll_s must be > 0, got {self.poll_s}")
        if not self.membership.stale_after_s > self.poll_s:
            raise ConfigError(
                f"stale_after_s={self.membership.stale_after_s} must exceed poll_s={self.poll_s}"
                " (nodes would go stale between polls)"
            )
        if self.scan_every_polls < 1:
            raise ConfigError(f"scan_every_polls must be >= 1, got {self.scan_every_polls}")
        if not self.redis_timeout_s > 0:
            raise ConfigError(f"redis_timeout_s must be > 0, got {self.redis_timeout_s}")
        if not 0.001 <= self.reservation_ttl_s <= RESERVATION_MAX_TTL_S:
            raise ConfigError(
                f"reservation_ttl_s must be 0.001 (1 ms) to {RESERVATION_MAX_TTL_S:g}, got {self.reservation_ttl_s}"
            )

    @property
    def reservation_ttl_ms(self) -> int:
        return max(1, round(self.reservation_ttl_s * 1000))


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


class RedisClusterView:
    """The cluster as Redis heartbeats show it, plus this dispatcher's dispatches since.

    ``clock`` is the time base of every ``reported_at``; pass the decision core ``now=view.now()``
    (and the same clock's time to :meth:`record`). Start with ``await view.start()`` (one poll is
    done before it returns) and end with ``await view.stop()``, or use ``async with``.
    """

    def __init__(
        self,
        config: ClusterViewConfig,
        tracker: ClusterTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        registry: CollectorRegistry = REGISTRY,
        feedback: TtftFeedback | None = None,
        kv_events: KvEventConsumer | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.kv_events = kv_events  # its clock must be ``clock``: hits are judged fresh on it
        self._kv_events_version = -1  # the membership's kv_events_version last applied
        self.membership = Membership(config.membership, tracker if tracker is not None else ClusterTracker())
        self._clock = clock
        self._wall_clock = wall_clock  # only to compare with the heartbeats' sent_at (a metric)
        self._errors = redis_error_counter(registry)
        self._rejected = heartbeats_rejected_counter([str(r) for r in RejectReason], registry)
        self._poll_metrics = view_poll_metrics(registry)
        self._url = redact_url(config.redis_url)
        self._reservations = ReservationClient(
            config.reservation_ttl_ms,
            self._errors.labels(operation="reserve").inc,
            self._url,
            reservations_forged_counter(registry).inc,
        )
        self._heard = promises_heard_counter(registry)
        self._owners: set[str] = set()  # the owners this view promised as: its own promises come back
        self._listener = (
            PromiseListener(
                self._redis_connection,
                self._heard_promise,
                self._url,
                retry_s=self.config.poll_s,
                on_malformed=self._heard.labels(outcome="malformed").inc,
            )
            if config.hear_promises
            else None
        )
        self._listening: asyncio.Task[None] | None = None
        self._feedback = (
            FeedbackReader(feedback, self._errors.labels(operation="feedback").inc, self._url, self._decode_node_ids)
            if feedback is not None
            else None
        )
        self._client: aioredis.Redis | None = None
        # The poll's reads: one worker thread (made when first needed, ended by stop()), which
        # alone uses ``_reader`` (made there).
        self._io_pool: ThreadPoolExecutor | None = None
        self._reader: SyncRedis | None = None
        self._task: asyncio.Task[None] | None = None  # waits on the poll thread's life
        self._stopping = threading.Event()  # tells the poll thread to end
        self._follow_up: asyncio.Task[None] | None = None  # the threaded polls' follow-ups
        self._follow_up_again: bool | None = None  # set: run them once more (True: Redis answered)
        self._keys: list[str] = []  # heartbeat keys found by the last SCAN that still held a value
        self._polls = 0
        self._scan_due = True
        self._bug_logged = False

    # -- hot path: memory only -------------------------------------------------------------------
    @property
    def tracker(self) -> ClusterTracker:
        return self.membership.tracker

    @property
    def feedback(self) -> TtftFeedback | None:
        return self._feedback.feedback if self._feedback is not None else None

    @property
    def degraded(self) -> bool:
        """Redis did not answer the last poll."""
        return self.membership.degraded

    @property
    def static_fallback(self) -> bool:
        """The view comes from the static lists (Redis never answered)."""
        return self.membership.static_fallback

    def now(self) -> float:
        """The view's clock: the time base of every ``reported_at`` (pass it to the decision)."""
        return self._clock()

    def view(self) -> ClusterView:
        """The current view (heartbeats + own dispatches); no I/O."""
        return self.tracker.view()

    def record(self, decision: Decision, now: float) -> object:
        """Account for a dispatch until a heartbeat shows it; a handle to ``cancel`` it."""
        return self.tracker.record(decision, now)

    def cancel(self, handle: object) -> None:
        """Take back a recorded deflection whose promise was refused."""
        self.tracker.cancel(handle)

    def addresses(self) -> Mapping[str, NodeAddress]:
        """node_id -> (role, url, sidecar, model) of every node in the view (read-only, live)."""
        return self.membership.addresses()

    def decode_sidecars(self) -> tuple[str, ...]:
        """The decode nodes' sidecars in the view, sorted (cached until an address changes)."""
        return self.membership.decode_sidecars()

    def _decode_node_ids(self) -> set[str]:
        return {i for i, a in self.membership.addresses().items() if a.role is Role.DECODE}

    def address(self, node_id: str) -> NodeAddress | None:
        return self.membership.addresses().get(node_id)

    def stale_node_ids(self) -> tuple[str, ...]:
        """Nodes with no new heartbeat for ``stale_after_s`` (not deflection targets)."""
        return self.membership.stale_node_ids(self.now())

    def nodes_report(self) -> dict[str, Any]:
        """What this dispatcher routes on (``GET /nodes``): every node with its role, heartbeat
        age and staleness, and whether the view is degraded or from the static lists."""
        report = self.membership.report(self.now())
        if self.kv_events is not None:
            for node in report["nodes"]:
                events = self.kv_events.report(node["id"])
                if events is not None:
                    node["kv_events"] = events
        return report

    async def try_reserve(self, node_id: str, owner: str, tokens: int) -> Reservation:
        """Promise a deflection of ``tokens`` onto ``node_id`` (``kairos.extproc.reservations``).
        Refused while degraded (never on a guess). Refused because other dispatchers promised
        more than the view counted: their promises join the view, and the caller decides again."""
        self._owners.add(owner)  # before the promise: the channel may tell it back before the answer
        reported_at = self.tracker.reported_at(node_id)
        if self.degraded or reported_at is None:
            return REFUSED
        now = self.now()
        tracker = self.tracker
        reservation = await self._reservations.try_reserve(
            self._redis(),
            node_id,
            owner,
            tokens,
            known_tokens=tracker.foreign_tokens(node_id),
            since_s=now - reported_at + tracker.dispatch_grace_s,
        )
        if not reservation.granted and reservation.foreign:
            tracker.set_foreign(node_id, [(now - p.age_s, p.tokens, p.member) for p in reservation.foreign])
        return reservation

    def _heard_promise(self, heard: HeardPromise) -> None:
        """Another dispatcher's promise, from the channel: into the view as it is made."""
        added = heard.owner not in self._owners and self.tracker.add_foreign(
            heard.node_id, self.now(), heard.tokens, heard.member
        )
        self._heard.labels(outcome="added" if added else "ignored").inc()

    def _redis_connection(self) -> aioredis.Redis:
        """A client of its own (the promise channel holds its connection), with the view's settings."""
        return fail_fast_client(self.config.redis_url, self.config.redis_timeout_s)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Poll once, then keep polling on the poll thread until :meth:`stop`."""
        if self.running:
            return
        statics = self.config.membership.static_nodes()
        log.info(
            "cluster view from %s: poll every %.0f ms, SCAN %s every %d polls, stale after %.0f ms%s",
            self._url,
            self.config.poll_s * 1000,
            REDIS_NODE_PATTERN,
            self.config.scan_every_polls,
            self.config.membership.stale_after_s * 1000,
            f"; static fallback: {', '.join(n.node_id for n in statics)}" if statics else "",
        )
        await self.poll_once()
        self._stopping = threading.Event()
        self._task = asyncio.create_task(self._run(self._stopping), name="kairos-cluster-view")
        if self._listener is not None:
            self._listening = asyncio.create_task(self._listener.run(), name="kairos-promise-listener")

    async def stop(self) -> None:
        """Stop polling and close the Redis connections; the last view stays readable."""
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        follow_up, self._follow_up = self._follow_up, None
        if follow_up is not None:
            await cancel_and_wait(follow_up)
        listening, self._listening = self._listening, None
        if listening is not None:
            await cancel_and_wait(listening)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
        io, self._io_pool = self._io_pool, None
        if io is not None:
            # Queued behind the poll thread's last read, if it is still in flight.
            await asyncio.get_running_loop().run_in_executor(io, self._close_reader)
            io.shutdown(wait=False)

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

    async def _run(self, stopping: threading.Event) -> None:
        """The poll thread's life, on the worker, until ``stopping`` is set."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._io(), self._poll_forever, loop, stopping)

    def _poll_forever(self, loop: asyncio.AbstractEventLoop, stopping: threading.Event) -> None:
        """On the worker thread: a poll every ``poll_s`` on a monotonic grid (a poll that overran
        skips the slots it missed), each applied on ``loop`` before the next begins. Neither the
        slot nor the read waits for the event loop; only the update does, once."""
        period = self.config.poll_s
        start, slot = time.monotonic(), 0
        while True:
            slot = max(slot + 1, math.floor((time.monotonic() - start) / period) + 1)
            due = start + slot * period
            if stopping.wait(max(0.0, due - time.monotonic())):
                return
            self._poll_metrics.lateness.observe(max(0.0, time.monotonic() - due))
            started = time.perf_counter()
            outcome, read_done = self._read_or_error()
            applied: concurrent.futures.Future[None] = concurrent.futures.Future()
            try:
                loop.call_soon_threadsafe(self._apply_on_loop, outcome, started, read_done, applied, stopping)
            except RuntimeError:  # the loop is closed: the dispatcher is gone
                return
            while not stopping.is_set():
                try:
                    applied.result(timeout=period)
                    break
                except concurrent.futures.TimeoutError:
                    if loop.is_closed():
                        return

    def _apply_on_loop(
        self,
        outcome: _Read,
        started: float,
        read_done: float,
        applied: concurrent.futures.Future[None],
        stopping: threading.Event,
    ) -> None:
        """On the event loop: the update of one threaded poll (``applied`` resolves then, so the
        next read need not wait), then its follow-ups as a task. Follow-ups (the TTFT feedback
        read is a Redis round trip on this loop) never hold back the next poll: while one runs,
        the next update only asks it to run once more. A bug is logged (once), never raised."""
        try:
            if stopping.is_set():  # stopped since the read: the view stays as stop() left it
                return
            ok = self._apply(outcome, started, read_done)
        except Exception:
            self._bug()
            return
        finally:
            applied.set_result(None)
        if self._follow_up is not None and not self._follow_up.done():
            self._follow_up_again = self._follow_up_again or ok
            return
        self._follow_up = asyncio.create_task(self._follow_ups(ok), name="kairos-cluster-view-follow-up")

    async def _follow_ups(self, ok: bool) -> None:
        """:meth:`_after_poll`, again for as long as updates arrived while it ran."""
        while True:
            self._follow_up_again = None
            try:
                await self._after_poll(ok)
            except Exception as exc:
                self._bug(exc)
            else:
                self._bug_logged = False
            if self._follow_up_again is None:
                return
            ok = self._follow_up_again

    def _bug(self, exc: BaseException | None = None) -> None:
        """A poll failed unexpectedly: log it once per run of failures, keep the last view."""
        exc_info = exc if exc is not None else True
        if not self._bug_logged:
            self._bug_logged = True
            log.error("cluster view poll failed unexpectedly; keeping the last view and retrying", exc_info=exc_info)
        else:
            log.debug("cluster view poll failed again", exc_info=exc_info)

    def _io(self) -> ThreadPoolExecutor:
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kairos-view-poll")
        return self._io_pool

    def _redis(self) -> aioredis.Redis:
        if self._client is None:
            self._client = fail_fast_client(self.config.redis_url, self.config.redis_timeout_s)
        return self._client

    def _read(self, scan: bool, known: list[str]) -> tuple[list[str], list[bytes | None]]:
        """On the worker thread: the heartbeat keys (SCANned, or ``known``) and their values."""
        if self._reader is None:
            self._reader = fail_fast_sync_client(self.config.redis_url, self.config.redis_timeout_s)
        reader = self._reader
        keys = sorted({k.decode() for k in reader.scan_iter(match=REDIS_NODE_PATTERN, count=1000)}) if scan else known
        return keys, reader.mget(keys) if keys else []

    def _read_or_error(self) -> tuple[_Read, float]:
        """On the worker thread: :meth:`_read`, or what it raised, for the loop to apply (it alone
        touches the view), and when it ended (``perf_counter``). The thread reads the poller's
        state only between two updates, when the loop does not change it."""
        started = time.perf_counter()
        outcome: _Read
        try:
            outcome = self._read(self._next_scan(), self._keys)
        except Exception as exc:
            outcome = exc
        done = time.perf_counter()
        self._poll_metrics.read.observe(done - started)
        return outcome, done

    def _close_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    # -- polling ---------------------------------------------------------------------------------
    def _next_scan(self) -> bool:
        """Whether the next poll SCANs for keys."""
        scan = (
            self._scan_due
            or self.membership.heartbeats_gone  # find the first one back at once
            or self.membership.recovering(self.now())  # publishers are re-publishing
            or self._polls % self.config.scan_every_polls == 0
        )
        self._polls += 1
        return scan

    async def poll_once(self) -> None:
        """One poll: SCAN (every few polls) and MGET on the worker thread, then hand the result to
        membership. Never raises on Redis errors. Not while the background poller runs."""
        started = time.perf_counter()
        outcome, read_done = await asyncio.get_running_loop().run_in_executor(self._io(), self._read_or_error)
        await self._after_poll(self._apply(outcome, started, read_done))

    def _apply(self, outcome: _Read, started: float, read_done: float) -> bool:
        """Feed one poll's read (or its failure) to membership; True if Redis answered."""
        self._poll_metrics.apply_wait.observe(time.perf_counter() - read_done)
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, REDIS_ERRORS):
                raise outcome
            self._errors.labels(operation="poll").inc()
            self._scan_due = True
            self._log(self.membership.poll_failed(self.now()), outcome)
            return False
        keys, values = outcome
        self._scan_due = False
        now, wall = self.now(), self._wall_clock()
        oldest = self.membership.oldest_beat_age(now)
        if oldest is not None:
            self._poll_metrics.oldest_heartbeat.observe(oldest)
        self._keys = [k for k, v in zip(keys, values, strict=True) if v is not None]
        beats = [(k[len(_KEY_PREFIX) :], v) for k, v in zip(keys, values, strict=True)]
        self._log(self.membership.poll_succeeded(beats, now))
        sent_at = self.membership.oldest_new_sent_at
        if sent_at is not None:
            self._poll_metrics.read_delay.observe(max(0.0, wall - sent_at))
        self._poll_metrics.seconds.observe(time.perf_counter() - started)
        return True

    async def _after_poll(self, ok: bool) -> None:
        """A poll's follow-ups on the loop: the KV event subscriptions, then (Redis answered)
        the new TTFT feedback."""
        await self._subscribe()
        if ok and self._feedback is not None:
            await self._feedback.read(self._redis())

    async def _subscribe(self) -> None:
        """Subscribe to the KV events of exactly the nodes that advertise them now."""
        version = self.membership.kv_events_version
        if self.kv_events is None or version == self._kv_events_version:
            return
        self._kv_events_version = version
        await self.kv_events.set_nodes(dict(self.membership.kv_event_endpoints()))

    def _log(self, events: list[Event], exc: BaseException | None = None) -> None:
        for event in events:
            match event:
                case NodeJoined(hb):
                    log.info(
                        "node %s joined: %s at %s%s, model %s, seq %d",
                        hb.node_id,
                        hb.role,
                        hb.url,
                        f", sidecar {hb.sidecar}" if hb.sidecar else "",
                        hb.model or "?",
                        hb.seq,
                    )
                case NodeLeft(node_id, role, reason):
                    log.info("node %s (%s) left the view: %s", node_id, role, reason)
                case HeartbeatRejected(_node_id, reason, _detail):
                    self._rejected.labels(reason=str(reason)).inc()
                case HeartbeatMalformed(node_id, error):
                    log.warning(
                        "ignoring the heartbeat in %s%s: %s (logged once until it is valid again)",
                        _KEY_PREFIX,
                        node_id,
                        error,
                    )
                case HeartbeatValidAgain(node_id, seq):
                    log.info("node %s: valid heartbeat again (seq %d)", node_id, seq)
                case LastResortKept(role, keep_s):
                    log.warning(
                        "every %s heartbeat expired at once: keeping the last known %s nodes (stale: keep routing "
                        "only) for up to %.0f s as a last resort, until one beats again",
                        role,
                        role,
                        keep_s,
                    )
                case HeartbeatsGone(prefill, decode, stale_after_s):
                    log.warning(
                        "redis at %s answers but holds no heartbeat at all (full and refusing writes? flushed? "
                        "publishers locked out?): keeping the last view of %d nodes (%d prefill, %d decode), which "
                        "turn stale after %.0f ms (no deflection, keep routing only), until a heartbeat is back",
                        self._url,
                        prefill + decode,
                        prefill,
                        decode,
                        stale_after_s * 1000,
                    )
                case HeartbeatsBack(after_s):
                    log.info("redis at %s holds heartbeats again after %.2f s without any", self._url, after_s)
                case RedisLost():
                    self._log_lost(event, exc)
                case RedisBack(after_s, failed, again, leaving_static, empty):
                    log.info(
                        "redis at %s answers%s after %.2f s %s (%d %s)%s",
                        self._url,
                        " again" if again else "",
                        after_s,
                        "without a heartbeat" if empty else "unreachable",
                        failed,
                        "polls" if empty else "failed polls",
                        "; leaving the static node lists" if leaving_static else "",
                    )

    def _log_lost(self, event: RedisLost, exc: BaseException | None) -> None:
        why = describe(exc) if exc is not None else "no answer"
        counts = (
            f"{event.prefill_nodes + event.decode_nodes} nodes ({event.prefill_nodes} prefill, "
            f"{event.decode_nodes} decode)"
        )
        if event.empty:
            log.warning(
                "redis at %s answers but holds no heartbeat, and this view none from it: using the static node "
                "lists, %s: plain P/D routing, no deflection, until a heartbeat shows up",
                self._url,
                counts,
            )
        elif not event.ever_connected:
            log.warning(
                "redis unreachable at %s: %s; no heartbeat seen yet, %s",
                self._url,
                why,
                f"using the static node lists, {counts}: plain P/D routing, no deflection"
                if self.static_fallback
                else "and no static nodes are configured: no node to route to",
            )
        else:
            log.warning(
                "redis unreachable at %s: %s; falling back to last view of %s, which turn stale after %.0f ms "
                "(no deflection, keep routing only) until redis answers",
                self._url,
                why,
                counts,
                event.stale_after_s * 1000,
            )
