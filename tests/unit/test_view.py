"""ClusterTracker: last heartbeats plus the dispatcher's own dispatches since them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from kairos.core.algorithm import DeciderConfig, decide
from kairos.core.decision import Decision, Reason, Route
from kairos.core.policies import PDPolicy
from kairos.core.state import ClusterView
from kairos.core.view import MAX_FOREIGN_PROMISES, ClusterTracker
from tests.builders import decode_node, flat_models, prefill_node, queue_load


def keep_to(prefill: str, tokens: int, decode: str = "d1", ttft_s: float = 0.1) -> Decision:
    return Decision(Route.KEEP, Reason.KEEP_POLICY, decode, prefill, (), ttft_s, None, tokens)


def deflect_to(decode: str, tokens: int) -> Decision:
    return Decision(Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN, decode, None, (tokens,), 0.1, 0.1, tokens)


def test_empty_tracker_has_an_empty_view() -> None:
    tracker = ClusterTracker()
    assert tracker.view() == ClusterView()
    assert tracker.node_ids == ()


def test_heartbeats_without_dispatches_pass_through() -> None:
    tracker = ClusterTracker()
    p1, d1 = prefill_node("p1", (500,), reported_at=1.0), decode_node("d1", b=3, backlog=(200,), reported_at=1.0)
    tracker.update_prefill(p1)
    tracker.update_decode(d1)
    assert tracker.view() == ClusterView(prefill=(p1,), decode=(d1,))
    assert tracker.node_ids == ("p1", "d1")


@dataclass(frozen=True)
class OverlayCase:
    grace: float
    dispatches: tuple[tuple[Decision, float], ...]  # (decision, dispatched at)
    heartbeat_at: float | None  # a second heartbeat (same reported queues) at this time, if any
    prefill_queue: tuple[int, ...]  # p1's queue in the view
    decode_backlog: tuple[int, ...]  # d1's backlog in the view
    decode_incoming: tuple[int, ...] = ()  # keeps on their way to d1 in the view


# First heartbeats at t=1.0: p1 queue (500,), d1 backlog (200,).
OVERLAY_CASES = [
    pytest.param(
        OverlayCase(0.0, ((keep_to("p1", 300), 1.2),), None, (500, 300), (200,), (300,)),
        id="keep dispatch joins the prefill queue and is incoming on d1, decode backlog untouched",
    ),
    pytest.param(
        OverlayCase(0.0, ((deflect_to("d1", 700), 1.2),), None, (500,), (200, 700)),
        id="deflect dispatch joins the decode backlog",
    ),
    pytest.param(
        OverlayCase(
            0.0, ((keep_to("p1", 300), 1.2), (keep_to("p1", 40), 1.3)), None, (500, 300, 40), (200,), (300, 40)
        ),
        id="two keeps queue FIFO behind the reported queue",
    ),
    pytest.param(
        OverlayCase(0.0, ((keep_to("p1", 300), 1.2), (deflect_to("d1", 700), 1.2)), 1.5, (500,), (200,)),
        id="heartbeat at 1.5 newer than dispatches at 1.2 clears them",
    ),
    pytest.param(
        OverlayCase(
            0.0, ((keep_to("p1", 300), 1.2), (deflect_to("d1", 700), 1.2)), 1.1, (500, 300), (200, 700), (300,)
        ),
        id="heartbeat at 1.1 older than dispatches at 1.2 keeps them",
    ),
    pytest.param(
        OverlayCase(0.0, ((keep_to("p1", 300), 1.2), (keep_to("p1", 40), 2.0)), 1.5, (500, 40), (200,), (40,)),
        id="heartbeat at 1.5 clears the 1.2 dispatch but not the 2.0 one",
    ),
    pytest.param(
        OverlayCase(
            0.5, ((keep_to("p1", 300), 1.2), (deflect_to("d1", 700), 1.2)), 1.5, (500, 300), (200, 700), (300,)
        ),
        id="grace 0.5: heartbeat at 1.5 (horizon 1.0) keeps dispatches at 1.2",
    ),
    pytest.param(
        OverlayCase(0.5, ((keep_to("p1", 300), 1.2), (deflect_to("d1", 700), 1.2)), 1.8, (500,), (200,)),
        id="grace 0.5: heartbeat at 1.8 (horizon 1.3) clears dispatches at 1.2",
    ),
    pytest.param(
        OverlayCase(0.0, ((keep_to("p2", 300, "d2"), 1.2), (deflect_to("d2", 700), 1.2)), None, (500,), (200,)),
        id="dispatches to other nodes do not show on p1 or d1",
    ),
    pytest.param(
        OverlayCase(0.0, ((keep_to("p1", 300, ttft_s=2.0), 1.2),), 1.5, (500,), (200,), (300,)),
        id="a keep stays incoming on d1 until its predicted prefill end (3.2), after the queue heartbeat",
    ),
    pytest.param(
        OverlayCase(0.0, ((keep_to("p1", 300, ttft_s=2.0), 1.2),), 3.3, (500,), (200,)),
        id="a heartbeat after the keep's predicted prefill end clears it from d1",
    ),
    pytest.param(
        OverlayCase(0.5, ((keep_to("p1", 300, ttft_s=2.0), 1.2),), 3.5, (500,), (200,), (300,)),
        id="grace 0.5: a heartbeat at 3.5 (horizon 3.0) keeps the keep due at 3.2",
    ),
]


@pytest.mark.parametrize("case", OVERLAY_CASES)
def test_overlay(case: OverlayCase) -> None:
    tracker = ClusterTracker(dispatch_grace_s=case.grace)
    tracker.update_prefill(prefill_node("p1", (500,), reported_at=1.0))
    tracker.update_decode(decode_node("d1", b=3, backlog=(200,), reported_at=1.0))
    for decision, at in case.dispatches:
        tracker.record(decision, at)
    if case.heartbeat_at is not None:
        tracker.update_prefill(prefill_node("p1", (500,), reported_at=case.heartbeat_at))
        tracker.update_decode(decode_node("d1", b=3, backlog=(200,), reported_at=case.heartbeat_at))
    v = tracker.view()
    assert [queue_load(n) for n in v.prefill] == [queue_load(case.prefill_queue)]
    assert [n.prefill_backlog_tokens for n in v.decode] == [case.decode_backlog]
    assert [(n.incoming_keeps, n.incoming_keep_tokens) for n in v.decode] == [
        (len(case.decode_incoming), sum(case.decode_incoming))
    ]
    # everything the heartbeat said is kept as is
    assert v.prefill[0].reported_at == v.decode[0].reported_at == (case.heartbeat_at or 1.0)
    assert v.decode[0].decode_tokens == 3


def test_heartbeat_of_one_node_does_not_clear_another_nodes_dispatches() -> None:
    tracker = ClusterTracker()
    tracker.update_prefill(prefill_node("p1", reported_at=1.0))
    tracker.update_prefill(prefill_node("p2", reported_at=1.0))
    tracker.record(keep_to("p1", 300), 1.2)
    tracker.update_prefill(prefill_node("p2", reported_at=2.0))
    assert {n.node_id: queue_load(n) for n in tracker.view().prefill} == {"p1": queue_load((300,)), "p2": (0, 0, 0)}


def test_remove_forgets_the_node_and_its_dispatches() -> None:
    tracker = ClusterTracker()
    tracker.update_prefill(prefill_node("p1", reported_at=1.0))
    tracker.update_decode(decode_node("d1", reported_at=1.0))
    tracker.record(deflect_to("d1", 700), 1.2)
    tracker.remove("d1")
    assert tracker.node_ids == ("p1",)
    assert tracker.view().decode == ()
    # the node comes back with a heartbeat older than the old dispatch: that dispatch is gone
    tracker.update_decode(decode_node("d1", reported_at=1.1))
    assert tracker.view().decode[0].prefill_backlog_tokens == ()
    tracker.remove("nobody")  # unknown ids are ignored
    assert tracker.node_ids == ("p1", "d1")


def test_other_dispatchers_promises_join_the_overlay_once_each_and_leave_with_a_heartbeat() -> None:
    tracker = ClusterTracker(dispatch_grace_s=0.1)
    tracker.update_decode(decode_node("d1", reported_at=1.0))
    tracker.update_prefill(prefill_node("p1", reported_at=1.0))
    assert tracker.add_foreign("d1", 1.2, 500, "b|1|500")
    assert not tracker.add_foreign("d1", 1.3, 500, "b|1|500")  # heard again (or told by a refusal)
    assert not tracker.add_foreign("p1", 1.2, 500, "b|2|500")  # a prefill node takes no deflection
    assert not tracker.add_foreign("d9", 1.2, 500, "b|3|500")  # a node not in the view
    tracker.record(deflect_to("d1", 700), 1.25)  # this dispatcher's own
    assert tracker.foreign_tokens("d1") == 500
    assert sorted(tracker.view().decode[0].prefill_backlog_tokens) == [500, 700]
    # A refusal's answer replaces what was heard: the same promise stays counted once.
    tracker.set_foreign("d1", [(1.2, 500, "b|1|500"), (1.22, 300, "c|1|300")])
    assert not tracker.add_foreign("d1", 1.3, 300, "c|1|300")
    assert tracker.foreign_tokens("d1") == 800
    # A heartbeat taken well after them shows them all; only later ones stay.
    assert tracker.add_foreign("d1", 1.5, 200, "c|2|200")
    tracker.update_decode(decode_node("d1", reported_at=1.45))
    assert tracker.foreign_tokens("d1") == 200
    assert tracker.view().decode[0].prefill_backlog_tokens == (200,)
    # However many are heard before the next heartbeat, a node holds a bounded number.
    added = sum(tracker.add_foreign("d1", 1.6, 1, f"flood|{i}|1") for i in range(2 * MAX_FOREIGN_PROMISES))
    assert added == MAX_FOREIGN_PROMISES - 1 and tracker.foreign_tokens("d1") == 200 + added


def test_view_is_cached_until_something_changes() -> None:
    tracker = ClusterTracker()
    tracker.update_prefill(prefill_node("p1", reported_at=1.0))
    first = tracker.view()
    assert tracker.view() is first
    tracker.record(keep_to("p1", 300), 1.2)
    second = tracker.view()
    assert second is not first
    assert queue_load(second.prefill[0]) == queue_load((300,))
    assert queue_load(first.prefill[0]) == (0, 0, 0)  # earlier views are not mutated


def test_a_dispatch_rebuilds_only_the_nodes_it_touches() -> None:
    """Every decision reads the view: a keep rebuilds its prefill and decode node, the other
    nodes' states are the very objects of the last view (and so is a node's after a heartbeat
    of another)."""
    tracker = ClusterTracker()
    for node_id in ("p1", "p2"):
        tracker.update_prefill(prefill_node(node_id, reported_at=1.0))
    for node_id in ("d1", "d2"):
        tracker.update_decode(decode_node(node_id, reported_at=1.0))
    tracker.record(keep_to("p2", 100, "d2"), 1.1)
    before = tracker.view()
    tracker.record(keep_to("p1", 300, "d1"), 1.2)
    after = tracker.view()
    assert [queue_load(n) for n in after.prefill] == [queue_load((300,)), queue_load((100,))]
    assert [n.incoming_keep_tokens for n in after.decode] == [300, 100]
    assert after.prefill[1] is before.prefill[1] and after.decode[1] is before.decode[1]
    assert after.prefill[0] is not before.prefill[0] and after.decode[0] is not before.decode[0]
    tracker.update_decode(decode_node("d1", b=4, reported_at=1.3))
    latest = tracker.view()
    assert latest.decode[0].decode_tokens == 4 and latest.decode[1] is after.decode[1]


def test_overlay_feeds_the_pending_deflection_limit() -> None:
    # Flat models, tau 0.105, candidates (420, 220, 120): a 1000-token prompt on B=20 takes
    # 0.280; p1 queue 5000 -> Eq. 1 = 0.660, so the first request deflects to d1.
    models = flat_models()
    cfg = DeciderConfig(tbt_slo_s=0.105, chunk_candidates=(420, 220, 120), max_pending_deflections=1)
    tracker = ClusterTracker()
    tracker.update_prefill(prefill_node("p1", (5000,), reported_at=0.0))
    tracker.update_decode(decode_node("d1", b=20, reported_at=0.0))

    first = decide(1000, tracker.view(), 0.1, models, cfg)
    assert (first.route, first.decode_node) == (Route.DEFLECT, "d1")
    tracker.record(first, 0.1)

    # d1 now shows one deflection in flight: under max_pending_deflections=1 it is not eligible
    second = decide(1000, tracker.view(), 0.2, models, cfg)
    assert (second.route, second.reason) == (Route.KEEP, Reason.KEEP_NO_ELIGIBLE_DECODE)
    tracker.record(second, 0.2)
    assert queue_load(tracker.view().prefill[0]) == queue_load((5000, 1000))

    # d1's next heartbeat (taken after the dispatch, prefill done) clears it: eligible again
    tracker.update_decode(decode_node("d1", b=21, k=1000, reported_at=0.3))
    third = decide(1000, tracker.view(), 0.3, models, cfg)
    assert (third.route, third.decode_node) == (Route.DEFLECT, "d1")


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        pytest.param({"d1": 3, "d2": 3}, ["d1", "d2", "d1", "d2", "d1", "d2"], id="equal nodes take turns"),
        pytest.param(
            {"d1": 3, "d2": 5},
            ["d1", "d1", "d1", "d2", "d1", "d2"],
            id="the lighter node until level (ties: d1), then turns",
        ),
        pytest.param({"d1": 3}, ["d1"] * 6, id="one node takes them all"),
    ],
)
def test_a_burst_of_keeps_spreads_over_the_decode_nodes(loads: dict[str, int], expected: list[str]) -> None:
    """Keeps dispatched between two heartbeats: each shows on its decode node as incoming, so
    the next one sees that node's load grow (P/D's least-loaded choice, Algorithm 1's too)."""
    policy = PDPolicy(flat_models(), DeciderConfig(tbt_slo_s=0.105))
    tracker = ClusterTracker()
    tracker.update_prefill(prefill_node("p1", reported_at=0.0))
    for node_id, b in loads.items():
        tracker.update_decode(decode_node(node_id, b=b, reported_at=0.0))
    chosen = []
    for i in range(len(expected)):
        decision = policy.decide(500, tracker.view(), 0.01 * i)
        tracker.record(decision, 0.01 * i)
        chosen.append(decision.decode_node)
    assert chosen == expected
    # A heartbeat after their predicted prefill ends (Eq. 1, before the keep path's first token):
    # the node pulls their KV or holds them now, and says so.
    assert decision.predicted_prefill_end_s is not None
    assert decision.predicted_prefill_end_s < decision.predicted_ttft_prefill_s
    prefill_end = max(0.01 * i for i in range(len(expected))) + decision.predicted_prefill_end_s
    tracker.update_decode(decode_node("d1", b=loads["d1"] + expected.count("d1"), reported_at=prefill_end + 0.01))
    assert (tracker.view().decode[0].incoming_keeps, tracker.view().decode[0].incoming_keep_tokens) == (0, 0)


def test_incoming_keeps_hold_kv_room() -> None:
    """A keep's KV is promised on its decode node: a node with room for one prompt is full once
    one keep is on its way, so the next keep prefers a node with room."""
    policy = PDPolicy(flat_models(), DeciderConfig(tbt_slo_s=0.105))
    tracker = ClusterTracker()
    tracker.update_prefill(prefill_node("p1", reported_at=0.0))
    tracker.update_decode(decode_node("d1", b=1, capacity=1000, reported_at=0.0))
    tracker.update_decode(decode_node("d2", b=9, reported_at=0.0))
    first = policy.decide(800, tracker.view(), 0.0)
    tracker.record(first, 0.0)
    assert first.decode_node == "d1" and tracker.view().decode[0].free_kv_tokens == 200
    assert policy.decide(800, tracker.view(), 0.01).decode_node == "d2"


class _WatchedTime(float):
    """A keep's predicted prefill end whose comparisons are counted: how often the tracker
    looks at the keeps it holds. ``now + ttft`` gives one too (``__radd__``)."""

    looks = 0

    def __radd__(self, other: float) -> _WatchedTime:
        return _WatchedTime(float(other) + float(self))

    def _look(self) -> None:
        _WatchedTime.looks += 1

    def __lt__(self, other: object) -> bool:
        self._look()
        return float(self) < other  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        self._look()
        return float(self) <= other  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        self._look()
        return float(self) > other  # type: ignore[operator]

    def __ge__(self, other: object) -> bool:
        self._look()
        return float(self) >= other  # type: ignore[operator]

    def __eq__(self, other: object) -> bool:
        self._look()
        return float(self) == other

    __hash__ = float.__hash__


def test_incoming_keeps_cost_does_not_grow_with_the_run() -> None:
    """Under overload the prefill queues grow, and so does each keep's predicted prefill end:
    the keeps in flight to a decode node pile up for the whole run. A heartbeat must drop the
    arrived ones without walking the rest (issue 15: walking them made the simulator's cost per
    request grow with the run's length). Over n dispatches, each followed by a heartbeat, the
    tracker compares keep arrival times O(n log n) times, not O(n^2), and its totals stay exact."""
    tracker = ClusterTracker()
    tracker.update_prefill(prefill_node("p1", reported_at=0.0))
    tracker.update_decode(decode_node("d1", reported_at=0.0))
    n, period = 2000, 0.1
    arrivals: list[float] = []
    _WatchedTime.looks = 0
    for i in range(n):
        now = i * period
        ttft = _WatchedTime(0.5 * now + 0.3)  # the queue, and so the wait, grows with the run
        tracker.record(keep_to("p1", 100 + i % 7, ttft_s=ttft), now)  # type: ignore[arg-type]
        arrivals.append(now + float(ttft))
        heartbeat_at = now + period / 2
        tracker.update_decode(decode_node("d1", reported_at=heartbeat_at))
        on_the_way = [j for j, at in enumerate(arrivals) if at > heartbeat_at]
        d1 = tracker.view().decode[0]
        assert (d1.incoming_keeps, d1.incoming_keep_tokens) == (
            len(on_the_way),
            sum(100 + j % 7 for j in on_the_way),
        )
    assert d1.incoming_keeps > n // 4  # many in flight at the end: the case that was quadratic
    assert _WatchedTime.looks <= 8 * n * math.log2(n)
