"""Which nodes the dispatcher routes on: the membership rules, pure and clock-free.

:class:`Membership` takes what one Redis poll returned (each heartbeat key's node id and raw
value) or the fact that the poll failed, with the poll's ``now``, and answers with the view it
feeds into the :class:`~kairos.core.view.ClusterTracker` and the :data:`Event` list of what
changed. It does no I/O and reads no clock, so every rule is a table-driven unit test; the Redis
poller (:mod:`kairos.extproc.cluster`) only fetches, feeds and logs.

The rules (design principle 6):

* A heartbeat with a new ``(seq, sent_at)`` refreshes its node, stamped ``now`` (the receiver's
  clock: the publisher's clock never matters). The same beat again keeps aging; a node with no
  new beat for ``stale_after_s`` is stale (kept for keep routing, never deflected to). The beat
  a node left the view with, back in its key (a busy engine's publisher holds its last beat, and
  a starved host lets the key lapse between two holds), rejoins it with its old stamp: never
  fresh on state that old.
* A key gone from Redis (expired: the node or its engine died) removes the node, except:
  - during the **recovery grace** (``recovery_grace_s`` after Redis answers again following an
    outage, or for the first time after the static fallback), when publishers are re-publishing
    into an empty Redis and the view should not flash empty;
  - as a **last resort**: when every key of a role is gone at once (a starved host or a stalled
    agent is likelier than every node dying together), those nodes stay, stale, for up to
    ``last_resort_s`` after their last beat; and for as long as Redis holds **no heartbeat at
    all**: every role's keys gone at once is a fault of Redis (full and refusing writes, flushed,
    its writers locked out) far likelier than every node dying together, and the nodes that serve
    must not leave the view for it. The first heartbeat back starts the recovery grace.
* A **malformed** value keeps the node's last good state (aging) until it is
  ``forget_malformed_after_s`` old, then the node leaves as if its key had expired. A node that
  reports another **role** than before leaves and joins again as the new role.
* A well-formed heartbeat that **does not match** what its key's publisher may say is rejected
  like a malformed one (:func:`check_heartbeat`): its ``node_id`` must be its key's (Redis ACLs
  give each node's credential its own key only, so this binds the content to the credential);
  with ``admit_nodes="listed"`` only the nodes of the static node lists join, each with the
  role and addresses listed. Each distinct rejected value
  is counted once by :class:`RejectReason` (``kairos_dispatcher_heartbeats_rejected_total`` and
  ``/nodes``), so a forged key held still counts once, a forger racing the real publisher once
  per forgery.
* A node whose heartbeat advertises its **KV event sockets** (vLLM's ``--kv-events-config``)
  is in :meth:`Membership.kv_event_endpoints` while it is in the view, at the sockets its last
  valid beat advertised: the dispatcher subscribes to exactly those (a node that leaves, or
  advertises other sockets, is unsubscribed and its prefix index dropped or started over).
* Redis **unreachable** after it had answered: ``degraded``; the last view stays as it is and
  ages (so it turns stale: keep routing only). Redis unreachable **since start**: the view is the
  config's **static node lists**, refreshed at every failed poll, with zero load and, on decode
  nodes, a KV capacity of 0 so that no prompt fits: plain P/D routing, never a deflection. So is
  Redis that answers but holds no heartbeat while the view holds none from it (a dispatcher
  restarted while Redis is full or flushed): it cannot tell who serves, the lists can.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

from kairos.common import defaults
from kairos.common.config import check_hostport, setting
from kairos.common.contracts import (
    HEARTBEAT_TTL_S,
    Heartbeat,
    HeartbeatField,
    MalformedHeartbeat,
    Role,
    parse_heartbeat,
)
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KvEventEndpoints, KvEventsConfig
from kairos.core.state import DecodeNodeState, PrefillNodeState
from kairos.core.view import ClusterTracker


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
class StaticNode(NamedTuple):
    """A node of the static fallback lists."""

    node_id: str
    role: Role
    url: str  # host:port of the node's vLLM server
    sidecar: str  # host:port of the decode sidecar ("" on prefill nodes)


def parse_static_node(role: Role, entry: str) -> StaticNode:
    """A fallback list entry: ``p0=127.0.0.1:8001`` (prefill: its vLLM server); ``d0=127.0.0.1:8201``
    (decode: the sidecar the dispatcher routes to) or ``d0=127.0.0.1:8101+127.0.0.1:8201`` (decode:
    its vLLM server, then its sidecar)."""
    node_id, sep, rest = (x.strip() for x in entry.partition("="))
    if not sep or not node_id:
        raise ConfigError(f"fallback {role} node {entry!r}: expected id=host:port")
    if role is Role.PREFILL:
        url, sidecar = rest, ""
        check_hostport(f"fallback prefill node {node_id} url", url)
    else:
        url, plus, sidecar = (x.strip() for x in rest.partition("+"))
        if not plus:
            url, sidecar = "", rest
        elif url:
            check_hostport(f"fallback decode node {node_id} url", url)
        check_hostport(f"fallback decode node {node_id} sidecar", sidecar)
    return StaticNode(node_id, role, url, sidecar)


ADMIT_NODES = ("any", "listed")  # MembershipConfig.admit_nodes


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """The membership rules' time limits (seconds), the static node lists and who is admitted."""

    # The decider's value too (DeciderConfig.stale_after_s: the dispatcher's one setting sets both).
    stale_after_s: float = setting(
        defaults.STALE_AFTER_S,
        help="a node whose heartbeat has not changed for this long is stale: no deflection to it",
    )
    # Publishers need up to one period to re-publish into a restarted, empty Redis.
    recovery_grace_s: float = setting(
        HEARTBEAT_TTL_S, help="after Redis answers again following an outage, nodes whose keys are gone stay this long"
    )
    forget_malformed_after_s: float = setting(
        HEARTBEAT_TTL_S,
        help="a node whose heartbeat breaks the contract keeps its last good state this long, then leaves",
    )
    last_resort_s: float = setting(
        30.0, help="when every key of a role is gone at once, its nodes stay, stale, this long after their last beat"
    )
    fallback_prefill: tuple[str, ...] = setting(
        (), help="id=host:port of each prefill vLLM, comma-separated: used only before Redis first answers"
    )
    fallback_decode: tuple[str, ...] = setting(
        (),
        help="id=sidecar_host:port or id=vllm_host:port+sidecar_host:port of each decode node, comma-separated: "
        "used only before Redis first answers",
    )
    # kairos up and compose: the gateway knows its nodes.
    admit_nodes: str = setting(
        "any",
        help="any: a heartbeat of a node the lists do not name joins (the lists are a fallback only); "
        "listed: only listed nodes join, with their listed role and addresses",
    )

    def __post_init__(self) -> None:
        if self.admit_nodes not in ADMIT_NODES:
            raise ConfigError(f"admit_nodes must be one of {list(ADMIT_NODES)}, got {self.admit_nodes!r}")
        if self.admit_nodes == "listed" and not (self.fallback_prefill or self.fallback_decode):
            raise ConfigError("admit_nodes='listed' needs the node lists (fallback_prefill, fallback_decode)")
        if not self.stale_after_s > 0:
            raise ConfigError(f"stale_after_s must be > 0, got {self.stale_after_s}")
        for name in ("recovery_grace_s", "forget_malformed_after_s", "last_resort_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        ids = [n.node_id for n in self.static_nodes()]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ConfigError(f"fallback node ids must be unique, repeated: {dupes}")

    def static_nodes(self) -> tuple[StaticNode, ...]:
        return tuple(parse_static_node(Role.PREFILL, e) for e in self.fallback_prefill) + tuple(
            parse_static_node(Role.DECODE, e) for e in self.fallback_decode
        )


class RejectReason(StrEnum):
    """Why a heartbeat value was ignored (the label of ``kairos_dispatcher_heartbeats_rejected_total``)."""

    MALFORMED = "malformed"  # breaks the heartbeat contract
    KEY_MISMATCH = "key_mismatch"  # its node_id is not its key's
    UNKNOWN_NODE = "unknown_node"  # admit_nodes="listed" and the lists do not name it
    ROLE_MISMATCH = "role_mismatch"  # a listed node reporting another role
    ADDRESS_MISMATCH = "address_mismatch"  # a listed node reporting another url or sidecar


class Rejection(NamedTuple):
    reason: RejectReason
    detail: str


def check_heartbeat(
    key_node_id: str, hb: Heartbeat, listed: Mapping[str, StaticNode], admit_nodes: str = "any"
) -> Rejection | None:
    """None if the heartbeat read from ``key_node_id``'s key may be taken; else why not.

    Its node_id must be its key's. With ``admit_nodes="listed"``, ``listed`` (the nodes the
    config names: id -> :class:`StaticNode`) must name it with the role and addresses it reports;
    an address the listing leaves empty (a decode node listed by its sidecar only) is not checked.
    With ``"any"`` the lists are a fallback only and say nothing about who may join."""
    if hb.node_id != key_node_id:
        return Rejection(RejectReason.KEY_MISMATCH, f"node_id {hb.node_id!r} in the key of {key_node_id!r}")
    if admit_nodes != "listed":
        return None
    expected = listed.get(hb.node_id)
    if expected is None:
        return Rejection(RejectReason.UNKNOWN_NODE, f"{hb.node_id!r} is not a listed node")
    if hb.role is not expected.role:
        return Rejection(RejectReason.ROLE_MISMATCH, f"reports role {hb.role}, listed as {expected.role}")
    for name, got, want in (("url", hb.url, expected.url), ("sidecar", hb.sidecar, expected.sidecar)):
        if want and got != want:
            return Rejection(RejectReason.ADDRESS_MISMATCH, f"reports {name} {got!r}, listed as {want!r}")
    return None


def advertised_kv_events(hb: Heartbeat) -> KvEventEndpoints | None:
    """Where ``hb``'s node publishes its KV cache events (None: it advertises none)."""
    if hb.kv_events_endpoint is None:
        return None
    topic = KvEventsConfig().topic if hb.kv_events_topic is None else hb.kv_events_topic  # vLLM's default
    return KvEventEndpoints(hb.kv_events_endpoint, hb.kv_events_replay_endpoint, topic)


class NodeAddress(NamedTuple):
    """Where a node is reached; the dispatcher routes to ``sidecar`` and names ``url`` of the
    prefill node in the keep header."""

    role: Role
    url: str
    sidecar: str
    model: str


# ---------------------------------------------------------------------------------------------
# Events: what changed, for the poller to log and count
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class NodeJoined:
    heartbeat: Heartbeat


@dataclass(frozen=True, slots=True)
class NodeLeft:
    node_id: str
    role: Role
    reason: str


@dataclass(frozen=True, slots=True)
class HeartbeatMalformed:
    """First malformed value of a node (reported once until it is valid again)."""

    node_id: str
    error: str


@dataclass(frozen=True, slots=True)
class HeartbeatRejected:
    """A heartbeat value was ignored (once per distinct value of a key): count it."""

    node_id: str  # the key's node id
    reason: RejectReason
    detail: str


@dataclass(frozen=True, slots=True)
class HeartbeatValidAgain:
    node_id: str
    seq: int


@dataclass(frozen=True, slots=True)
class LastResortKept:
    """Every heartbeat of ``role`` expired at once; its nodes stay, stale (reported once)."""

    role: Role
    keep_s: float


@dataclass(frozen=True, slots=True)
class HeartbeatsGone:
    """Redis answers but holds no heartbeat at all: the view's nodes stay, stale (reported once)."""

    prefill_nodes: int
    decode_nodes: int
    stale_after_s: float


@dataclass(frozen=True, slots=True)
class HeartbeatsBack:
    """The first heartbeat after Redis held none; the recovery grace starts."""

    after_s: float


@dataclass(frozen=True, slots=True)
class RedisLost:
    """The first failed poll of an outage."""

    ever_connected: bool  # False: no heartbeat seen yet since start
    prefill_nodes: int  # nodes in the view now (the last view, or the static lists)
    decode_nodes: int
    stale_after_s: float
    empty: bool = False  # Redis answers, but with no heartbeat (the static lists stand in)


@dataclass(frozen=True, slots=True)
class RedisBack:
    """The first successful poll after an outage (or after the static fallback)."""

    after_s: float
    failed_polls: int
    again: bool  # False: the first answer since start
    leaving_static: bool
    empty: bool = False  # its last polls were answered, with no heartbeat


Event = (
    NodeJoined
    | NodeLeft
    | HeartbeatMalformed
    | HeartbeatRejected
    | HeartbeatValidAgain
    | LastResortKept
    | HeartbeatsGone
    | HeartbeatsBack
    | RedisLost
    | RedisBack
)


@dataclass(slots=True)
class _Node:
    """What membership remembers of a node between polls."""

    role: Role
    seq: int
    sent_at: float
    reported_at: float  # poll time when this (seq, sent_at) was first seen
    from_redis: bool  # False for a static fallback node
    beat: Heartbeat | None = None  # the last valid heartbeat (None for a static fallback node)
    raw: bytes | str | None = None  # the key's value that ``beat`` was parsed from


def _tpot_slo_s(hb: Heartbeat) -> float | None:
    """A decode node's tightest TPOT in flight. Nodes report it while they hold any request (the
    emulated node, the vLLM plugin); absent on an idle node, none. Absent on a node that holds
    requests, it is one older than the field, which neither reports its requests' TPOTs nor
    tightens a carried budget by them: its requests hold the cluster's default, so a looser
    request never plans its steps looser than that."""
    if hb.tpot_slo_ms is not None:
        return hb.tpot_slo_ms / 1e3
    holds_any = (
        hb.decode_tokens
        or hb.kv_tokens
        or hb.queued_prefill_tokens
        or hb.scheduled_prefill_tokens
        or hb.pending_kv_pull_tokens
        or hb.running_requests
        or hb.waiting_requests
    )
    return defaults.TBT_SLO_S if holds_any else None


# ---------------------------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------------------------
@dataclass
class Membership:
    """The nodes in the view, kept by the rules above; feeds ``tracker`` with their states."""

    config: MembershipConfig = field(default_factory=MembershipConfig)
    tracker: ClusterTracker = field(default_factory=ClusterTracker)
    degraded: bool = False  # the last poll failed after Redis had answered, or Redis never answered
    static_fallback: bool = False  # the view is the static lists (Redis never answered)
    _nodes: dict[str, _Node] = field(default_factory=dict)
    _addresses: dict[str, NodeAddress] = field(default_factory=dict)
    _decode_sidecars: tuple[str, ...] | None = None  # sorted; None: to be derived from _addresses again
    _malformed: set[str] = field(default_factory=set)  # nodes whose key holds a malformed or rejected value
    _rejected_raw: dict[str, bytes | str] = field(default_factory=dict)  # key's node id -> last rejected value
    _rejecting: dict[str, RejectReason] = field(default_factory=dict)  # key's node id -> why its value is ignored
    rejected: Counter[RejectReason] = field(default_factory=Counter)  # distinct rejected values since start
    _last_resort: set[Role] = field(default_factory=set)  # roles kept as a last resort
    _ever_connected: bool = False
    _recovered_at: float | None = None  # start of the recovery grace
    _outage_since: float | None = None
    _outage_failures: int = 0
    _outage_empty: bool = False  # the outage's last poll was answered with no heartbeat
    _gone_since: float | None = None  # Redis answered with no heartbeat at all since (the view kept)
    _listed: dict[str, StaticNode] = field(default_factory=dict)
    # Of each node that left the view: its last beat's (seq, sent_at) and when that was first seen.
    _left: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    _kv_events: dict[str, KvEventEndpoints] = field(default_factory=dict)
    kv_events_version: int = 0  # +1 whenever kv_event_endpoints() changes
    # Of the last successful poll: how many new heartbeats it applied, and the earliest sent_at
    # among them (the node's clock: for the read-delay metric only, never for a rule).
    new_beats: int = 0
    oldest_new_sent_at: float | None = None

    def __post_init__(self) -> None:
        self._listed = {n.node_id: n for n in self.config.static_nodes()}

    # -- reading -----------------------------------------------------------------------------
    def addresses(self) -> Mapping[str, NodeAddress]:
        """node_id -> address of every node in the view (read-only, live)."""
        return MappingProxyType(self._addresses)

    def decode_sidecars(self) -> tuple[str, ...]:
        """The decode nodes' sidecars, sorted, without duplicates: derived again only after an
        address changed, not on every request that names a fallback."""
        if self._decode_sidecars is None:
            self._decode_sidecars = tuple(
                sorted({a.sidecar for a in self._addresses.values() if a.role == Role.DECODE and a.sidecar})
            )
        return self._decode_sidecars

    def _set_address(self, node_id: str, address: NodeAddress | None) -> None:
        if _put(self._addresses, node_id, address):
            self._decode_sidecars = None

    def kv_event_endpoints(self) -> Mapping[str, KvEventEndpoints]:
        """node_id -> its KV event sockets, for every node in the view that advertises them
        (read-only, live; :attr:`kv_events_version` says when it changed)."""
        return MappingProxyType(self._kv_events)

    def _set_kv_events(self, node_id: str, endpoints: KvEventEndpoints | None) -> None:
        if _put(self._kv_events, node_id, endpoints):
            self.kv_events_version += 1

    def recovering(self, now: float) -> bool:
        """Within the recovery grace: nodes missing from Redis are not removed yet."""
        return self._recovered_at is not None and now - self._recovered_at < self.config.recovery_grace_s

    @property
    def heartbeats_gone(self) -> bool:
        """Redis answers but held no heartbeat at the last poll; the view is kept as it was."""
        return self._gone_since is not None

    def is_stale(self, node_id: str, now: float) -> bool:
        return now - self._nodes[node_id].reported_at > self.config.stale_after_s

    def stale_node_ids(self, now: float) -> tuple[str, ...]:
        """Nodes with no new heartbeat for ``stale_after_s`` (not deflection targets)."""
        return tuple(i for i in self._nodes if self.is_stale(i, now))

    def report(self, now: float) -> dict[str, Any]:
        """Every node with its role, heartbeat age and staleness, a decode node's sidecar
        (host:port, where ``kairos top`` reads its per-class SLO counters), the load its last
        heartbeat reported (the heartbeat's field names; absent for a static fallback node), and
        the view's status (the dispatcher's ``GET /nodes``)."""
        nodes = [
            {
                "id": node_id,
                "role": str(node.role),
                "age_s": round(max(0.0, now - node.reported_at), 3),
                "stale": self.is_stale(node_id, now),
                "from_redis": node.from_redis,
                **_sidecar_of(self._addresses.get(node_id)),
                **(_load_of(node.beat) if node.beat is not None else {}),
            }
            for node_id, node in sorted(self._nodes.items())
        ]
        status = "degraded" if self.degraded else "ok"
        return {
            "status": status,
            "static_fallback": self.static_fallback,
            "nodes": nodes,
            "rejected_heartbeats": {str(r): self.rejected[r] for r in RejectReason},
            "rejecting": [{"id": i, "reason": str(r)} for i, r in sorted(self._rejecting.items())],
        }

    def oldest_beat_age(self, now: float) -> float | None:
        """Seconds since the oldest heartbeat in the view was received (static nodes aside)."""
        received = [n.reported_at for n in self._nodes.values() if n.from_redis]
        return now - min(received) if received else None

    def counts(self) -> tuple[int, int]:
        """(prefill, decode) nodes in the view."""
        roles = [n.role for n in self._nodes.values()]
        return roles.count(Role.PREFILL), roles.count(Role.DECODE)

    # -- a poll ------------------------------------------------------------------------------
    def poll_failed(self, now: float) -> list[Event]:
        """Redis did not answer this poll."""
        self.degraded = True
        self._outage_failures += 1
        self._outage_empty = False
        first = self._outage_since is None
        if first:
            self._outage_since = now
        if not self._ever_connected:
            self._apply_static(now)
        if not first:
            return []
        prefill, decode = self.counts()
        return [RedisLost(self._ever_connected, prefill, decode, self.config.stale_after_s)]

    def poll_succeeded(self, beats: Iterable[tuple[str, bytes | str | None]], now: float) -> list[Event]:
        """Redis answered with ``(node_id, raw heartbeat)`` for each key it holds; ``None`` for a
        key that expired between its SCAN and its read."""
        beats = list(beats)
        if self._static_instead(beats):
            return self._poll_without_heartbeats(now)
        events: list[Event] = []
        if self._outage_since is not None:
            events.append(
                RedisBack(
                    now - self._outage_since,
                    self._outage_failures,
                    self._ever_connected,
                    self.static_fallback,
                    self._outage_empty,
                )
            )
            self._recovered_at = now
        self._outage_since, self._outage_failures, self._outage_empty = None, 0, False
        self._ever_connected = True
        self.degraded = self.static_fallback = False
        self.new_beats, self.oldest_new_sent_at = 0, None

        seen: set[str] = set()
        for node_id, raw in beats:
            if raw is None:
                continue
            seen.add(node_id)
            node = self._nodes.get(node_id)
            if node is not None and node.raw == raw and node_id not in self._malformed:
                # The value an earlier poll applied: the same beat, which keeps aging. Skipping
                # the parse halves a poll's cost (two polls per heartbeat period; 1,000 nodes).
                continue
            try:
                hb = parse_heartbeat(raw)
                rejection = check_heartbeat(node_id, hb, self._listed, self.config.admit_nodes)
            except MalformedHeartbeat as exc:
                rejection = Rejection(RejectReason.MALFORMED, str(exc))
            if rejection is not None:
                events.extend(self._reject(node_id, raw, rejection, now))
                continue
            self._rejected_raw.pop(node_id, None)
            self._rejecting.pop(node_id, None)
            events.extend(self._beat(hb, raw, now))
        self._malformed &= seen
        for gone in set(self._rejecting) - seen:
            del self._rejecting[gone]
            self._rejected_raw.pop(gone, None)
        if not seen and self.config.last_resort_s > 0 and any(n.from_redis for n in self._nodes.values()):
            if self._gone_since is None:  # every role's last resort, with no time bound
                self._gone_since = now
                events.append(HeartbeatsGone(*self.counts(), self.config.stale_after_s))
            return events
        if self._gone_since is not None:
            events.append(HeartbeatsBack(now - self._gone_since))
            self._gone_since = None
            self._recovered_at = now  # the other publishers are re-publishing
        events.extend(self._absent(seen, now))
        return events

    def _static_instead(self, beats: list[tuple[str, bytes | str | None]]) -> bool:
        """Redis holds no heartbeat and the view none from it: the static lists stand in."""
        return (
            bool(self._listed)
            and all(raw is None for _, raw in beats)
            and not any(n.from_redis for n in self._nodes.values())
        )

    def _poll_without_heartbeats(self, now: float) -> list[Event]:
        """An answer with no heartbeat while the view holds none from Redis: the static lists,
        degraded, as while Redis is unreachable since start, until a heartbeat shows up."""
        self.degraded = True
        self._outage_failures += 1
        self._outage_empty = True
        self.new_beats, self.oldest_new_sent_at = 0, None
        self._malformed.clear()  # every key is gone, the ones that held bad values too
        self._rejecting.clear()
        self._rejected_raw.clear()
        self._apply_static(now)
        if self._outage_since is not None:
            return []
        self._outage_since = now
        prefill, decode = self.counts()
        return [RedisLost(self._ever_connected, prefill, decode, self.config.stale_after_s, empty=True)]

    def _beat(self, hb: Heartbeat, raw: bytes | str, now: float) -> list[Event]:
        events: list[Event] = []
        if hb.node_id in self._malformed:
            self._malformed.discard(hb.node_id)
            events.append(HeartbeatValidAgain(hb.node_id, hb.seq))
        node = self._nodes.get(hb.node_id)
        if node is not None and node.from_redis and (node.seq, node.sent_at) == (hb.seq, hb.sent_at):
            node.raw = raw
            return events  # the same beat as last poll: it keeps aging
        if node is not None and node.role != hb.role:
            events.append(self._remove(hb.node_id, f"it now reports role {hb.role}"))
            node = None
        new, reported_at = True, now
        if node is None or not node.from_redis:
            events.append(NodeJoined(hb))
            left = self._left.pop(hb.node_id, None)
            if left is not None and left[:2] == (hb.seq, hb.sent_at):
                # The beat it left with: not news; it keeps aging from when it was new.
                new, reported_at = False, left[2]
        self._nodes[hb.node_id] = _Node(hb.role, hb.seq, hb.sent_at, reported_at, from_redis=True, beat=hb, raw=raw)
        if new:
            self.new_beats += 1
            if self.oldest_new_sent_at is None or hb.sent_at < self.oldest_new_sent_at:
                self.oldest_new_sent_at = hb.sent_at
        self._set_address(hb.node_id, NodeAddress(hb.role, hb.url, hb.sidecar, hb.model))
        self._set_kv_events(hb.node_id, advertised_kv_events(hb))
        if hb.role is Role.PREFILL:
            self.tracker.update_prefill(
                PrefillNodeState.from_queue(
                    hb.node_id,
                    hb.queued_prefill_tokens,
                    hb.max_step_tokens,
                    reported_at=reported_at,
                    computed_tokens=hb.queued_prefill_computed_tokens or (),
                    running_step_elapsed_s=hb.running_step_elapsed_s,
                )
            )
        else:
            self.tracker.update_decode(
                DecodeNodeState(
                    hb.node_id,
                    hb.decode_tokens,
                    hb.kv_tokens,
                    hb.kv_capacity_tokens,
                    reported_at=reported_at,
                    prefill_backlog_tokens=hb.scheduled_prefill_tokens,
                    prefill_backlog_computed_tokens=hb.scheduled_prefill_computed_tokens or (),
                    # Not reported (a node older than the field): 1.0, the model taken as it is.
                    step_calibration=1.0 if hb.step_calibration is None else hb.step_calibration,
                    pending_kv_pull_tokens=hb.pending_kv_pull_tokens or (),
                    tpot_slo_s=_tpot_slo_s(hb),
                    running_step_elapsed_s=hb.running_step_elapsed_s,
                    running_kv_pull_elapsed_s=hb.running_kv_pull_elapsed_s,
                )
            )
        return events

    def _reject(self, node_id: str, raw: bytes | str, rejection: Rejection, now: float) -> list[Event]:
        """Ignore the value (the node keeps its last good state, as with a malformed one); count
        it once per distinct value."""
        events: list[Event] = []
        if self._rejected_raw.get(node_id) != raw:
            self._rejected_raw[node_id] = raw
            self.rejected[rejection.reason] += 1
            events.append(HeartbeatRejected(node_id, rejection.reason, rejection.detail))
        self._rejecting[node_id] = rejection.reason
        reason, detail = rejection
        error = detail if reason is RejectReason.MALFORMED else f"{reason}: {detail}"
        return events + self._malformed_beat(node_id, error, now)

    def _malformed_beat(self, node_id: str, error: str, now: float) -> list[Event]:
        events: list[Event] = []
        if node_id not in self._malformed:
            self._malformed.add(node_id)
            events.append(HeartbeatMalformed(node_id, error))
        node = self._nodes.get(node_id)
        if node is not None and now - node.reported_at >= self.config.forget_malformed_after_s:
            events.append(self._remove(node_id, f"no valid heartbeat for {now - node.reported_at:.2f} s"))
        return events

    def _absent(self, seen: set[str], now: float) -> list[Event]:
        """Apply the rules to the nodes whose key is gone."""
        events: list[Event] = []
        missing = [i for i in self._nodes if i not in seen]
        if not self.recovering(now):
            roles_seen = {self._nodes[i].role for i in seen if i in self._nodes}
            for node_id in missing:
                node = self._nodes[node_id]
                last_resort = node.from_redis and node.role not in roles_seen
                if last_resort and now - node.reported_at < self.config.last_resort_s:
                    if node.role not in self._last_resort:
                        self._last_resort.add(node.role)
                        events.append(LastResortKept(node.role, self.config.last_resort_s))
                    continue
                reason = "its heartbeat key expired" if node.from_redis else "it is a static node and redis now answers"
                events.append(self._remove(node_id, reason))
        self._last_resort &= {self._nodes[i].role for i in self._nodes if i not in seen}
        return events

    def _remove(self, node_id: str, reason: str) -> NodeLeft:
        node = self._nodes.pop(node_id)
        if node.from_redis:
            self._left[node_id] = (node.seq, node.sent_at, node.reported_at)
        self._set_address(node_id, None)
        self._set_kv_events(node_id, None)
        self.tracker.remove(node_id)
        return NodeLeft(node_id, node.role, reason)

    def _apply_static(self, now: float) -> None:
        """Static fallback (Redis never answered): zero load, fresh every poll, never deflectable."""
        for n in self.config.static_nodes():
            self._nodes[n.node_id] = _Node(n.role, -1, math.nan, now, from_redis=False)
            self._set_address(n.node_id, NodeAddress(n.role, n.url, n.sidecar, ""))
            if n.role is Role.PREFILL:
                # chunk_tokens is unknown; 1 token per step keeps the field valid and is never used
                # to choose between static nodes, which all have the same (empty) queue.
                self.tracker.update_prefill(PrefillNodeState(n.node_id, 0, 0, 0, chunk_tokens=1, reported_at=now))
            else:
                # kv_capacity_tokens=0: no prompt fits, so the decision core never deflects here.
                self.tracker.update_decode(DecodeNodeState(n.node_id, 0, 0, 0, reported_at=now))
        self.static_fallback = bool(self._nodes)


def _sidecar_of(address: NodeAddress | None) -> dict[str, str]:
    return {HeartbeatField.SIDECAR: address.sidecar} if address is not None and address.sidecar else {}


def _load_of(hb: Heartbeat) -> dict[str, Any]:
    """A heartbeat's load fields for ``/nodes``: the prefill lists as token totals; the optional
    engine figures only when the node reports them."""
    f = HeartbeatField
    load: dict[str, Any] = {
        f.DECODE_TOKENS: hb.decode_tokens,
        f.KV_TOKENS: hb.kv_tokens,
        f.KV_CAPACITY_TOKENS: hb.kv_capacity_tokens,
        f.QUEUED_PREFILL_TOKENS: sum(hb.queued_prefill_tokens),
        f.SCHEDULED_PREFILL_TOKENS: sum(hb.scheduled_prefill_tokens),
    }
    optional = {
        f.RUNNING_REQUESTS: hb.running_requests,
        f.WAITING_REQUESTS: hb.waiting_requests,
        f.KV_USAGE: hb.kv_usage,
        f.STEP_CALIBRATION: hb.step_calibration,
    }
    load.update({name: value for name, value in optional.items() if value is not None})
    return load


V = TypeVar("V")


def _put(mapping: dict[str, V], key: str, value: V | None) -> bool:
    """``mapping[key] = value`` (None: no entry); whether that changed anything."""
    if mapping.get(key) == value:
        return False
    if value is None:
        del mapping[key]
    else:
        mapping[key] = value
    return True
