"""The membership rules as tables: "these heartbeats at these times -> this view, these events".

Each case is a script of polls. A poll gives what Redis held (node id -> heartbeat JSON; the
node's key is absent when it is not listed), or ``DOWN`` for a failed poll, and the poll's time.
After each poll the test compares, exactly: the nodes in the view with the ``reported_at`` of
their state, the stale ones, degraded/static flags and the events. No Redis, no clock, no sleep.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from kairos.common import defaults
from kairos.common.contracts import HeartbeatField, Role, parse_heartbeat
from kairos.common.errors import ConfigError
from kairos.core.state import DecodeNodeState, PrefillNodeState
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
    Rejection,
    RejectReason,
    StaticNode,
    check_heartbeat,
)
from tests.builders import heartbeat_json as beat

DOWN = None  # a poll that Redis did not answer


def event_text(event: Event) -> str:
    match event:
        case NodeJoined(hb):
            return f"joined {hb.node_id} {hb.role}"
        case NodeLeft(node_id, role, reason):
            return f"left {node_id} {role}: {reason}"
        case HeartbeatMalformed(node_id, error):
            return f"malformed {node_id}: {error}"
        case HeartbeatRejected(node_id, reason, _):
            return f"rejected {node_id} {reason}"
        case HeartbeatValidAgain(node_id, seq):
            return f"valid again {node_id} seq {seq}"
        case LastResortKept(role, keep_s):
            return f"last resort {role} {keep_s:g} s"
        case HeartbeatsGone(prefill, decode, _):
            return f"every heartbeat gone, kept {prefill}P {decode}D"
        case HeartbeatsBack(after):
            return f"heartbeats back after {after:g} s"
        case RedisLost(ever, prefill, decode, _, empty):
            when = "after" if ever else "before"
            return f"redis {'empty' if empty else 'lost'} ({when} first answer, {prefill}P {decode}D)"
        case RedisBack(after, failed, again, leaving, empty):
            return (
                f"redis back{' again' if again else ''} after {after:g} s, {failed} failed"
                + (", leaving static" if leaving else "")
                + (", empty" if empty else "")
            )
    raise AssertionError(event)


@dataclass(frozen=True)
class Poll:
    t: float
    redis: Mapping[str, str | None] | None  # node id -> heartbeat (None: expired after its SCAN); DOWN
    nodes: Mapping[str, float]  # node id -> reported_at of its state in the tracker's view
    stale: frozenset[str] = frozenset()
    events: tuple[str, ...] = ()
    degraded: bool = False
    static: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    polls: tuple[Poll, ...]
    config: dict[str, Any] = field(default_factory=dict)


CONFIG = {"stale_after_s": 0.35, "recovery_grace_s": 0.5, "forget_malformed_after_s": 0.5, "last_resort_s": 30.0}
STATIC = {"fallback_prefill": ("p0=10.0.0.1:8001", "p1=10.0.0.2:8001"), "fallback_decode": ("d0=10.0.1.1:8201",)}

CASES = [
    Case(
        "a new seq refreshes the node at poll time; the same beat again ages it into staleness",
        (
            Poll(10.0, {"p0": beat("p0", 1)}, {"p0": 10.0}, events=("joined p0 prefill",)),
            Poll(10.3, {"p0": beat("p0", 1)}, {"p0": 10.0}),
            Poll(10.4, {"p0": beat("p0", 1)}, {"p0": 10.0}, stale=frozenset({"p0"})),
            Poll(10.5, {"p0": beat("p0", 2)}, {"p0": 10.5}),
        ),
    ),
    Case(
        "the publisher's clock never matters: sent_at an hour ahead or behind",
        (
            Poll(
                10.0,
                {"p0": beat("p0", 1, sent_at=5000.0), "d0": beat("d0", 1, sent_at=-2000.0)},
                {"p0": 10.0, "d0": 10.0},
                events=("joined p0 prefill", "joined d0 decode"),
            ),
            Poll(
                10.4,
                {"p0": beat("p0", 2, sent_at=5000.1), "d0": beat("d0", 1, sent_at=-2000.0)},
                {"p0": 10.4, "d0": 10.0},
                stale=frozenset({"d0"}),
            ),
        ),
    ),
    Case(
        "the beat a node left with, back in its key (a busy engine's held beat after a lapse): stale, not fresh",
        (
            Poll(
                0.0,
                {"d0": beat("d0", 1), "d1": beat("d1", 1)},
                {"d0": 0.0, "d1": 0.0},
                events=("joined d0 decode", "joined d1 decode"),
            ),
            Poll(0.6, {"d1": beat("d1", 2)}, {"d1": 0.6}, events=("left d0 decode: its heartbeat key expired",)),
            Poll(
                0.7,
                {"d0": beat("d0", 1), "d1": beat("d1", 2)},
                {"d0": 0.0, "d1": 0.6},
                stale=frozenset({"d0"}),
                events=("joined d0 decode",),
            ),
            Poll(0.8, {"d0": beat("d0", 2), "d1": beat("d1", 3)}, {"d0": 0.8, "d1": 0.8}),
        ),
    ),
    Case(
        "a restarted publisher counts as new even though its seq starts again",
        (
            Poll(10.0, {"p0": beat("p0", 7, sent_at=1000.0)}, {"p0": 10.0}, events=("joined p0 prefill",)),
            Poll(11.0, {"p0": beat("p0", 1, sent_at=1001.0)}, {"p0": 11.0}),
        ),
    ),
    Case(
        "an expired key removes its node at the next poll, while the role has other nodes",
        (
            Poll(
                0.0,
                {"d0": beat("d0"), "d1": beat("d1")},
                {"d0": 0.0, "d1": 0.0},
                events=("joined d0 decode", "joined d1 decode"),
            ),
            Poll(0.1, {"d1": beat("d1", 2)}, {"d1": 0.1}, events=("left d0 decode: its heartbeat key expired",)),
        ),
    ),
    Case(
        "a key that expired between its SCAN and its MGET counts as gone",
        (
            Poll(
                0.0,
                {"d0": beat("d0"), "d1": beat("d1")},
                {"d0": 0.0, "d1": 0.0},
                events=("joined d0 decode", "joined d1 decode"),
            ),
            Poll(
                0.1,
                {"d0": None, "d1": beat("d1", 2)},
                {"d1": 0.1},
                events=("left d0 decode: its heartbeat key expired",),
            ),
        ),
    ),
    Case(
        "every key of a role gone at once: its nodes stay, stale, as a last resort until one beats",
        (
            Poll(
                0.0,
                {"d0": beat("d0"), "d1": beat("d1"), "p0": beat("p0")},
                {"d0": 0.0, "d1": 0.0, "p0": 0.0},
                events=("joined d0 decode", "joined d1 decode", "joined p0 prefill"),
            ),
            Poll(
                1.0,
                {"p0": beat("p0", 2)},
                {"d0": 0.0, "d1": 0.0, "p0": 1.0},
                stale=frozenset({"d0", "d1"}),
                events=("last resort decode 30 s",),
            ),
            Poll(1.1, {"p0": beat("p0", 2)}, {"d0": 0.0, "d1": 0.0, "p0": 1.0}, stale=frozenset({"d0", "d1"})),
            Poll(
                1.2,
                {"p0": beat("p0", 2), "d1": beat("d1", 2)},
                {"d1": 1.2, "p0": 1.0},
                events=("left d0 decode: its heartbeat key expired",),
            ),
        ),
    ),
    Case(
        "the last resort ends last_resort_s after the node's last beat",
        (
            Poll(
                0.0,
                {"d0": beat("d0"), "p0": beat("p0")},
                {"d0": 0.0, "p0": 0.0},
                events=("joined d0 decode", "joined p0 prefill"),
            ),
            Poll(
                4.0,
                {"p0": beat("p0", 2)},
                {"d0": 0.0, "p0": 4.0},
                stale=frozenset({"d0"}),
                events=("last resort decode 5 s",),
            ),
            Poll(5.0, {"p0": beat("p0", 3)}, {"p0": 5.0}, events=("left d0 decode: its heartbeat key expired",)),
            # d1 joins, then the decode role goes again: a last resort, logged again (a new episode)
            Poll(5.1, {"p0": beat("p0", 4), "d1": beat("d1")}, {"p0": 5.1, "d1": 5.1}, events=("joined d1 decode",)),
            Poll(5.2, {"p0": beat("p0", 5)}, {"p0": 5.2, "d1": 5.1}, events=("last resort decode 5 s",)),
            Poll(10.2, {"p0": beat("p0", 6)}, {"p0": 10.2}, events=("left d1 decode: its heartbeat key expired",)),
        ),
        {"last_resort_s": 5.0},
    ),
    Case(
        "redis holds no heartbeat at all (full and refusing writes, flushed): the view stays past the last "
        "resort; the first beat back starts the recovery grace",
        (
            Poll(
                0.0,
                {"p0": beat("p0"), "d0": beat("d0"), "d1": beat("d1")},
                {"p0": 0.0, "d0": 0.0, "d1": 0.0},
                events=("joined p0 prefill", "joined d0 decode", "joined d1 decode"),
            ),
            Poll(0.1, {}, {"p0": 0.0, "d0": 0.0, "d1": 0.0}, events=("every heartbeat gone, kept 1P 2D",)),
            Poll(0.2, {"d1": None}, {"p0": 0.0, "d0": 0.0, "d1": 0.0}),  # expired between its SCAN and its read
            Poll(100.0, {}, {"p0": 0.0, "d0": 0.0, "d1": 0.0}, stale=frozenset({"p0", "d0", "d1"})),
            Poll(
                100.1,
                {"d0": beat("d0", 2)},
                {"p0": 0.0, "d0": 100.1, "d1": 0.0},
                stale=frozenset({"p0", "d1"}),
                events=("heartbeats back after 100 s",),
            ),
            Poll(
                100.7,
                {"d0": beat("d0", 3), "p0": beat("p0", 2)},
                {"p0": 100.7, "d0": 100.7},
                events=("left d1 decode: its heartbeat key expired",),
            ),
        ),
    ),
    Case(
        "redis answers with no heartbeat and the view holds none (a dispatcher restarted while redis is full): "
        "the static lists, as while it is unreachable, until a heartbeat replaces them",
        (
            Poll(
                0.0,
                {},
                {"p0": 0.0, "p1": 0.0, "d0": 0.0},
                degraded=True,
                static=True,
                events=("redis empty (before first answer, 2P 1D)",),
            ),
            Poll(0.1, DOWN, {"p0": 0.1, "p1": 0.1, "d0": 0.1}, degraded=True, static=True),
            Poll(0.2, {"d0": None}, {"p0": 0.2, "p1": 0.2, "d0": 0.2}, degraded=True, static=True),
            Poll(
                0.3,
                {"p0": beat("p0")},
                {"p0": 0.3, "p1": 0.2, "d0": 0.2},
                events=("redis back after 0.3 s, 3 failed, leaving static, empty", "joined p0 prefill"),
            ),
            Poll(
                0.9,
                {"p0": beat("p0", 2), "d0": beat("d0")},
                {"p0": 0.9, "d0": 0.9},
                events=("joined d0 decode", "left p1 prefill: it is a static node and redis now answers"),
            ),
        ),
        STATIC,
    ),
    Case(
        "with static lists too, every heartbeat gone keeps the view from redis, not the lists",
        (
            Poll(0.0, {"p0": beat("p0")}, {"p0": 0.0}, events=("joined p0 prefill",)),
            Poll(0.1, {}, {"p0": 0.0}, events=("every heartbeat gone, kept 1P 0D",)),
        ),
        STATIC,
    ),
    Case(
        "redis empty before any heartbeat: nothing to keep",
        (
            Poll(0.0, {}, {}),
            Poll(0.1, {}, {}),
            Poll(0.2, {"p0": beat("p0")}, {"p0": 0.2}, events=("joined p0 prefill",)),
        ),
    ),
    Case(
        "last_resort_s = 0: every expired node leaves at once",
        (
            Poll(0.0, {"d0": beat("d0")}, {"d0": 0.0}, events=("joined d0 decode",)),
            Poll(0.1, {}, {}, events=("left d0 decode: its heartbeat key expired",)),
        ),
        {"last_resort_s": 0.0},
    ),
    Case(
        "malformed values are ignored and reported once per node until valid again",
        (
            Poll(
                0.0,
                {
                    "b1": "not json",
                    "b2": json.dumps({"node_id": "b2"}),
                    "b3": beat("someone-else"),
                    "b4": beat("b4", role="decode", sidecar=""),
                    "p0": beat("p0"),
                },
                {"p0": 0.0},
                events=(
                    "rejected b1 malformed",
                    "malformed b1: not JSON (JSONDecodeError: Expecting value: line 1 column 1 (char 0))",
                    "rejected b2 malformed",
                    "malformed b2: missing fields " + str([f for f in HeartbeatField.REQUIRED if f != "node_id"]),
                    "rejected b3 key_mismatch",
                    "malformed b3: key_mismatch: node_id 'someone-else' in the key of 'b3'",
                    "rejected b4 malformed",
                    "malformed b4: a decode node needs a sidecar address (the dispatcher routes to it)",
                    "joined p0 prefill",
                ),
            ),
            Poll(0.1, {"b1": "not json", "p0": beat("p0", 2)}, {"p0": 0.1}),
            Poll(
                0.2,
                {"b1": beat("b1", 1)},
                {"b1": 0.2},
                events=("valid again b1 seq 1", "joined b1 prefill", "left p0 prefill: its heartbeat key expired"),
            ),
        ),
    ),
    Case(
        "a known node that turns malformed keeps its last good state, then is forgotten",
        (
            Poll(0.0, {"p0": beat("p0", 1)}, {"p0": 0.0}, events=("joined p0 prefill",)),
            Poll(
                0.3,
                {"p0": beat("p0", 2, max_step_tokens=0)},
                {"p0": 0.0},
                events=("rejected p0 malformed", "malformed p0: max_step_tokens must be an int >= 1, got 0"),
            ),
            Poll(0.4, {"p0": beat("p0", 2, max_step_tokens=0)}, {"p0": 0.0}, stale=frozenset({"p0"})),
            Poll(
                0.5,
                {"p0": beat("p0", 2, max_step_tokens=0)},
                {},
                events=("left p0 prefill: no valid heartbeat for 0.50 s",),
            ),
            Poll(0.6, {"p0": beat("p0", 3)}, {"p0": 0.6}, events=("valid again p0 seq 3", "joined p0 prefill")),
        ),
    ),
    Case(
        "a node that reports another role leaves and joins again as that role",
        (
            Poll(1.0, {"n0": beat("n0", 1, role="prefill")}, {"n0": 1.0}, events=("joined n0 prefill",)),
            Poll(
                2.0,
                {"n0": beat("n0", 2, role="decode")},
                {"n0": 2.0},
                events=("left n0 prefill: it now reports role decode", "joined n0 decode"),
            ),
        ),
    ),
    Case(
        "redis lost after it answered: degraded, the last view stays and ages; back: it heals",
        (
            Poll(
                0.0,
                {"p0": beat("p0"), "d0": beat("d0")},
                {"p0": 0.0, "d0": 0.0},
                events=("joined p0 prefill", "joined d0 decode"),
            ),
            Poll(0.1, DOWN, {"p0": 0.0, "d0": 0.0}, degraded=True, events=("redis lost (after first answer, 1P 1D)",)),
            Poll(0.2, DOWN, {"p0": 0.0, "d0": 0.0}, degraded=True),
            Poll(0.4, DOWN, {"p0": 0.0, "d0": 0.0}, stale=frozenset({"p0", "d0"}), degraded=True),
            # Redis restarted empty: the view stays until a publisher is back, then the grace
            # keeps the nodes while the others re-publish.
            Poll(
                0.5,
                {},
                {"p0": 0.0, "d0": 0.0},
                stale=frozenset({"p0", "d0"}),
                events=("redis back again after 0.4 s, 3 failed", "every heartbeat gone, kept 1P 1D"),
            ),
            Poll(
                1.2,
                {"p0": beat("p0", 2)},
                {"p0": 1.2, "d0": 0.0},
                stale=frozenset({"d0"}),
                events=("heartbeats back after 0.7 s",),
            ),
            Poll(1.6, {"p0": beat("p0", 3), "d0": beat("d0", 2)}, {"p0": 1.6, "d0": 1.6}),
        ),
    ),
    Case(
        "after the recovery grace, nodes still missing leave",
        (
            Poll(
                0.0,
                {"p0": beat("p0"), "d0": beat("d0"), "d1": beat("d1")},
                {"p0": 0.0, "d0": 0.0, "d1": 0.0},
                events=("joined p0 prefill", "joined d0 decode", "joined d1 decode"),
            ),
            Poll(
                1.0,
                DOWN,
                {"p0": 0.0, "d0": 0.0, "d1": 0.0},
                stale=frozenset({"p0", "d0", "d1"}),
                degraded=True,
                events=("redis lost (after first answer, 1P 2D)",),
            ),
            Poll(
                2.0,
                {"p0": beat("p0", 2), "d0": beat("d0", 2)},
                {"p0": 2.0, "d0": 2.0, "d1": 0.0},
                stale=frozenset({"d1"}),
                events=("redis back again after 1 s, 1 failed",),
            ),
            Poll(
                2.5,
                {"p0": beat("p0", 3), "d0": beat("d0", 3)},
                {"p0": 2.5, "d0": 2.5},
                events=("left d1 decode: its heartbeat key expired",),
            ),
        ),
    ),
    Case(
        "redis never up: the static lists, refreshed each poll, never deflectable; redis up replaces them",
        (
            Poll(
                100.0,
                DOWN,
                {"p0": 100.0, "p1": 100.0, "d0": 100.0},
                degraded=True,
                static=True,
                events=("redis lost (before first answer, 2P 1D)",),
            ),
            Poll(101.0, DOWN, {"p0": 101.0, "p1": 101.0, "d0": 101.0}, degraded=True, static=True),
            Poll(
                102.0,
                {"p0": beat("p0"), "d9": beat("d9")},
                {"p0": 102.0, "p1": 101.0, "d0": 101.0, "d9": 102.0},
                stale=frozenset({"p1", "d0"}),
                events=("redis back after 2 s, 2 failed, leaving static", "joined p0 prefill", "joined d9 decode"),
            ),
            Poll(
                102.5,
                {"p0": beat("p0"), "d9": beat("d9")},
                {"p0": 102.0, "d9": 102.0},
                stale=frozenset({"p0", "d9"}),
                events=(
                    "left p1 prefill: it is a static node and redis now answers",
                    "left d0 decode: it is a static node and redis now answers",
                ),
            ),
        ),
        STATIC,
    ),
    Case(
        "a forged beat in another node's key is ignored, counted once per value; the node keeps its state",
        (
            Poll(0.0, {"p0": beat("p0", 1)}, {"p0": 0.0}, events=("joined p0 prefill",)),
            Poll(
                0.1,
                {"p0": beat("p1", 9)},
                {"p0": 0.0},
                events=("rejected p0 key_mismatch", "malformed p0: key_mismatch: node_id 'p1' in the key of 'p0'"),
            ),
            Poll(0.2, {"p0": beat("p1", 9)}, {"p0": 0.0}),  # the same forged value: not counted again
            Poll(0.25, {"p0": beat("p1", 10)}, {"p0": 0.0}, events=("rejected p0 key_mismatch",)),
            Poll(0.3, {"p0": beat("p0", 2)}, {"p0": 0.3}, events=("valid again p0 seq 2",)),
        ),
    ),
    Case(
        "the very value applied before comes back after a rejected one: valid again, not skipped as seen",
        (
            Poll(0.0, {"p0": beat("p0", 1)}, {"p0": 0.0}, events=("joined p0 prefill",)),
            Poll(
                0.1,
                {"p0": "{not json"},
                {"p0": 0.0},
                events=(
                    "rejected p0 malformed",
                    "malformed p0: not JSON (JSONDecodeError: Expecting property name enclosed in "
                    "double quotes: line 1 column 2 (char 1))",
                ),
            ),
            Poll(0.2, {"p0": beat("p0", 1)}, {"p0": 0.0}, events=("valid again p0 seq 1",)),
        ),
    ),
    Case(
        "listed nodes only: the listed role and addresses join, anything else is rejected",
        (
            Poll(
                0.0,
                {
                    "p0": beat("p0", url="10.0.0.1:8001"),  # as listed
                    "p1": beat("p1", url="10.9.9.9:8001"),  # another address than listed
                    "d0": beat("d0", url="10.0.1.1:8101", sidecar="10.0.1.1:8201"),  # url not listed: not checked
                    "d1": beat("d1", url="10.0.1.1:8101", sidecar="10.0.1.1:8201"),  # not listed
                    "d9": beat("d9", role="prefill", url="10.0.0.1:8001"),
                },  # listed as decode
                {"p0": 0.0, "d0": 0.0},
                events=(
                    "joined p0 prefill",
                    "rejected p1 address_mismatch",
                    "malformed p1: address_mismatch: reports url '10.9.9.9:8001', listed as '10.0.0.2:8001'",
                    "joined d0 decode",
                    "rejected d1 unknown_node",
                    "malformed d1: unknown_node: 'd1' is not a listed node",
                    "rejected d9 role_mismatch",
                    "malformed d9: role_mismatch: reports role prefill, listed as decode",
                ),
            ),
            # a forger that got d0's url right but not its sidecar: rejected, d0 keeps its state
            Poll(
                0.1,
                {
                    "p0": beat("p0", 2, url="10.0.0.1:8001"),
                    "d0": beat("d0", 2, url="10.0.1.1:8101", sidecar="10.6.6.6:8201"),
                },
                {"p0": 0.1, "d0": 0.0},
                events=(
                    "rejected d0 address_mismatch",
                    "malformed d0: address_mismatch: reports sidecar '10.6.6.6:8201', listed as '10.0.1.1:8201'",
                ),
            ),
        ),
        {**STATIC, "fallback_decode": ("d0=10.0.1.1:8201", "d9=10.0.1.9:8101+10.0.1.9:8201"), "admit_nodes": "listed"},
    ),
    Case(
        "admit any (the lists are a fallback only): an unlisted node or another address joins",
        (
            Poll(
                0.0,
                {"p1": beat("p1", url="10.9.9.9:8001"), "d7": beat("d7")},
                {"p1": 0.0, "d7": 0.0},
                events=("joined p1 prefill", "joined d7 decode"),
            ),
        ),
        STATIC,
    ),
    Case(
        "redis never up and no static lists: an empty view",
        (
            Poll(0.0, DOWN, {}, degraded=True, events=("redis lost (before first answer, 0P 0D)",)),
            Poll(0.1, DOWN, {}, degraded=True),
        ),
    ),
]


def nodes_in_view(m: Membership) -> dict[str, float]:
    view = m.tracker.view()
    return {n.node_id: n.reported_at for n in (*view.prefill, *view.decode)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_membership_rules(case: Case) -> None:
    m = Membership(MembershipConfig(**{**CONFIG, **case.config}))
    for i, poll in enumerate(case.polls):
        events = m.poll_failed(poll.t) if poll.redis is DOWN else m.poll_succeeded(poll.redis.items(), poll.t)
        got = (
            nodes_in_view(m),
            frozenset(m.stale_node_ids(poll.t)),
            tuple(map(event_text, events)),
            m.degraded,
            m.static_fallback,
        )
        want = (dict(poll.nodes), poll.stale, poll.events, poll.degraded, poll.static)
        assert got == want, f"poll {i} at t={poll.t}"
        assert set(m.addresses()) == set(poll.nodes), f"poll {i}: addresses and view disagree"
        sidecars = {a.sidecar for a in m.addresses().values() if a.role == Role.DECODE and a.sidecar}
        assert m.decode_sidecars() == tuple(sorted(sidecars)), f"poll {i}: the sidecars were not derived again"


def test_the_view_carries_each_heartbeats_load_and_address() -> None:
    m = Membership(MembershipConfig())
    m.poll_succeeded(
        [
            ("p0", beat("p0", queued_prefill_tokens=[3000, 500], max_step_tokens=2048)),
            (
                "d0",
                beat(
                    "d0",
                    decode_tokens=7,
                    kv_tokens=21_000,
                    scheduled_prefill_tokens=[900],
                    model="tiny",
                    pending_kv_pull_tokens=[4000, 12],
                    tpot_slo_ms=60,
                ),
            ),
            ("d1", beat("d1")),  # reports no pulls (real vLLM today): none
            ("d2", beat("d2", decode_tokens=3, kv_tokens=900)),  # busy, no TPOT: a node older than the field
        ],
        5.0,
    )
    view = m.tracker.view()
    assert view.prefill == (PrefillNodeState.from_queue("p0", (3000, 500), 2048, 5.0),)
    d0 = DecodeNodeState("d0", 7, 21_000, 50_000, 5.0, prefill_backlog_tokens=(900,), pending_kv_pull_tokens=(4000, 12))
    assert view.decode == (
        dataclasses.replace(d0, tpot_slo_s=0.060),
        DecodeNodeState("d1", 0, 0, 50_000, 5.0),  # idle, no TPOT reported: none in flight
        # Busy with its requests' TPOTs not reported: they hold the cluster's default (kairos.core.slo).
        DecodeNodeState("d2", 3, 900, 50_000, 5.0, tpot_slo_s=defaults.TBT_SLO_S),
    )
    assert dict(m.addresses()) == {
        "p0": NodeAddress(Role.PREFILL, "10.0.0.1:8100", "", "m"),
        "d0": NodeAddress(Role.DECODE, "10.0.0.1:8100", "10.0.0.1:8200", "tiny"),
        "d1": NodeAddress(Role.DECODE, "10.0.0.1:8100", "10.0.0.1:8200", "m"),
        "d2": NodeAddress(Role.DECODE, "10.0.0.1:8100", "10.0.0.1:8200", "m"),
    }


def test_static_nodes_have_zero_load_and_no_kv_room() -> None:
    m = Membership(MembershipConfig(**STATIC))
    m.poll_failed(7.0)
    view = m.tracker.view()
    assert view.prefill == (PrefillNodeState("p0", 0, 0, 0, 1, 7.0), PrefillNodeState("p1", 0, 0, 0, 1, 7.0))
    assert view.decode == (DecodeNodeState("d0", 0, 0, 0, 7.0),)  # kv capacity 0: no prompt fits
    assert m.addresses()["d0"] == NodeAddress(Role.DECODE, "", "10.0.1.1:8201", "")
    # /nodes names a static decode node's sidecar too (kairos top reads its metrics there).
    assert [n.get("sidecar") for n in m.report(7.0)["nodes"]] == ["10.0.1.1:8201", None, None]


def test_the_nodes_report() -> None:
    m = Membership(MembershipConfig(stale_after_s=0.35))
    d0 = beat(
        "d0",
        1,
        decode_tokens=3,
        kv_tokens=900,
        scheduled_prefill_tokens=[512, 100],
        running_requests=4,
        waiting_requests=1,
        kv_usage=0.02,
    )
    m.poll_succeeded([("p0", beat("p0", 1)), ("d0", d0)], 10.0)
    m.poll_succeeded([("p0", beat("p0", 2, queued_prefill_tokens=[3000, 1000])), ("d0", d0)], 10.3)
    load = {
        "decode_tokens": 0,
        "kv_tokens": 0,
        "kv_capacity_tokens": 50_000,
        "queued_prefill_tokens": 0,
        "scheduled_prefill_tokens": 0,
    }
    assert m.report(10.3) == {
        "status": "ok",
        "static_fallback": False,
        "nodes": [
            {
                "id": "d0",
                "role": "decode",
                "age_s": 0.3,
                "stale": False,
                "from_redis": True,
                "sidecar": "10.0.0.1:8200",  # where kairos top reads its SLO counters
                **load,
                "decode_tokens": 3,
                "kv_tokens": 900,
                "scheduled_prefill_tokens": 612,
                "running_requests": 4,
                "waiting_requests": 1,
                "kv_usage": 0.02,
            },
            {
                "id": "p0",
                "role": "prefill",
                "age_s": 0.0,
                "stale": False,
                "from_redis": True,
                **load,
                "queued_prefill_tokens": 4000,
            },  # the load of its newest beat
        ],
        "rejected_heartbeats": dict.fromkeys(map(str, RejectReason), 0),
        "rejecting": [],
    }
    assert [(n["id"], n["stale"]) for n in m.report(10.4)["nodes"]] == [("d0", True), ("p0", False)]
    m.poll_failed(11.0)
    report = m.report(11.0)
    assert report["status"] == "degraded" and not report["static_fallback"]
    assert [(n["id"], n["age_s"], n["stale"]) for n in report["nodes"]] == [("d0", 1.0, True), ("p0", 0.7, True)]


LISTED = {
    "p0": StaticNode("p0", Role.PREFILL, "10.0.0.1:8100", ""),
    "d0": StaticNode("d0", Role.DECODE, "10.0.0.1:8100", "10.0.0.1:8200"),
    "d1": StaticNode("d1", Role.DECODE, "", "10.0.0.1:8200"),  # listed by its sidecar only
}


@pytest.mark.parametrize(
    ("key", "heartbeat", "admit", "want"),
    [
        ("p0", beat("p0"), "listed", None),
        ("d0", beat("d0"), "listed", None),
        ("d1", beat("d1", url="10.7.7.7:1"), "listed", None),  # an address the listing leaves empty
        ("p0", beat("d0"), "listed", RejectReason.KEY_MISMATCH),
        ("p0", beat("d0"), "any", RejectReason.KEY_MISMATCH),
        ("p9", beat("p9"), "listed", RejectReason.UNKNOWN_NODE),
        ("p9", beat("p9"), "any", None),
        ("p0", beat("p0", role="decode"), "listed", RejectReason.ROLE_MISMATCH),
        ("p0", beat("p0", role="decode"), "any", None),
        ("p0", beat("p0", url="10.0.0.1:8101"), "listed", RejectReason.ADDRESS_MISMATCH),
        ("d0", beat("d0", url="10.0.0.2:8100"), "listed", RejectReason.ADDRESS_MISMATCH),
        ("d0", beat("d0", sidecar="10.0.0.1:8201"), "listed", RejectReason.ADDRESS_MISMATCH),
        ("d1", beat("d1", sidecar="10.0.0.1:8201"), "listed", RejectReason.ADDRESS_MISMATCH),
    ],
)
def test_a_heartbeat_must_match_its_key_and_the_listed_node(
    key: str, heartbeat: str, admit: str, want: RejectReason | None
) -> None:
    got = check_heartbeat(key, parse_heartbeat(heartbeat), LISTED, admit)
    assert (got.reason if isinstance(got, Rejection) else None) == want


def test_rejections_show_in_the_nodes_report() -> None:
    m = Membership(MembershipConfig(fallback_prefill=("p0=10.0.0.1:8100",), admit_nodes="listed"))
    m.poll_succeeded([("p0", beat("p0")), ("p7", beat("p7")), ("d0", "junk")], 1.0)
    m.poll_succeeded([("p0", beat("p0", 2)), ("p7", beat("p7", 2)), ("d0", "junk")], 1.1)
    report = m.report(1.1)
    assert report["rejected_heartbeats"] == {
        "malformed": 1,
        "key_mismatch": 0,
        "unknown_node": 2,
        "role_mismatch": 0,
        "address_mismatch": 0,
    }
    assert report["rejecting"] == [{"id": "d0", "reason": "malformed"}, {"id": "p7", "reason": "unknown_node"}]
    assert [n["id"] for n in report["nodes"]] == ["p0"]
    m.poll_succeeded([("p0", beat("p0", 3))], 1.2)  # the forged keys are gone
    assert m.report(1.2)["rejecting"] == []


def test_recovering_is_the_grace_after_redis_answers_again() -> None:
    m = Membership(MembershipConfig(recovery_grace_s=0.5))
    m.poll_succeeded([], 0.0)
    assert not m.recovering(0.0)  # the first answer ever, with no outage before: no grace
    m.poll_failed(1.0)
    m.poll_succeeded([], 2.0)
    assert m.recovering(2.0) and m.recovering(2.49) and not m.recovering(2.5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"stale_after_s": 0.0}, "stale_after_s must be > 0"),
        ({"recovery_grace_s": -1.0}, "recovery_grace_s must be >= 0"),
        ({"last_resort_s": -1.0}, "last_resort_s must be >= 0"),
        ({"fallback_prefill": ("127.0.0.1:8001",)}, "expected id=host:port"),
        ({"fallback_prefill": ("p0=127.0.0.1",)}, "fallback prefill node p0 url: expected host:port"),
        ({"fallback_decode": ("d0=127.0.0.1:8101+sidecar",)}, "d0 sidecar: expected host:port"),
        ({"fallback_decode": ("d0=vllm+127.0.0.1:8201",)}, "d0 url: expected host:port"),
        ({"fallback_prefill": ("n=h:1",), "fallback_decode": ("n=h:2+h:3",)}, "repeated: ['n']"),
        ({"admit_nodes": "some"}, "admit_nodes must be one of ['any', 'listed']"),
        ({"admit_nodes": "listed"}, "admit_nodes='listed' needs the node lists"),
    ],
)
def test_invalid_membership_configs_are_rejected(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        MembershipConfig(**changes)
    assert message in info.value.message


def test_static_nodes_parse() -> None:
    cfg = MembershipConfig(
        fallback_prefill=(" p0 = 10.0.0.1:8001 ",), fallback_decode=("d0=10.0.0.2:8101+10.0.0.2:8201",)
    )
    assert cfg.static_nodes() == (
        StaticNode("p0", Role.PREFILL, "10.0.0.1:8001", ""),
        StaticNode("d0", Role.DECODE, "10.0.0.2:8101", "10.0.0.2:8201"),
    )


def test_a_value_seen_at_the_last_poll_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two polls per heartbeat period read each beat twice; the second read costs no parse."""
    import kairos.extproc.membership as membership

    parsed: list[bytes | str] = []

    def counting_parse(raw: bytes | str) -> Any:
        parsed.append(raw)
        return parse_heartbeat(raw)

    monkeypatch.setattr(membership, "parse_heartbeat", counting_parse)
    m = Membership(MembershipConfig(**CONFIG))
    first = {"p0": beat("p0", 1), "d0": beat("d0", 1)}
    m.poll_succeeded(first.items(), 0.0)
    m.poll_succeeded(first.items(), 0.05)
    assert sorted(parsed) == sorted(first.values())
    m.poll_succeeded({"p0": beat("p0", 2), "d0": beat("d0", 1)}.items(), 0.1)
    assert parsed[-1] == beat("p0", 2) and len(parsed) == 3
    assert nodes_in_view(m) == {"p0": 0.1, "d0": 0.0}


def test_each_poll_says_how_many_new_beats_it_applied_and_the_earliest_sent_at_among_them() -> None:
    """What the read-delay metric is made of: only beats this poll took into the view count; a
    beat read again, a rejected one, a malformed one and a failed poll do not."""
    m = Membership(MembershipConfig(**CONFIG))
    m.poll_succeeded({"p0": beat("p0", 1, sent_at=10.0), "d0": beat("d0", 1, sent_at=10.5)}.items(), 0.0)
    assert (m.new_beats, m.oldest_new_sent_at) == (2, 10.0)
    m.poll_succeeded({"p0": beat("p0", 1, sent_at=10.0), "d0": beat("d0", 2, sent_at=10.6)}.items(), 0.05)
    assert (m.new_beats, m.oldest_new_sent_at) == (1, 10.6)
    same = {"p0": beat("p0", 1, sent_at=10.0), "d0": beat("d0", 2, sent_at=10.6)}
    m.poll_succeeded({**same, "d1": beat("d9", 1, sent_at=1.0), "d2": "{"}.items(), 0.1)
    assert (m.new_beats, m.oldest_new_sent_at) == (0, None)
    m.poll_failed(0.15)
    assert (m.new_beats, m.oldest_new_sent_at) == (0, None)


def test_the_view_carries_each_decode_nodes_step_calibration_and_an_old_heartbeat_reads_as_one() -> None:
    m = Membership(MembershipConfig())
    m.poll_succeeded([("d0", beat("d0", step_calibration=1.25)), ("d1", beat("d1"))], 5.0)
    by_id = {n.node_id: n for n in m.tracker.view().decode}
    assert (by_id["d0"].step_calibration, by_id["d1"].step_calibration) == (1.25, 1.0)


# ---------------------------------------------------------------------------------------------
# KV event subscriptions: the nodes whose beats advertise sockets, and when that changes
# ---------------------------------------------------------------------------------------------
D0_EVENTS = {
    "kv_events_endpoint": "tcp://10.0.0.1:5557",
    "kv_events_replay_endpoint": "tcp://10.0.0.1:5558",
    "kv_events_topic": "kv-events",
}
D0_MOVED = {**D0_EVENTS, "kv_events_endpoint": "tcp://10.0.0.1:6557"}
P0_EVENTS = {"kv_events_endpoint": "ipc:///run/p0-events"}  # no replay socket, vLLM's default topic


@dataclass(frozen=True)
class SubscriptionPoll:
    t: float
    redis: Mapping[str, str | None] | None  # as Poll.redis
    subscribed: Mapping[str, tuple[str, str | None, str]]  # node -> (pub, replay, topic)
    changed: bool  # kv_events_version moved


SUBSCRIPTION_SCRIPT = (
    SubscriptionPoll(
        0.0,
        {"p0": beat("p0", 1, **P0_EVENTS), "d0": beat("d0", 1, **D0_EVENTS), "d1": beat("d1", 1)},
        {"p0": ("ipc:///run/p0-events", None, ""), "d0": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv-events")},
        changed=True,
    ),
    # new beats advertising the same sockets, and d1 still none: nothing to do
    SubscriptionPoll(
        0.1,
        {"p0": beat("p0", 2, **P0_EVENTS), "d0": beat("d0", 2, **D0_EVENTS), "d1": beat("d1", 2)},
        {"p0": ("ipc:///run/p0-events", None, ""), "d0": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv-events")},
        changed=False,
    ),
    # d0 restarted its engine on another port; d1 starts publishing
    SubscriptionPoll(
        0.2,
        {"p0": beat("p0", 3, **P0_EVENTS), "d0": beat("d0", 3, **D0_MOVED), "d1": beat("d1", 3, **D0_EVENTS)},
        {
            "p0": ("ipc:///run/p0-events", None, ""),
            "d0": ("tcp://10.0.0.1:6557", "tcp://10.0.0.1:5558", "kv-events"),
            "d1": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv-events"),
        },
        changed=True,
    ),
    # a malformed value keeps d0's last good state, sockets included
    SubscriptionPoll(
        0.3,
        {"p0": beat("p0", 4, **P0_EVENTS), "d0": "{", "d1": beat("d1", 4, **D0_EVENTS)},
        {
            "p0": ("ipc:///run/p0-events", None, ""),
            "d0": ("tcp://10.0.0.1:6557", "tcp://10.0.0.1:5558", "kv-events"),
            "d1": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv-events"),
        },
        changed=False,
    ),
    # d0's key expired: it leaves the view and its subscription; p0 stops advertising
    SubscriptionPoll(
        0.4,
        {"p0": beat("p0", 5), "d1": beat("d1", 5, **D0_EVENTS)},
        {"d1": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv-events")},
        changed=True,
    ),
    # Redis lost: the last view stays, and so do its subscriptions (their own connections say
    # whether the nodes are alive)
    SubscriptionPoll(0.5, DOWN, {"d1": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv-events")}, changed=False),
)


def test_kv_event_subscriptions_follow_the_view() -> None:
    m = Membership()
    version = m.kv_events_version
    for poll in SUBSCRIPTION_SCRIPT:
        if poll.redis is DOWN:
            m.poll_failed(poll.t)
        else:
            m.poll_succeeded(poll.redis.items(), poll.t)
        got = {n: (e.pub, e.replay, e.topic) for n, e in m.kv_event_endpoints().items()}
        assert got == poll.subscribed, poll.t
        assert (m.kv_events_version != version) == poll.changed, poll.t
        version = m.kv_events_version


def test_static_fallback_nodes_advertise_no_kv_events() -> None:
    m = Membership(MembershipConfig(fallback_prefill=("p0=10.0.0.1:8001",), fallback_decode=("d0=10.0.0.2:8201",)))
    m.poll_failed(0.0)
    assert m.static_fallback and dict(m.kv_event_endpoints()) == {}
