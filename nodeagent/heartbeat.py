"""The heartbeat publisher: every Δh, read the local engine's state and write it to Redis.

One publisher runs beside each vLLM (or emulated vLLM) server. Every period it reads an
:class:`EngineState` from an :class:`EngineStateSource` and, in one pipelined round trip,

* ``SET kairos:node:{node_id} <json> PX <ttl>``: the dispatcher polls these keys; the expiry makes
  a node whose publisher or engine died vanish by itself after the TTL;
* ``PUBLISH kairos:heartbeats <json>``: the same JSON for subscribers (monitoring, replays).

Failure policy:

* the state source fails (engine down, hung, malformed answer): nothing is published, so the key
  expires and the node leaves the cluster; one WARNING per outage, one INFO on recovery;
* the sidecar of a decode node refuses connections, or accepts them but answers no request for
  ``sidecar_hang_s`` (frozen, hung: the kernel completes a TCP handshake for a stopped process
  until its listen backlog fills, which took over 15 s at 10 probes/s); checked each beat by
  :class:`SidecarProbe` when the publisher runs as a process: not published either, since the
  gateway reaches the node only through it; the node leaves the view until the sidecar is back;
* Redis fails (refused, timeout): one WARNING per outage, the publisher keeps trying every period
  and resumes by itself (redis-py reconnects on the next command); it never crashes on either.

Beats are scheduled on a monotonic grid (start + k x period), so slow reads do not accumulate
drift: a beat that overruns its slot skips the slots it missed instead of bunching up.

Run it as ``python -m kairos.nodeagent.heartbeat --node-id d0 --role decode --url 127.0.0.1:8101
--sidecar 127.0.0.1:8201 --redis redis://127.0.0.1:6379/0``; SIGTERM or SIGINT stops it
cleanly and removes the node's key (if it still holds this publisher's last beat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from kairos.common.aio import cancel_and_wait
from kairos.common.config import ConfigSource, check_hostport, setting
from kairos.common.contracts import (
    HEARTBEAT_PERIOD_S,
    HEARTBEAT_TTL_S,
    REDIS_HEARTBEAT_CHANNEL,
    REDIS_NODE_KEY,
    SIDECAR_PROBE_PATH,
    STATE_PATH,
    EngineState,
    EngineStateError,
    Heartbeat,
    HeartbeatField,
    Role,
    encode_heartbeat,
    parse_engine_state,
)
from kairos.common.contracts.engine_state import heartbeat_load
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KvEventEndpoints, KvEventsConfig, advertised_endpoints, host_of
from kairos.common.redis_client import Outage, check_redis_url, describe, fail_fast_client, redact_url
from kairos.common.runtime import Service

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Engine state (the contract, EngineState and its codec, is kairos.common.contracts')
# ---------------------------------------------------------------------------------------------
@runtime_checkable
class EngineStateSource(Protocol):
    """Where a publisher reads the engine's state; any exception means "engine unavailable"."""

    async def read(self) -> EngineState: ...


def state_endpoint(address: str) -> str:
    """``host:port`` -> ``http://host:port`` + :data:`STATE_PATH`; a full http(s) URL keeps its
    path (:data:`STATE_PATH` is added when it has none)."""
    text = address.strip()
    if "://" not in text:
        check_hostport("state url", text)
        return f"http://{text}{STATE_PATH}"
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"state url: expected host:port or an http(s) URL, got {address!r}")
    path = parts.path if parts.path not in ("", "/") else STATE_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class HttpStateSource:
    """Reads the engine state (``GET`` :func:`state_endpoint`) through one reused aiohttp session.

    The session is created on the first read (inside the running loop); ``aclose()`` closes it.
    """

    def __init__(self, url: str, timeout_s: float = 0.25) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"HttpStateSource: timeout_s must be > 0, got {timeout_s}")
        self.endpoint = state_endpoint(url)
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self._session

    async def read(self) -> EngineState:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.get(self.endpoint) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:200]
                    raise EngineStateError(f"GET {self.endpoint}: HTTP {resp.status}: {body}")
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineStateError(f"GET {self.endpoint}: {describe(exc)}") from exc
        return parse_engine_state(raw)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _delete_if_holding(client: aioredis.Redis, key: str, payload: str) -> bool:
    """Compare-and-delete: remove ``key`` only if it still holds ``payload`` (a newer publisher
    for the same node id may have taken it over), as one WATCH / MULTI / EXEC transaction. Not a
    script: a node's Redis user runs no EVAL, so a node's credential cannot stall Redis with one."""
    async with client.pipeline(transaction=True) as pipe:
        await pipe.watch(key)
        held = await pipe.get(key)
        if held is None or (held.decode() if isinstance(held, bytes) else held) != payload:
            await pipe.unwatch()
            return False
        pipe.multi()
        pipe.delete(key)
        try:
            await pipe.execute()
        except WatchError:  # written between the GET and the DEL: not ours any more
            return False
        return True


class SidecarProbe:
    """Whether the node's sidecar serves HTTP (it serves every request the gateway sends this
    node): one ``GET`` of its probe path, answered by its event loop alone (the engine is not
    asked, so a busy engine does not fail it). A bare TCP connect is not enough: the kernel
    completes the handshake for a stopped or hung process until its listen backlog fills."""

    def __init__(self, hostport: str) -> None:
        check_hostport("sidecar", hostport)
        host, _, port = hostport.rpartition(":")
        self.hostport, self._host, self._port = hostport, host.strip("[]"), int(port)
        self._request = f"GET {SIDECAR_PROBE_PATH} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n".encode()

    async def check(self) -> None:
        """Returns once the sidecar answered with an HTTP status line (any status); raises
        ``OSError`` when it refuses, closes or answers something else. No timeout of its own."""
        reader, writer = await asyncio.open_connection(self._host, self._port)
        try:
            writer.write(self._request)
            await writer.drain()
            status = await reader.readline()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if not status.startswith(b"HTTP/1."):
            raise ConnectionError(f"sidecar at {self.hostport} answered {status[:40]!r}, not HTTP")


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """One node's heartbeat publisher."""

    node_id: str = setting(help="this node's id, unique in the cluster (its Redis key is kairos:node:ID)")
    role: Role = setting(help="the node's role")
    url: str = setting(help="host:port of the node's vLLM (or emulated vLLM) OpenAI server")
    sidecar: str = setting("", help="host:port of the decode sidecar: required on decode nodes, empty on prefill nodes")
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        help="Redis URL; with a password, better in the environment (not in ps)",
        flags=("--redis", "--redis-url"),
    )
    period_s: float = setting(HEARTBEAT_PERIOD_S, help="heartbeat period: one beat per period, on a monotonic grid")
    ttl_s: float = setting(HEARTBEAT_TTL_S, help="key expiry: a node that stops beating vanishes after this")
    state_url: str = setting("", help=f"where {STATE_PATH} is served (host:port or URL); empty: --url")
    state_timeout_s: float = setting(0.25, help="a state read slower than this counts as a failure (no beat)")
    # A connect: redis_client.connect_timeout_s.
    redis_timeout_s: float = setting(0.25, help="command timeout of each Redis round trip")
    deregister_on_stop: bool = setting(True, help="on stop, delete the key (if still ours): the node leaves at once")
    check_sidecar: bool = setting(True, help="decode nodes: no beat while the sidecar refuses connections or hangs")
    # A shorter silence is a loaded event loop, and the node keeps beating through it.
    sidecar_hang_s: float = setting(
        1.0, help="a sidecar that accepts connections but has answered no probe for this long is down"
    )
    # A refused connection is dead; a timeout is a busy engine: its node stays in the view, stale
    # (keep routing only, no deflection), instead of expiring while it serves.
    busy_hold_s: float = setting(
        60.0, help="an engine whose state read times out keeps its last beat alive this long (0: a timeout is down)"
    )
    # The same string the engine is started with; "" (or events off in it): nothing advertised.
    kv_events_config: str = setting(
        "", help="the node's vLLM --kv-events-config JSON, verbatim: its beats advertise the event sockets"
    )
    kv_events_host: str = setting(
        "", help="host advertised for a wildcard KV events bind (tcp://*:5557); empty: the host of --url"
    )

    def __post_init__(self) -> None:
        if not self.node_id or any(ch.isspace() or ch in "*?[]" for ch in self.node_id):
            raise ConfigError(f"node_id must be non-empty without spaces or glob characters, got {self.node_id!r}")
        if self.role not in tuple(Role):
            raise ConfigError(f"role must be one of {[str(r) for r in Role]}, got {self.role!r}")
        check_hostport("url", self.url)
        if self.role == Role.DECODE:
            if not self.sidecar:
                raise ConfigError(f"decode node {self.node_id}: sidecar (host:port) is required")
            check_hostport("sidecar", self.sidecar)
        elif self.sidecar:
            raise ConfigError(f"prefill node {self.node_id}: sidecar must be empty, got {self.sidecar!r}")
        check_redis_url("redis_url", self.redis_url)
        if not self.period_s > 0:
            raise ConfigError(f"period_s must be > 0, got {self.period_s}")
        if not self.ttl_s > self.period_s:
            raise ConfigError(
                f"ttl_s={self.ttl_s} must be > period_s={self.period_s}, else the key expires between beats"
            )
        if not self.sidecar_hang_s >= 0:
            raise ConfigError(f"sidecar_hang_s must be >= 0, got {self.sidecar_hang_s}")
        if not self.busy_hold_s >= 0:
            raise ConfigError(f"busy_hold_s must be >= 0 (0 = off), got {self.busy_hold_s}")
        if not self.state_timeout_s > 0 or not self.redis_timeout_s > 0:
            raise ConfigError(
                f"state_timeout_s={self.state_timeout_s} and redis_timeout_s={self.redis_timeout_s} must be > 0"
            )
        state_endpoint(self.state_url or self.url)  # raises ConfigError when malformed
        self.kv_event_endpoints()  # likewise

    def kv_event_endpoints(self) -> KvEventEndpoints | None:
        """Where the node's KV events are subscribed to, as its beats advertise it (None: no events)."""
        if not self.kv_events_config:
            return None
        try:
            config = KvEventsConfig.from_json(self.kv_events_config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return advertised_endpoints(config, self.kv_events_host or host_of(self.url))

    @property
    def key(self) -> str:
        return REDIS_NODE_KEY.format(node_id=self.node_id)

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    @property
    def state_endpoint(self) -> str:
        return state_endpoint(self.state_url or self.url)


SOURCE = ConfigSource(
    PublisherConfig, section="heartbeat", env_prefix="KAIROS_HEARTBEAT_", module="kairos.nodeagent.heartbeat"
)


def build_heartbeat(
    config: PublisherConfig,
    state: EngineState,
    seq: int,
    sent_at: float,
    kv_events: KvEventEndpoints | None = None,
) -> Heartbeat:
    """The node's heartbeat for this beat (encode it with :func:`encode_heartbeat`);
    ``kv_events``: ``config.kv_event_endpoints()``, read once by the caller.

    The engine's load as it reported it, but for how long its step and its KV pull in flight have
    run: as of ``sent_at`` (:func:`elapsed_at`), the instant the dispatcher's heartbeat age counts
    from."""
    load = heartbeat_load(state)
    load[HeartbeatField.RUNNING_STEP_ELAPSED_S] = elapsed_at(state.running_step_elapsed_s, state, sent_at)
    load[HeartbeatField.RUNNING_KV_PULL_ELAPSED_S] = elapsed_at(state.running_kv_pull_elapsed_s, state, sent_at)
    return Heartbeat(
        node_id=config.node_id,
        role=Role(config.role),
        url=config.url,
        sidecar=config.sidecar,
        seq=seq,
        sent_at=sent_at,
        **load,
        kv_events_endpoint=None if kv_events is None else kv_events.pub,
        kv_events_replay_endpoint=None if kv_events is None else kv_events.replay,
        kv_events_topic=None if kv_events is None else kv_events.topic,
    )


def elapsed_at(elapsed: float | None, state: EngineState, sent_at: float) -> float | None:
    """How long something the state says had been running ``elapsed`` (its step in flight, its KV
    pull in flight) has run at ``sent_at``: that, plus the time since the state was taken
    (``as_of``, the engine's unix time on this host). The vLLM plugin's state is a snapshot taken
    between steps and served until the next one, so it can be a few steps old when read; the
    emulated node's is taken as it is read, and says no as_of. Without an as_of, or one later
    than ``sent_at`` (another host's clock), the state's own."""
    as_of = state.as_of
    if elapsed is None or as_of is None or not sent_at > as_of:
        return elapsed
    return elapsed + (sent_at - as_of)


# ---------------------------------------------------------------------------------------------
# The publisher
# ---------------------------------------------------------------------------------------------
class HeartbeatPublisher:
    """Publishes one node's heartbeat every period until :meth:`stop` (or cancellation).

    ``stop()`` ends the loop after the current beat and, with ``deregister_on_stop``, deletes the
    key if it still holds this publisher's last beat. Cancelling ``run()`` (a crash, in effect)
    leaves the key to expire after ``ttl_s``. The caller owns ``source`` and closes it.
    """

    def __init__(self, config: PublisherConfig, source: EngineStateSource, sidecar: SidecarProbe | None = None) -> None:
        self.config = config
        self.source = source
        self.sidecar = sidecar  # checked after each state read; None = not checked
        self.kv_events = config.kv_event_endpoints()
        self.seq = 0  # seq of the last beat sent to Redis (+1 per beat, never reused)
        self.published = 0  # beats Redis acknowledged
        self._stop = asyncio.Event()
        self._running = False
        self._last_payload: str | None = None  # the last JSON Redis acknowledged
        self._state_outage = Outage(log)
        self._redis_outage = Outage(log)
        self._sidecar_outage = Outage(log)
        self._sidecar_answered: float | None = None  # monotonic time of the sidecar's last answer

    @property
    def running(self) -> bool:
        return self._running

    def stop(self) -> None:
        """Ask ``run()`` to return after the current beat (safe from a signal handler). Also
        honoured when called before ``run()`` starts; a stopped publisher stays stopped."""
        self._stop.set()

    async def run(self) -> None:
        if self._running:
            raise RuntimeError(f"heartbeat publisher for {self.config.node_id} is already running")
        self._running = True
        cfg = self.config
        client = fail_fast_client(cfg.redis_url, cfg.redis_timeout_s)
        loop = asyncio.get_running_loop()
        log.info(
            "heartbeat for %s node %s (%s%s) to %s every %.0f ms, key %s expires after %.0f ms; state from %s",
            cfg.role,
            cfg.node_id,
            cfg.url,
            f", sidecar {cfg.sidecar}" if cfg.sidecar else "",
            redact_url(cfg.redis_url),
            cfg.period_s * 1000,
            cfg.key,
            cfg.ttl_s * 1000,
            cfg.state_endpoint,
        )
        if self.kv_events is not None:
            log.info(
                "node %s advertises its KV events at %s (replay %s, topic %r)",
                cfg.node_id,
                self.kv_events.pub,
                self.kv_events.replay or "none",
                self.kv_events.topic,
            )
        start = loop.time()
        slot = 0
        try:
            while not self._stop.is_set():
                await self.beat(client)
                # Next slot on the grid start + k * period; skip the slots a slow beat overran.
                slot = max(slot + 1, math.floor((loop.time() - start) / cfg.period_s) + 1)
                delay = start + slot * cfg.period_s - loop.time()
                if delay > 0:
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
                    # cancellation that lands as its timeout fires, and the task never ends.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._stop.wait()
            if cfg.deregister_on_stop:
                await self._deregister(client)
        finally:
            self._running = False
            await client.aclose()

    async def beat(self, client: aioredis.Redis) -> bool:
        """One beat: read the state, then SET + PUBLISH in one pipeline. True if Redis took it."""
        cfg = self.config
        # The sidecar's probe runs beside the state read: a beat waits for the slower, not both.
        probe = asyncio.create_task(self._sidecar_up(self.sidecar)) if self.sidecar is not None else None
        try:
            async with asyncio.timeout(cfg.state_timeout_s):
                state = await self.source.read()
        except Exception as exc:  # any failure of the engine side means: no new beat
            if probe is not None:
                await cancel_and_wait(probe)
            busy = isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError)
            held = busy and await self._hold_last_beat(client)
            self._state_outage.fail(
                "engine state unavailable for node %s at %s: %s; %s",
                cfg.node_id,
                cfg.state_endpoint,
                describe(exc) if not isinstance(exc, TimeoutError) else f"no answer in {cfg.state_timeout_s} s",
                f"the engine is busy: holding its last beat (stale, keep routing only) for up to {cfg.busy_hold_s:g} s"
                if held
                else f"not publishing, so {cfg.key} expires within {cfg.ttl_s * 1000:.0f} ms",
            )
            return False
        self._state_outage.ok(
            "engine state of node %(node)s readable again after %(after).2f s (%(failures)d failed reads)",
            node=cfg.node_id,
        )
        if probe is not None and not await probe:
            return False
        self.seq += 1
        payload = encode_heartbeat(build_heartbeat(cfg, state, self.seq, time.time(), self.kv_events))
        try:
            async with client.pipeline(transaction=False) as pipe:
                pipe.set(cfg.key, payload, px=cfg.ttl_ms)
                pipe.publish(REDIS_HEARTBEAT_CHANNEL, payload)
                await pipe.execute()
        except Exception as exc:  # never crash on Redis: log once per outage and retry next period
            self._redis_outage.fail(
                "redis unreachable at %s: %s; heartbeats of node %s are not published, retrying every %.0f ms",
                redact_url(cfg.redis_url),
                describe(exc),
                cfg.node_id,
                cfg.period_s * 1000,
            )
            return False
        self._redis_outage.ok(
            "redis at %(url)s answers again after %(after).2f s (%(failures)d failed beats): node %(node)s published",
            url=redact_url(cfg.redis_url),
            node=cfg.node_id,
        )
        self.published += 1
        self._last_payload = payload
        return True

    async def _hold_last_beat(self, client: aioredis.Redis) -> bool:
        """Keep the last beat's key alive, unchanged (same seq: the dispatcher sees the node go
        stale), while the engine has been timing out for under ``busy_hold_s``. True if held."""
        cfg = self.config
        since = self._state_outage.since
        if self._last_payload is None or (since is not None and time.monotonic() - since >= cfg.busy_hold_s):
            return False
        try:
            # Even after the key lapsed on a starved host: the dispatcher still holds the node as a
            # last resort with this very seq, so the same beat back changes nothing but the TTL.
            return bool(await client.set(cfg.key, self._last_payload, px=cfg.ttl_ms))
        except Exception:  # Redis trouble is the Redis outage's to report, at the next beat
            return False

    async def _sidecar_up(self, sidecar: SidecarProbe) -> bool:
        """Down when the sidecar refuses (or closes) at once, or has answered no probe for
        ``sidecar_hang_s``; a probe that times out within that is a busy loop, still up."""
        cfg = self.config
        try:
            async with asyncio.timeout(cfg.state_timeout_s):
                await sidecar.check()
        except (OSError, TimeoutError) as exc:
            now = time.monotonic()
            last = self._sidecar_answered
            if isinstance(exc, TimeoutError) and last is not None and now - last < cfg.sidecar_hang_s:
                return True
            self._sidecar_outage.fail(
                "sidecar of node %s at %s unreachable: %s; not publishing, so %s expires within %.0f ms",
                cfg.node_id,
                sidecar.hostport,
                describe(exc)
                if not isinstance(exc, TimeoutError)
                else f"no answer for {now - last:.2f} s"
                if last is not None
                else f"no answer in {cfg.state_timeout_s} s",
                cfg.key,
                cfg.ttl_s * 1000,
            )
            return False
        self._sidecar_answered = time.monotonic()
        self._sidecar_outage.ok(
            "sidecar of node %(node)s answers again after %(after).2f s (%(failures)d failed checks)",
            node=cfg.node_id,
        )
        return True

    async def _deregister(self, client: aioredis.Redis) -> None:
        if self._last_payload is None:
            return
        try:
            deleted = await _delete_if_holding(client, self.config.key, self._last_payload)
        except Exception as exc:  # best effort: the key expires anyway
            log.warning(
                "node %s: could not delete %s on shutdown (%s); it expires within %.0f ms",
                self.config.node_id,
                self.config.key,
                describe(exc),
                self.config.ttl_s * 1000,
            )
            return
        if deleted:
            log.info("node %s: heartbeat stopped, %s deleted", self.config.node_id, self.config.key)
        else:
            log.info(
                "node %s: heartbeat stopped; %s no longer held this publisher's beat",
                self.config.node_id,
                self.config.key,
            )


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
async def serve(config: PublisherConfig, stop: asyncio.Event) -> None:
    """Beat until ``stop`` is set, then stop after the current beat (and deregister)."""
    source = HttpStateSource(config.state_url or config.url, timeout_s=config.state_timeout_s)
    checked = config.check_sidecar and config.role == Role.DECODE
    publisher = HeartbeatPublisher(config, source, SidecarProbe(config.sidecar) if checked else None)
    stopping = asyncio.ensure_future(stop.wait())
    stopping.add_done_callback(lambda _: publisher.stop())
    try:
        await publisher.run()
    finally:
        stopping.cancel()
        await source.aclose()


SERVICE = Service(
    name="heartbeat",
    description="Publish this node's engine state to Redis every heartbeat period. Settings come from "
    "defaults < --config YAML (section 'heartbeat') < KAIROS_HEARTBEAT_* environment < flags.",
    source=SOURCE,
    serve=serve,
)
build_parser = SERVICE.parser
main = SERVICE.main


if __name__ == "__main__":
    sys.exit(main())
