"""The dispatcher's view of the cluster: the last heartbeat of every node, with the
dispatcher's own dispatches since that heartbeat applied on top.

Without the overlay every request arriving between two heartbeats would see the same queues
and herd onto the same "best" node; with it, a prefill queue grows by each prompt the moment
it is dispatched, and a decode node shows each deflection sent to it, which is what the
pending-deflection limit of §5.3 counts and what a new deflection is scheduled behind. Other
dispatcher replicas' deflections join the overlay too, as their promises in Redis tell them
(:meth:`ClusterTracker.set_foreign`; ``kairos.extproc.reservations``). A keep-path request
also shows on its decode node as incoming, from its dispatch until its predicted prefill end
(when the node starts pulling its KV, so its heartbeats show it): its prefill runs elsewhere for
seconds, far longer than a heartbeat period, and a burst of keeps would otherwise all pick the
same least-loaded decode node.

Keeps stay incoming for as long as their predicted prefill takes, which grows with the prefill
queues: under overload a node can have thousands in flight. They are held in a list sorted by
when they arrive, with running totals: a heartbeat cuts the arrived ones off its front, and a
node's state carries them in that order (the keep path's estimate queues their KV on the node's
link ahead of a new keep's).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TypeVar

from kairos.core.decision import Decision, Route
from kairos.core.latency import TransferModel
from kairos.core.state import ClusterView, DecodeNodeState, IncomingLink, PrefillNodeState, prompt_attention_tokens

S = TypeVar("S", PrefillNodeState, DecodeNodeState)


# Other dispatchers' promises one node holds in the view at most, until its next heartbeat: far
# more than replicas deflect onto one node in a heartbeat period, and a bound on what a flood of
# messages on the promise channel can make a view hold (each is also a linear check).
MAX_FOREIGN_PROMISES = 256


@dataclass(slots=True)
class _Dispatch:
    at: float  # when the node starts holding it: dispatch time, or a keep's predicted prefill end
    tokens: int  # prompt tokens sent
    foreign: bool = False  # another dispatcher's deflection, learnt from its promise
    promise: str = ""  # a foreign one's promise member: heard twice, it is counted once
    cached: int = 0  # prompt tokens the node has cached: computed already (a deflection's held in its KV)
    attention: float = 0.0  # a keep's on its prefill node: prompt_attention_tokens, worked out once
    tpot_s: float = math.inf  # a deflection's own TPOT SLO (inf: none), which it tightens the node's tau to


def _tpot_of(decision: Decision) -> float:
    """The TPOT SLO a dispatch holds its decode node to (inf: the decision read none)."""
    return math.inf if decision.slo is None else decision.slo.tpot_s


@dataclass(slots=True)
class _Incoming:
    """Keep-path requests on their way to one decode node, sorted by arrival: entries ``lo`` on
    of the lists (the ones before have arrived), with their tokens kept as a running total and how
    many hold each TPOT SLO (a few classes: their tightest is a min over a handful of keys). With
    the tracker's link model, also their KV's queue on the node's link in closed form (sums,
    departures, base: ``kairos.core.state.IncomingLink``), which a state carries as a window on
    these lists, not a copy: the lists only grow at the end (a keep that arrives after the last,
    the usual case, O(1)); anything else (a keep before the last, a new link model, a front grown
    long) starts new lists, so that a window a state holds never changes."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)
    tpot_list: list[float] = field(default_factory=list)  # each arrival's TPOT SLO, in the same order
    sums: list[float] = field(default_factory=list)
    departures: list[float] = field(default_factory=list)
    lo: int = 0  # the first not yet arrived
    base: float = 0.0  # sums[lo - 1]: the transfers of the arrived ones
    tokens: int = 0
    tpots: dict[float, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.arrivals) - self.lo

    def add(self, at: float, tokens: int, tpot_s: float = math.inf, link: TransferModel | None = None) -> None:
        self.tokens += tokens
        self.tpots[tpot_s] = self.tpots.get(tpot_s, 0) + 1
        arrivals, lo = self.arrivals, self.lo
        if self.count and (at, tokens) < arrivals[-1]:
            # Before the last (a keep to a shorter prefill queue): new lists, copied (C-level),
            # with it in place and the link worked out again from it on (usually a few keeps).
            i = bisect.bisect_right(arrivals, (at, tokens), lo) - lo
            self.arrivals = arrivals[lo:]
            self.arrivals.insert(i, (at, tokens))
            self.tpot_list = self.tpot_list[lo:]
            self.tpot_list.insert(i, tpot_s)
            self.lo = 0
            if link is not None and self.sums:
                self.sums, self.departures = self.sums[lo:], self.departures[lo:]
                self.sums.insert(i, 0.0)
                self.departures.insert(i, 0.0)
                self._link_from(i, link)
            elif link is not None:
                self._restart(list(zip(self.arrivals, self.tpot_list, strict=True)), link)
            return
        arrivals.append((at, tokens))
        self.tpot_list.append(tpot_s)
        if link is not None:
            x = link.seconds(tokens)
            last = len(arrivals) - 1
            self.sums.append((self.sums[-1] if last > self.lo else self.base) + x)
            self.departures.append(max(self.departures[-1] if last > self.lo else -math.inf, at) + x)

    def _link_from(self, i: int, link: TransferModel) -> None:
        """Sums and departures from entry ``i`` (of lists that start at the first not arrived) on."""
        total = self.sums[i - 1] if i else self.base
        free = self.departures[i - 1] if i else -math.inf
        for j in range(i, len(self.arrivals)):
            at, tokens = self.arrivals[j]
            x = link.seconds(tokens)
            total += x
            free = max(free, at) + x
            self.sums[j], self.departures[j] = total, free

    def _restart(self, live: list[tuple[tuple[float, int], float]], link: TransferModel | None) -> None:
        """New lists holding ``live`` ((arrival, tokens), TPOT) in order, their link worked out anew."""
        self.arrivals = [a for a, _ in live]
        self.tpot_list = [t for _, t in live]
        self.lo, self.base = 0, 0.0
        self.sums, self.departures = [], []
        if link is not None:
            total, free = 0.0, -math.inf
            for at, tokens in self.arrivals:
                x = link.seconds(tokens)
                total += x
                free = max(free, at) + x
                self.sums.append(total)
                self.departures.append(free)

    def relink(self, link: TransferModel | None) -> None:
        """The link's closed form under another transfer model (a profile reload), or none."""
        self._restart(list(zip(self.arrivals[self.lo :], self.tpot_list[self.lo :], strict=True)), link)

    def expire(self, horizon: float) -> None:
        """Drop the keeps that arrived by ``horizon`` (their KV shows among the node's pulls from
        then on). The departures after them stay as they were, computed with them: re-deriving
        them would walk every keep still on its way at every heartbeat. The closed form's max with
        the reported pulls hides the difference while the pulls clear no earlier than the link
        would have cleared those keeps (their own transfers are among the pulls)."""
        arrivals, tpots, lo = self.arrivals, self.tpots, self.lo
        gone = bisect.bisect_right(arrivals, (horizon, math.inf), lo)
        if gone == lo:
            return
        self.tokens -= sum(tokens for _, tokens in arrivals[lo:gone])
        for tpot in self.tpot_list[lo:gone]:
            left = tpots[tpot] - 1
            if left:
                tpots[tpot] = left
            else:
                del tpots[tpot]
        if self.sums:
            self.base = self.sums[gone - 1]
        self.lo = gone
        if gone > 256 and gone > self.count:  # the front outgrows the rest: new lists (old windows keep theirs)
            self.arrivals, self.tpot_list = arrivals[gone:], self.tpot_list[gone:]
            if self.sums:
                self.sums, self.departures = self.sums[gone:], self.departures[gone:]
            self.lo = 0

    def link(self) -> IncomingLink | None:
        """The closed form as a state carries it: a window on the lists (None without a link model)."""
        if not self.count or not self.sums:
            return None
        return IncomingLink(self.arrivals, self.sums, self.departures, self.base, self.lo, len(self.arrivals))

    @property
    def tightest_tpot_s(self) -> float:
        return min(self.tpots, default=math.inf)


@dataclass
class ClusterTracker:
    """Heartbeats plus own dispatches; ``view(now)`` is what a decision reads."""

    # A dispatch may reach its node after the next heartbeat was taken (network, sidecar hop):
    # keep it in the overlay until a heartbeat at least this much younger than it arrives.
    dispatch_grace_s: float = 0.0
    # The decode nodes' inbound link (the latency models' transfer model): with it, each node's
    # state carries its incoming keeps' queue on that link in closed form (incoming_link), which
    # the keep path's estimate reads; None: no such queue.
    link: TransferModel | None = None
    _prefill: dict[str, PrefillNodeState] = field(default_factory=dict)
    _decode: dict[str, DecodeNodeState] = field(default_factory=dict)
    _overlay: dict[str, list[_Dispatch]] = field(default_factory=dict)
    _incoming: dict[str, _Incoming] = field(default_factory=dict)  # keeps, by decode node
    # Each node's state with its overlay, rebuilt only when that node changes: a dispatch touches
    # one or two nodes, and every decision reads the view.
    _overlaid_prefill: dict[str, PrefillNodeState] = field(default_factory=dict)
    _overlaid_decode: dict[str, DecodeNodeState] = field(default_factory=dict)
    _cached: ClusterView | None = None

    def update_prefill(self, state: PrefillNodeState) -> None:
        self._prefill[state.node_id] = state
        self._expire(state.node_id, state.reported_at)

    def update_decode(self, state: DecodeNodeState) -> None:
        self._decode[state.node_id] = state
        self._expire(state.node_id, state.reported_at)

    def remove(self, node_id: str) -> None:
        """Forget a node (its heartbeat key expired: it is gone)."""
        self._prefill.pop(node_id, None)
        self._decode.pop(node_id, None)
        self._overlay.pop(node_id, None)
        self._incoming.pop(node_id, None)
        self._changed(node_id)

    def _changed(self, *node_ids: str) -> None:
        for node_id in node_ids:
            self._overlaid_prefill.pop(node_id, None)
            self._overlaid_decode.pop(node_id, None)
        self._cached = None

    def record(self, decision: Decision, now: float) -> object:
        """Account for a dispatch until a heartbeat shows it: the prefill work is the prompt's
        tokens the prefilling node has not cached (what its queue will report), the KV that
        joins a decode node on keep the whole prompt. A split is both: its first k tokens on the
        prefill node and their KV incoming to the decode node, as a keep of k tokens, and the rest
        in the decode node's backlog over those k, as a deflection (from now on, until a
        heartbeat after the KV's predicted landing: the node runs it ahead of the deflections
        routed since). The handle is what ``cancel`` takes back."""
        tokens = decision.prompt_tokens
        if decision.route is Route.DEFLECT:
            dispatch = _Dispatch(
                now, tokens - decision.cached_tokens, cached=decision.cached_tokens, tpot_s=_tpot_of(decision)
            )
            self._overlay.setdefault(decision.decode_node, []).append(dispatch)
            self._changed(decision.decode_node)
            return ((decision.decode_node, dispatch),)
        split = decision.route is Route.SPLIT
        if split:
            tokens = decision.split_tokens
        work = tokens - decision.cached_tokens
        assert decision.prefill_node is not None  # a keep or split decision always names its prefill node
        prefill = self._prefill.get(decision.prefill_node)
        attention = prompt_attention_tokens(work, decision.cached_tokens, prefill.chunk_tokens) if prefill else 0.0
        prefill_dispatch = _Dispatch(now, work, cached=decision.cached_tokens, attention=attention)
        self._overlay.setdefault(decision.prefill_node, []).append(prefill_dispatch)
        # Incoming until its prefill ends: from then on the node's heartbeat shows its KV
        # pull (pending_kv_pull_tokens), then the request itself.
        prefill_s = decision.predicted_prefill_end_s
        if prefill_s is None:
            prefill_s = decision.predicted_ttft_prefill_s or 0.0
        incoming = self._incoming.get(decision.decode_node)
        if incoming is None:
            incoming = self._incoming[decision.decode_node] = _Incoming()
        incoming.add(now + prefill_s, tokens, _tpot_of(decision), self.link)
        self._changed(decision.prefill_node, decision.decode_node)
        if not split:
            return None
        # In the backlog until a heartbeat after its KV's predicted landing can show it there.
        lands = (decision.predicted_ttft_decode_s or 0.0) - sum(decision.predicted_step_s)
        rest = _Dispatch(
            now + max(0.0, lands), decision.prompt_tokens - tokens, cached=tokens, tpot_s=_tpot_of(decision)
        )
        self._overlay.setdefault(decision.decode_node, []).append(rest)
        # A refused promise takes back both queues' work; the KV incoming stays until it would have
        # arrived (its link queue has no removal: rare, and on the safe side).
        return ((decision.decode_node, rest), (decision.prefill_node, prefill_dispatch))

    def relink(self, link: TransferModel | None) -> None:
        """Another transfer model (the profile was reloaded): every node's incoming keeps queue on
        their links by it from now on."""
        self.link = link
        for node_id, incoming in self._incoming.items():
            incoming.relink(link)
            self._changed(node_id)

    def cancel(self, handle: object) -> None:
        """Take back a deflection or split ``record`` returned ``handle`` for (its promise was refused)."""
        if handle is None:
            return
        for node_id, dispatch in handle:  # type: ignore[attr-defined]
            pending = self._overlay.get(node_id)
            if pending is not None:
                self._overlay[node_id] = [d for d in pending if d is not dispatch]
                self._changed(node_id)

    def set_foreign(self, node_id: str, promises: list[tuple[float, int, str]]) -> None:
        """Other dispatchers' deflections onto ``node_id`` that its heartbeat does not show yet,
        as (when, prompt tokens, promise member): they replace the ones known before, and leave
        the view as this dispatcher's own do, when a heartbeat shows them."""
        own = [d for d in self._overlay.get(node_id, ()) if not d.foreign]
        self._overlay[node_id] = own + [_Dispatch(at, tokens, True, promise) for at, tokens, promise in promises]
        self._changed(node_id)

    def add_foreign(self, node_id: str, at: float, tokens: int, promise: str) -> bool:
        """One more deflection of another dispatcher onto decode node ``node_id``, heard of at
        ``at``; False (and nothing added) for a node not in the view, a promise already known, or
        a node holding :data:`MAX_FOREIGN_PROMISES` already."""
        if node_id not in self._decode:
            return False
        pending = self._overlay.setdefault(node_id, [])
        heard = [d.promise for d in pending if d.foreign]
        if promise in heard or len(heard) >= MAX_FOREIGN_PROMISES:
            return False
        pending.append(_Dispatch(at, tokens, True, promise))
        self._changed(node_id)
        return True

    def foreign_tokens(self, node_id: str) -> int:
        """Prompt tokens of the other dispatchers' deflections onto ``node_id`` in the view."""
        return sum(d.tokens for d in self._overlay.get(node_id, ()) if d.foreign)

    def reported_at(self, node_id: str) -> float | None:
        """When ``node_id``'s heartbeat in the view was received (None: not in the view)."""
        state = self._decode.get(node_id) or self._prefill.get(node_id)
        return state.reported_at if state is not None else None

    def _expire(self, node_id: str, reported_at: float) -> None:
        horizon = reported_at - self.dispatch_grace_s
        pending = self._overlay.get(node_id)
        if pending:
            self._overlay[node_id] = [d for d in pending if d.at > horizon]
        incoming = self._incoming.get(node_id)
        if incoming is not None:
            incoming.expire(horizon)
        self._changed(node_id)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return (*self._prefill, *self._decode)

    def view(self) -> ClusterView:
        if self._cached is None:
            prefill = tuple(self._overlaid(self._overlaid_prefill, self._prefill, self._with_overlay_prefill))
            decode = tuple(self._overlaid(self._overlaid_decode, self._decode, self._with_overlay_decode))
            self._cached = ClusterView(prefill=prefill, decode=decode)
        return self._cached

    @staticmethod
    def _overlaid(cache: dict[str, S], reported: dict[str, S], overlay: Callable[[S], S]) -> Iterator[S]:
        """Each reported state with its overlay, from ``cache`` unless its node changed since."""
        for node_id, state in reported.items():
            overlaid = cache.get(node_id)
            if overlaid is None:
                overlaid = cache[node_id] = overlay(state)
            yield overlaid

    def _with_overlay_prefill(self, s: PrefillNodeState) -> PrefillNodeState:
        extra = self._overlay.get(s.node_id)
        if not extra:
            return s
        added = sum(d.tokens for d in extra)
        return replace(
            s,
            queue_length=s.queue_length + len(extra),
            outstanding_tokens=s.outstanding_tokens + added,
            squared_tokens=s.squared_tokens + sum(d.tokens * d.tokens for d in extra),
            attention_tokens=s.attention_tokens + sum(d.attention for d in extra),
            overlay_tokens=s.overlay_tokens + added,
        )

    def _with_overlay_decode(self, s: DecodeNodeState) -> DecodeNodeState:
        extra = self._overlay.get(s.node_id)
        incoming = self._incoming.get(s.node_id)
        keeps, keep_tokens = (incoming.count, incoming.tokens) if incoming is not None else (0, 0)
        if not extra and not keeps:
            return s
        extra = extra or []
        computed = s.prefill_backlog_computed_tokens
        prefixes = sum(d.cached for d in extra)
        if prefixes:  # a dispatched deflection's cached prefix: computed already, its KV held from now on
            computed = (
                computed + (0,) * (len(s.prefill_backlog_tokens) - len(computed)) + tuple(d.cached for d in extra)
            )
        tpot = min(min((d.tpot_s for d in extra), default=math.inf), incoming.tightest_tpot_s if incoming else math.inf)
        if s.tpot_slo_s is not None:
            tpot = min(tpot, s.tpot_slo_s)
        return replace(
            s,
            tpot_slo_s=None if tpot == math.inf else tpot,
            kv_tokens=s.kv_tokens + prefixes,
            prefill_backlog_tokens=s.prefill_backlog_tokens + tuple(d.tokens for d in extra),
            overlay_backlog=s.overlay_backlog + len(extra),
            prefill_backlog_computed_tokens=computed,
            incoming_keeps=s.incoming_keeps + keeps,
            incoming_keep_tokens=s.incoming_keep_tokens + keep_tokens,
            incoming_link=incoming.link() if incoming is not None and keeps else s.incoming_link,
        )
