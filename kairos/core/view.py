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
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState, prompt_attention_tokens

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
    """Keep-path requests on their way to one decode node: (arrival, tokens) sorted by arrival,
    each one's TPOT SLO beside it, with their tokens kept as a running total, and how many hold
    each TPOT SLO (a few classes: their tightest is a min over a handful of keys). Lists kept
    sorted rather than a heap: a state carries the arrivals in that order (the keep path's
    estimate queues their KV on the node's link), one C-level copy of ``arrivals``, and an
    insertion's memmove costs less than that copy."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)
    tpot_list: list[float] = field(default_factory=list)  # each arrival's TPOT SLO, in the same order
    tokens: int = 0
    tpots: dict[float, int] = field(default_factory=dict)

    def add(self, at: float, tokens: int, tpot_s: float = math.inf) -> None:
        i = bisect.bisect_right(self.arrivals, (at, tokens))
        self.arrivals.insert(i, (at, tokens))
        self.tpot_list.insert(i, tpot_s)
        self.tokens += tokens
        self.tpots[tpot_s] = self.tpots.get(tpot_s, 0) + 1

    def expire(self, horizon: float) -> None:
        """Drop the keeps that arrived by ``horizon``."""
        arrivals, tpots = self.arrivals, self.tpots
        gone = bisect.bisect_right(arrivals, (horizon, math.inf))
        if not gone:
            return
        self.tokens -= sum(tokens for _, tokens in arrivals[:gone])
        for tpot in self.tpot_list[:gone]:
            left = tpots[tpot] - 1
            if left:
                tpots[tpot] = left
            else:
                del tpots[tpot]
        del arrivals[:gone]
        del self.tpot_list[:gone]

    @property
    def tightest_tpot_s(self) -> float:
        return min(self.tpots, default=math.inf)


@dataclass
class ClusterTracker:
    """Heartbeats plus own dispatches; ``view(now)`` is what a decision reads."""

    # A dispatch may reach its node after the next heartbeat was taken (network, sidecar hop):
    # keep it in the overlay until a heartbeat at least this much younger than it arrives.
    dispatch_grace_s: float = 0.0
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
        joins a decode node on keep the whole prompt."""
        tokens = decision.prompt_tokens
        work = tokens - decision.cached_tokens
        if decision.route is Route.KEEP:
            assert decision.prefill_node is not None  # a keep decision always names its prefill node
            prefill = self._prefill.get(decision.prefill_node)
            attention = prompt_attention_tokens(work, decision.cached_tokens, prefill.chunk_tokens) if prefill else 0.0
            self._overlay.setdefault(decision.prefill_node, []).append(
                _Dispatch(now, work, cached=decision.cached_tokens, attention=attention)
            )
            # Incoming until its prefill ends: from then on the node's heartbeat shows its KV
            # pull (pending_kv_pull_tokens), then the request itself.
            prefill_s = decision.predicted_prefill_end_s
            if prefill_s is None:
                prefill_s = decision.predicted_ttft_prefill_s or 0.0
            arrival = now + prefill_s
            incoming = self._incoming.get(decision.decode_node)
            if incoming is None:
                incoming = self._incoming[decision.decode_node] = _Incoming()
            incoming.add(arrival, tokens, _tpot_of(decision))
            self._changed(decision.prefill_node, decision.decode_node)
        else:
            dispatch = _Dispatch(now, work, cached=decision.cached_tokens, tpot_s=_tpot_of(decision))
            self._overlay.setdefault(decision.decode_node, []).append(dispatch)
            self._changed(decision.decode_node)
            return decision.decode_node, dispatch
        return None

    def cancel(self, handle: object) -> None:
        """Take back a deflection ``record`` returned ``handle`` for (its promise was refused)."""
        if handle is None:
            return
        node_id, dispatch = handle  # type: ignore[misc]
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
        keeps, keep_tokens = (len(incoming.arrivals), incoming.tokens) if incoming is not None else (0, 0)
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
            prefill_backlog_computed_tokens=computed,
            incoming_keeps=s.incoming_keeps + keeps,
            incoming_keep_tokens=s.incoming_keep_tokens + keep_tokens,
            incoming_keep_arrivals=(
                s.incoming_keep_arrivals + tuple(incoming.arrivals)
                if incoming is not None and keeps
                else s.incoming_keep_arrivals
            ),
        )
