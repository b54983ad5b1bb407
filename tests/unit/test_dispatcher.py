"""Dispatcher.route: parsing, the policy on the live view, reservations and the answer it builds.

The cluster is an in-memory fake of ``kairos.extproc.cluster.RedisClusterView``: a real
:class:`~kairos.core.view.ClusterTracker` fed with node states, a dict of addresses, and a
``try_reserve`` that records its calls and refuses the nodes a test names (and everything while
degraded, as the real one does). Policies are the real ones on the packaged latency profile, the
tokenizer is the tiny model's, and the clock is frozen at ``NOW``.

With the packaged profile and the nodes below (d0 lighter than d1, chi_p = 2048):

- an idle cluster keeps a 4000-token prompt (decode-side chunking is slower than an empty
  prefill node) on p0, decoding on d0;
- prefill queues of 4 x 8000 tokens make a 1000-token prompt deflect to d0, else to d1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, normalizers

import kairos.extproc.dispatcher as dispatcher_module
from kairos.api.openai_request import ParsedRequest, RequestLimits
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.http_errors import INTERNAL_MESSAGE
from kairos.core.algorithm import DeciderConfig
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels, load_profile
from kairos.core.policies import NoPrefillPoolPolicy, Policy, create_policy
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.core.view import ClusterTracker
from kairos.extproc.cluster import NodeAddress
from kairos.extproc.dispatcher import Dispatcher, DispatchSettings, Policies, Rejected, RequestHead, Routed
from kairos.extproc.metrics import DispatcherMetrics
from kairos.extproc.reservations import REFUSED, Promise, Reservation
from kairos.launcher.tinymodel import build_tiny_model
from tests.builders import queue_load
from tests.waiting import eventually

NOW = 100.0
OWNER = "dispatcher-under-test"
TOKEN_ID = 7  # any id in the tiny model's vocabulary; token-id prompts are counted as given
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
LOADED_QUEUE = (8000, 8000, 8000, 8000)

ADDRESSES: dict[str, NodeAddress] = {
    "p0": NodeAddress("prefill", "10.0.0.1:8001", "", "tiny"),
    "p1": NodeAddress("prefill", "10.0.0.2:8001", "", "tiny"),
    "d0": NodeAddress("decode", "10.0.1.1:8101", "10.0.1.1:8201", "tiny"),
    "d1": NodeAddress("decode", "10.0.1.2:8101", "10.0.1.2:8201", "tiny"),
}
SIDECAR = {node: a.sidecar for node, a in ADDRESSES.items() if a.role == "decode"}


# ---------------------------------------------------------------------------------------------
# The fake cluster
# ---------------------------------------------------------------------------------------------
@dataclass
class FakeCluster:
    """What the dispatcher reads from ``RedisClusterView``, in memory."""

    tracker: ClusterTracker = field(default_factory=ClusterTracker)
    nodes: dict[str, NodeAddress] = field(default_factory=dict)
    refuse: set[str] = field(default_factory=set)  # Redis takes no promise on these
    foreign: dict[str, tuple[int, ...]] = field(default_factory=dict)  # other dispatchers' promises
    degraded: bool = False  # as in RedisClusterView: no reservation is granted while degraded
    reservations: list[tuple[str, str]] = field(default_factory=list)  # (node_id, owner) per call
    recorded: list[tuple[Decision, float]] = field(default_factory=list)

    def now(self) -> float:
        return NOW

    def view(self) -> ClusterView:
        return self.tracker.view()

    def record(self, decision: Decision, now: float) -> object:
        self.recorded.append((decision, now))
        return (decision, now, self.tracker.record(decision, now))

    def cancel(self, handle: object) -> None:
        decision, now, tracked = handle  # type: ignore[misc]
        self.recorded.remove((decision, now))
        self.tracker.cancel(tracked)

    def addresses(self) -> Mapping[str, NodeAddress]:
        return self.nodes

    def decode_sidecars(self) -> tuple[str, ...]:
        return tuple(sorted({a.sidecar for a in self.nodes.values() if a.role == "decode" and a.sidecar}))

    async def try_reserve(self, node_id: str, owner: str, tokens: int) -> Reservation:
        """As the real one: refused while degraded or for a ``refuse`` node (Redis did not take
        it); refused with the promises of ``foreign`` until the view counts them."""
        self.reservations.append((node_id, owner))
        if self.degraded or node_id in self.refuse:
            return REFUSED
        promised = self.foreign.get(node_id, ())
        if sum(promised) > self.tracker.foreign_tokens(node_id):
            self.tracker.set_foreign(node_id, [(NOW, t, f"other|{i}|{t}") for i, t in enumerate(promised)])
            return Reservation(False, tuple(Promise(0.0, t) for t in promised))
        return Reservation(True)


def make_cluster(
    *,
    prefill_queue: tuple[int, ...] = (),
    decode_age_s: float = 0.0,
    decode: bool = True,
    prefill: bool = True,
    prefill_age_s: float = 0.0,
    refuse: tuple[str, ...] = (),
    foreign: dict[str, tuple[int, ...]] | None = None,
    degraded: bool = False,
) -> FakeCluster:
    """p0 and p1 with ``prefill_queue`` each; d0 (B=8) and d1 (B=16), both with room for any prompt."""
    tracker = ClusterTracker()
    for node_id in ("p0", "p1") if prefill else ():
        tracker.update_prefill(
            PrefillNodeState.from_queue(node_id, prefill_queue, chunk_tokens=2048, reported_at=NOW - prefill_age_s)
        )
    nodes = {k: v for k, v in ADDRESSES.items() if v.role == "prefill" and prefill}
    if decode:
        for node_id, b, k in (("d0", 8, 1000), ("d1", 16, 5000)):
            tracker.update_decode(
                DecodeNodeState(node_id, b, k, kv_capacity_tokens=100_000, reported_at=NOW - decode_age_s)
            )
            nodes[node_id] = ADDRESSES[node_id]
    return FakeCluster(tracker=tracker, nodes=nodes, refuse=set(refuse), foreign=foreign or {}, degraded=degraded)


class ExplodingPolicy:
    """A policy with a bug: every decision raises."""

    label = "exploding"
    fresh_state = False

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        raise RuntimeError("secret internal detail: index out of range in node table")


@dataclass(frozen=True)
class SplittingPolicy:
    """Splits every prompt on p1 and d1 at k = 256: what the dispatcher makes of a split decision
    (the decision itself is kairos.core.algorithm.split's, tested in test_split.py)."""

    label = "splitting"
    fresh_state = False

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        rest = prompt_tokens - 256
        return Decision(
            Route.SPLIT,
            Reason.SPLIT_WITHIN_MARGIN,
            "d1",
            "p1",
            (rest // 2, rest - rest // 2),
            0.9,
            0.8,
            prompt_tokens,
            step_budget_s=0.06,
            predicted_step_s=(0.05, 0.05),
            predicted_prefill_end_s=0.3,
            split_tokens=256,
        )


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("dispatcher-model"))
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def models() -> LatencyModels:
    return load_profile()


@dataclass
class Harness:
    dispatcher: Dispatcher
    cluster: FakeCluster
    metrics: DispatcherMetrics

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


HarnessFactory = Callable[..., Harness]


@pytest.fixture
def harness(tokenizer: PromptTokenizer, models: LatencyModels) -> Iterator[HarnessFactory]:
    """Builds a dispatcher around a fake cluster; every dispatcher built is closed afterwards."""
    built: list[Dispatcher] = []

    def build(
        cluster: FakeCluster,
        policy: Policy | None = None,
        settings: DispatchSettings | None = None,
        no_prefill_policy: Policy | None = None,
        counter: PromptTokenizer | None = None,
    ) -> Harness:
        metrics = DispatcherMetrics(CollectorRegistry())
        dispatcher = Dispatcher(
            counter or tokenizer,
            policy or create_policy("kairos", models),
            create_policy("pd", models),
            cluster,
            metrics,
            settings or DispatchSettings(dispatcher_id=OWNER),
            no_prefill_policy=no_prefill_policy,
        )
        built.append(dispatcher)
        return Harness(dispatcher, cluster, metrics)

    yield build
    for dispatcher in built:
        dispatcher.close()


def completion_body(tokens: int, *, size: int | None = None, **extra: Any) -> bytes:
    """A completions body whose prompt is ``tokens`` token ids, padded with JSON whitespace to ``size`` bytes."""
    body = json.dumps({"model": "tiny", "prompt": [TOKEN_ID] * tokens, "max_tokens": 8, **extra}, separators=(",", ":"))
    raw = body.encode()
    if size is not None:
        assert size >= len(raw), f"body is already {len(raw)} bytes"
        raw = raw[:-1] + b" " * (size - len(raw)) + b"}"
    return raw


def headers_of(routed: Routed) -> dict[str, str]:
    names = [name for name, _ in routed.set_headers]
    assert len(names) == len(set(names)), f"a header is set twice: {names}"
    return dict(routed.set_headers)


def error_of(rejected: Rejected) -> dict[str, Any]:
    body = json.loads(rejected.body)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---------------------------------------------------------------------------------------------
# Routing outcomes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouteCase:
    cluster: dict[str, Any]  # make_cluster keywords
    prompt_tokens: int
    route: Route
    reason: Reason
    decode_node: str
    prefill_node: str | None
    reservations: tuple[str, ...]  # nodes try_reserve was asked for, in order
    conflicts: int  # reservation_conflicts metric afterwards


ROUTE_CASES = [
    pytest.param(
        RouteCase({}, 4000, Route.KEEP, Reason.KEEP_SLO_ROOM, "d0", "p0", (), 0),
        id="idle cluster (SLO room), long prompt keeps on p0 and decodes on the lighter d0",
    ),
    pytest.param(
        RouteCase(
            {"prefill_queue": LOADED_QUEUE}, 1000, Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN, "d0", None, ("d0",), 0
        ),
        id="loaded prefill queues, short prompt deflects to d0 after reserving it",
    ),
    pytest.param(
        RouteCase(
            {"prefill_queue": LOADED_QUEUE, "refuse": ("d0",)},
            1000,
            Route.DEFLECT,
            Reason.DEFLECT_WITHIN_MARGIN,
            "d1",
            None,
            ("d0", "d1"),
            1,
        ),
        id="Redis takes no promise on d0: it deflects to d1",
    ),
    pytest.param(
        RouteCase(
            {"prefill_queue": LOADED_QUEUE, "refuse": ("d0", "d1")},
            1000,
            Route.KEEP,
            Reason.KEEP_POLICY,
            "d0",
            "p0",
            ("d0", "d1"),
            2,
        ),
        id="Redis takes no promise on any decode node: keeps on the P/D path, never 503",
    ),
    pytest.param(
        RouteCase(
            {"prefill_queue": LOADED_QUEUE, "foreign": {"d0": (3000,)}},
            1000,
            Route.DEFLECT,
            Reason.DEFLECT_WITHIN_MARGIN,
            "d1",
            None,
            ("d0", "d1"),
            1,
        ),
        id="another dispatcher's deflection onto d0 joins the view: d0 is slower behind it, d1 takes it",
    ),
    pytest.param(
        RouteCase(
            {"prefill_queue": LOADED_QUEUE, "degraded": True},
            1000,
            Route.KEEP,
            Reason.KEEP_POLICY,
            "d0",
            "p0",
            ("d0", "d1"),
            2,
        ),
        id="degraded cluster grants no reservation so a deflection keeps",
    ),
    pytest.param(
        RouteCase(
            {"prefill_queue": LOADED_QUEUE, "decode_age_s": 1.0},
            1000,
            Route.KEEP,
            Reason.KEEP_NO_ELIGIBLE_DECODE,
            "d0",
            "p0",
            (),
            0,
        ),
        id="stale decode nodes keep with keep_no_eligible_decode",
    ),
]


@pytest.mark.parametrize("case", ROUTE_CASES)
async def test_route_outcome(harness: HarnessFactory, case: RouteCase) -> None:
    h = harness(make_cluster(**case.cluster))
    routed = await h.dispatcher.route(
        RequestHead.of("POST", COMPLETIONS, {"content-type": "application/json"}), completion_body(case.prompt_tokens)
    )

    assert isinstance(routed, Routed), routed
    decision = routed.decision
    assert decision is not None
    assert (decision.route, decision.reason) == (case.route, case.reason)
    assert (decision.decode_node, decision.prefill_node) == (case.decode_node, case.prefill_node)
    assert decision.prompt_tokens == case.prompt_tokens
    other = "d1" if case.decode_node == "d0" else "d0"
    assert routed.destinations == (SIDECAR[case.decode_node], SIDECAR[other])
    assert routed.remove_headers == ()

    headers = headers_of(routed)
    assert headers[c.H_ROUTE] == case.route.value
    assert headers[c.H_REASON] == case.reason.value
    assert headers[c.H_DECODE_NODE] == case.decode_node
    assert headers[c.H_PROMPT_TOKENS] == str(case.prompt_tokens)
    assert len(headers[c.H_REQUEST_ID]) == 32 and int(headers[c.H_REQUEST_ID], 16) >= 0  # a fresh uuid hex
    assert float(headers[c.H_PRED_TTFT_PREFILL_MS]) == pytest.approx(decision.predicted_ttft_prefill_s * 1e3, abs=0.1)
    if case.route is Route.KEEP:
        assert headers[c.H_PREFILL_HOST] == ADDRESSES[case.prefill_node or ""].url
        assert c.H_CHUNK_SCHEDULE not in headers
        # the keep's decode node's budget, for a local prefill should the prefill node fail
        assert float(headers[c.H_STEP_BUDGET_MS]) == pytest.approx(70.0)
    else:
        schedule = [int(x) for x in headers[c.H_CHUNK_SCHEDULE].split(",")]
        assert sum(schedule) == case.prompt_tokens
        assert tuple(schedule) == decision.chunk_sizes
        assert float(headers[c.H_STEP_BUDGET_MS]) == pytest.approx(70.0)  # beta x tau of the defaults
        assert float(headers[c.H_PRED_TTFT_DECODE_MS]) > 0
        assert c.H_PREFILL_HOST not in headers

    assert h.cluster.reservations == [(node, OWNER) for node in case.reservations]
    assert h.dispatcher.owner == OWNER
    assert h.sample("kairos_dispatcher_reservation_conflicts_total") == case.conflicts
    assert h.sample("kairos_dispatcher_decisions_total", route=case.route.value, reason=case.reason.value) == 1
    assert h.sample("kairos_dispatcher_decision_seconds_count") == 1
    # The policy's own time, once per request (every attempt summed), within the whole decision's.
    assert h.sample("kairos_dispatcher_policy_seconds_count") == 1
    assert 0 < h.sample("kairos_dispatcher_policy_seconds_sum") <= h.sample("kairos_dispatcher_decision_seconds_sum")
    assert h.cluster.recorded == [(decision, NOW)]


@dataclass(frozen=True)
class AnchorCase:
    policy: str
    cluster: dict[str, Any]  # make_cluster keywords
    route: Route
    reason: Reason
    decode_node: str
    reservations: tuple[str, ...]


ANCHOR_CASES = [
    pytest.param(
        AnchorCase("llmd:threshold=2000", {}, Route.DEFLECT, Reason.DEFLECT_LLMD_THRESHOLD, "d0", ("d0",)),
        id="llmd: 1000 tokens below 2000 prefill on the least-loaded d0, reserved",
    ),
    pytest.param(
        AnchorCase(
            "llmd:threshold=2000", {"refuse": ("d0",)}, Route.DEFLECT, Reason.DEFLECT_LLMD_THRESHOLD, "d1", ("d0", "d1")
        ),
        id="llmd: d0 reserved elsewhere, d1 takes it",
    ),
    pytest.param(
        AnchorCase("llmd", {}, Route.KEEP, Reason.KEEP_LLMD_THRESHOLD, "d0", ()),
        id="llmd defaults: 1000 >= 16 uncached tokens disaggregate",
    ),
    pytest.param(
        AnchorCase(
            "dynamo:mode=load",
            {"prefill_queue": LOADED_QUEUE},
            Route.DEFLECT,
            Reason.DEFLECT_DYNAMO_LOAD,
            "d0",
            ("d0",),
        ),
        id="dynamo load: 32000 queued tokens > 4 x 2048 bypass to d0",
    ),
    pytest.param(
        AnchorCase("dynamo", {"prefill_queue": LOADED_QUEUE}, Route.KEEP, Reason.KEEP_DYNAMO_RULE, "d0", ()),
        id="dynamo isl_bounding: an uncached prompt never bypasses",
    ),
    pytest.param(
        AnchorCase(
            "aibrix", {"prefill_queue": LOADED_QUEUE}, Route.DEFLECT, Reason.DEFLECT_AIBRIX_DRAIN, "d0", ("d0",)
        ),
        id="aibrix: the prefill pool drains slowly, d0 is idle: combined",
    ),
    pytest.param(
        AnchorCase("aibrix", {}, Route.KEEP, Reason.KEEP_AIBRIX_DRAIN, "d0", ()),
        id="aibrix: idle pool keeps P/D",
    ),
]


@pytest.mark.parametrize("case", ANCHOR_CASES)
async def test_the_fields_deciders_route_through_the_gateway(
    harness: HarnessFactory, models: LatencyModels, case: AnchorCase
) -> None:
    """The gateway runs the field's deciders as it runs Kairos: a deflection wins its decode
    node's reservation and carries its fixed-budget schedule, with no step budget."""
    h = harness(make_cluster(**case.cluster), create_policy(case.policy, models))
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))

    assert isinstance(routed, Routed), routed
    headers = headers_of(routed)
    assert (headers[c.H_ROUTE], headers[c.H_REASON]) == (case.route.value, case.reason.value)
    assert headers[c.H_DECODE_NODE] == case.decode_node
    assert h.cluster.reservations == [(node, OWNER) for node in case.reservations]
    assert h.sample("kairos_dispatcher_decisions_total", route=case.route.value, reason=case.reason.value) == 1
    if case.route is Route.DEFLECT:
        assert headers[c.H_CHUNK_SCHEDULE] == "1000"  # 1000 tokens fit one step of 4096 minus 8 or 16 decodes
        assert c.H_STEP_BUDGET_MS not in headers and c.H_PREFILL_HOST not in headers
    else:
        assert headers[c.H_PREFILL_HOST] == ADDRESSES["p0"].url


async def test_chat_request_is_counted_with_the_template_and_routed(
    harness: HarnessFactory, tokenizer: PromptTokenizer
) -> None:
    messages = [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "tell me about the quick brown fox " * 20},
    ]
    h = harness(make_cluster())
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 8}).encode()
    routed = await h.dispatcher.route(RequestHead.of("POST", CHAT + "?trace=1", {}), body)

    assert isinstance(routed, Routed)
    expected = tokenizer.count_chat_prompt(messages, True)
    assert routed.decision is not None and routed.decision.prompt_tokens == expected
    assert headers_of(routed)[c.H_PROMPT_TOKENS] == str(expected)


async def test_the_first_deflection_fills_d0_so_the_next_one_goes_to_d1(harness: HarnessFactory) -> None:
    h = harness(make_cluster(prefill_queue=LOADED_QUEUE))
    first = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))
    second = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(900))

    assert isinstance(first, Routed) and isinstance(second, Routed)
    assert first.decision is not None and second.decision is not None
    assert (first.decision.route, first.decision.decode_node) == (Route.DEFLECT, "d0")
    assert (second.decision.route, second.decision.decode_node) == (Route.DEFLECT, "d1")
    assert h.cluster.reservations == [("d0", OWNER), ("d1", OWNER)]


async def test_each_decision_is_logged_at_debug_and_only_then(
    harness: HarnessFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """One line per routed request at DEBUG, with the route, the reason and the chunk schedule;
    none at INFO (the line's arguments are not even formatted then)."""
    h = harness(make_cluster(prefill_queue=LOADED_QUEUE))
    with caplog.at_level("INFO", logger="kairos.extproc.dispatcher"):
        await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {c.H_REQUEST_ID: "quiet"}), completion_body(1000))
    assert not [r for r in caplog.records if "quiet" in r.getMessage()]

    with caplog.at_level("DEBUG", logger="kairos.extproc.dispatcher"):
        routed = await h.dispatcher.route(
            RequestHead.of("POST", COMPLETIONS, {c.H_REQUEST_ID: "told"}), completion_body(900)
        )
    assert isinstance(routed, Routed) and routed.decision is not None
    (line,) = [r.getMessage() for r in caplog.records if "told" in r.getMessage()]
    chunks = c.encode_chunk_schedule(routed.decision.chunk_sizes)
    assert "deflect (deflect_within_margin) prompt=900" in line and f"chunks={chunks}" in line


# ---------------------------------------------------------------------------------------------
# Decisions are recorded into the cluster view
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("refused", [False, True], ids=["promised", "promise refused"])
async def test_a_split_sends_its_prefill_host_k_and_the_rests_schedule_after_a_promise(
    harness: HarnessFactory, refused: bool
) -> None:
    h = harness(make_cluster(refuse=("d1",) if refused else ()), policy=SplittingPolicy())  # type: ignore[arg-type]
    routed = await h.dispatcher.route(
        RequestHead.of("POST", COMPLETIONS, {"content-type": "application/json"}), completion_body(1000)
    )
    assert isinstance(routed, Routed), routed
    headers = headers_of(routed)
    assert h.cluster.reservations[0] == ("d1", OWNER)  # its rest plans d1's step budget: a promise first
    if refused:  # no other node to split onto: the P/D path, never a 503
        assert headers[c.H_ROUTE] == Route.KEEP.value and c.H_SPLIT_TOKENS not in headers
        return
    assert headers[c.H_ROUTE] == Route.SPLIT.value and headers[c.H_REASON] == Reason.SPLIT_WITHIN_MARGIN.value
    assert headers[c.H_DECODE_NODE] == "d1" and headers[c.H_PREFILL_HOST] == ADDRESSES["p1"].url
    assert c.parse_split_tokens(headers[c.H_SPLIT_TOKENS], 1000) == 256
    assert c.parse_chunk_schedule_header(headers[c.H_CHUNK_SCHEDULE]) == (372, 372)
    assert float(headers[c.H_STEP_BUDGET_MS]) == pytest.approx(60.0)
    assert float(headers[c.H_PRED_TTFT_DECODE_MS]) == pytest.approx(800.0)
    assert routed.destinations[0] == SIDECAR["d1"]
    # In the view: its first k on p1, its rest in d1's backlog.
    view = h.cluster.view()
    assert {n.node_id: n.outstanding_tokens for n in view.prefill}["p1"] == 256
    assert {n.node_id: n.prefill_backlog_tokens for n in view.decode}["d1"] == (744,)
    assert h.sample("kairos_dispatcher_split_prefill_share_sum") == pytest.approx(0.256)


async def test_a_keep_joins_the_chosen_prefill_queue_in_the_view(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    assert queue_load(h.cluster.view().prefill[0]) == (0, 0, 0)
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(4000))

    assert isinstance(routed, Routed) and routed.decision is not None
    assert routed.decision.route is Route.KEEP and routed.decision.prefill_node == "p0"
    prefill = {n.node_id: n for n in h.cluster.view().prefill}
    assert queue_load(prefill["p0"]) == queue_load((4000,))
    assert queue_load(prefill["p1"]) == (0, 0, 0)
    assert all(n.prefill_backlog_tokens == () for n in h.cluster.view().decode)


async def test_a_deflection_joins_the_decode_node_backlog_in_the_view(harness: HarnessFactory) -> None:
    h = harness(make_cluster(prefill_queue=LOADED_QUEUE))
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))

    assert isinstance(routed, Routed) and routed.decision is not None
    assert routed.decision.route is Route.DEFLECT
    decode = {n.node_id: n for n in h.cluster.view().decode}
    assert decode["d0"].prefill_backlog_tokens == (1000,)
    assert decode["d1"].prefill_backlog_tokens == ()
    assert all(queue_load(n) == queue_load(LOADED_QUEUE) for n in h.cluster.view().prefill)


# ---------------------------------------------------------------------------------------------
# Client-sent x-kairos-* headers and the request id
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpoofCase:
    prefill_queue: tuple[int, ...]
    client_headers: dict[str, str]
    removed: tuple[str, ...]
    request_id: str | None  # None: a fresh one is generated


SPOOF_CASES = [
    pytest.param(
        SpoofCase(
            (),
            {
                "x-kairos-route": "deflect",
                "x-kairos-chunk-schedule": "1,1,1",
                "x-kairos-debug": "on",
                "x-request-id": "client-req-42",
                "content-type": "application/json",
            },
            ("x-kairos-chunk-schedule", "x-kairos-debug"),
            "client-req-42",
        ),
        id="keep overwrites the route header, removes a forged schedule and unknown x-kairos header, keeps the id",
    ),
    pytest.param(
        SpoofCase(
            LOADED_QUEUE,
            {"x-kairos-chunk-schedule": "1", "x-kairos-prefill-host": "evil:1", "x-kairos-step-budget-ms": "999"},
            ("x-kairos-prefill-host",),
            None,
        ),
        id="deflect overwrites schedule and budget, removes a forged prefill host",
    ),
    pytest.param(
        SpoofCase((), {"X-Kairos-Route": "deflect", "X-Kairos-Extra": "1"}, ("X-Kairos-Extra",), None),
        id="header names are matched without case",
    ),
]


@pytest.mark.parametrize("case", SPOOF_CASES)
async def test_client_kairos_headers_are_overwritten_or_removed(harness: HarnessFactory, case: SpoofCase) -> None:
    h = harness(make_cluster(prefill_queue=case.prefill_queue))
    tokens = 4000 if not case.prefill_queue else 1000
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, case.client_headers), completion_body(tokens))

    assert isinstance(routed, Routed) and routed.decision is not None
    headers = headers_of(routed)
    assert sorted(routed.remove_headers) == sorted(case.removed)
    set_names = set(headers)
    assert not set_names & {name.lower() for name in routed.remove_headers}
    for name, value in case.client_headers.items():
        if name.lower() in set_names and name.lower() != c.H_REQUEST_ID:
            assert headers[name.lower()] != value, f"{name} still carries the client's value"
    assert headers[c.H_ROUTE] == routed.decision.route.value
    if case.request_id is None:
        assert len(headers[c.H_REQUEST_ID]) == 32
    else:
        assert headers[c.H_REQUEST_ID] == case.request_id


async def test_pass_through_removes_every_client_kairos_header(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    routed = await h.dispatcher.route(
        RequestHead.of("GET", "/v1/models", {"x-kairos-route": "keep", "accept": "*/*"}), None
    )
    assert isinstance(routed, Routed)
    assert routed.remove_headers == ("x-kairos-route",)
    assert routed.set_headers == ()


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RejectCase:
    method: str
    path: str
    body: bytes | None
    status: int
    code: str
    error_type: str
    param: str | None
    message_has: str
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


REJECT_CASES = [
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            b'{"prompt": "hi", ',
            400,
            "invalid_request",
            "invalid_request_error",
            None,
            "not valid JSON",
        ),
        id="malformed JSON is a 400",
    ),
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            b'{"prompt": ""}',
            400,
            "invalid_request",
            "invalid_request_error",
            "prompt",
            "prompt is empty",
        ),
        id="empty prompt is a 400 naming prompt",
    ),
    pytest.param(
        RejectCase("POST", COMPLETIONS, None, 400, "invalid_request", "invalid_request_error", None, "not valid JSON"),
        id="POST without a body is a 400",
    ),
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            completion_body(32_768, max_tokens=None),
            400,
            "invalid_request",
            "invalid_request_error",
            "prompt",
            "maximum context length is 32768",
        ),
        id="prompt longer than the context is a 400",
    ),
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            completion_body(300_000),
            400,
            "invalid_request",
            "invalid_request_error",
            "prompt",
            "more than 32768 input tokens",  # counting stopped past the context
        ),
        id="a prompt far over the context is refused once counted past it",
    ),
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            completion_body(100, max_tokens=32_700),
            400,
            "invalid_request",
            "invalid_request_error",
            "max_tokens",
            "maximum context length",
        ),
        id="prompt plus max_tokens over the context is a 400 naming max_tokens",
    ),
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            b"{" + b" " * (8 * 1024 * 1024) + b"}",
            413,
            "payload_too_large",
            "invalid_request_error",
            None,
            "over the gateway's limit",
        ),
        id="body over the 8 MB limit is a 413",
    ),
    pytest.param(
        RejectCase(
            "POST",
            "/v1/embeddings",
            b'{"input": "hi"}',
            404,
            "not_found",
            "invalid_request_error",
            None,
            "/v1/embeddings",
        ),
        id="unknown POST path is a 404",
    ),
    pytest.param(
        RejectCase("GET", "/kairos/state", None, 404, "not_found", "invalid_request_error", None, "/kairos/state"),
        id="a node-internal path is a 404",
    ),
    pytest.param(
        RejectCase("GET", "/metrics", None, 404, "not_found", "invalid_request_error", None, "/metrics"),
        id="the node's metrics are not public",
    ),
    pytest.param(
        RejectCase("PUT", "/kairos/kv/pull", b"{}", 404, "not_found", "invalid_request_error", None, "kv/pull"),
        id="the KV pull is not public",
    ),
    pytest.param(
        RejectCase("DELETE", COMPLETIONS, None, 405, "method_not_allowed", "invalid_request_error", None, "use POST"),
        id="another method on an inference path is a 405",
    ),
    pytest.param(
        RejectCase("POST", "/v1/models", b"{}", 405, "method_not_allowed", "invalid_request_error", None, "use GET"),
        id="POST /v1/models is a 405",
    ),
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            b"\x1f\x8b",
            415,
            "unsupported_content_encoding",
            "invalid_request_error",
            None,
            "'gzip' is not supported",
            {"content-encoding": "gzip"},
        ),
        id="a gzip body is a 415",
    ),
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            b"{}",
            415,
            "unsupported_content_encoding",
            "invalid_request_error",
            None,
            "'br' is not supported",
            {"content-encoding": "br"},
        ),
        id="a brotli body is a 415",
    ),
    pytest.param(
        RejectCase(
            "POST",
            COMPLETIONS,
            b'{"prompt": "a \xed\xa0\x80 b"}',
            400,
            "invalid_request",
            "invalid_request_error",
            None,
            "not valid UTF-8",
        ),
        id="raw surrogate bytes in the prompt are a 400",
    ),
]


@pytest.mark.parametrize("case", REJECT_CASES)
async def test_bad_input_is_rejected(harness: HarnessFactory, case: RejectCase) -> None:
    h = harness(make_cluster())
    rejected = await h.dispatcher.route(RequestHead.of(case.method, case.path, case.headers), case.body)

    assert isinstance(rejected, Rejected), rejected
    assert (rejected.status, rejected.code) == (case.status, case.code)
    error = error_of(rejected)
    assert (error["code"], error["type"], error["param"]) == (case.code, case.error_type, case.param)
    assert case.message_has in error["message"]
    assert h.sample("kairos_dispatcher_rejections_total", code=case.code) == 1
    assert h.cluster.recorded == [] and h.cluster.reservations == []
    assert h.sample("kairos_dispatcher_decision_seconds_count") == 0


async def test_rejections_are_counted_per_code(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    for body in (b"nope", b"[]", b'{"prompt": ""}'):
        assert isinstance(await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), body), Rejected)
    assert isinstance(await h.dispatcher.route(RequestHead.of("POST", "/v1/nothing", {}), b"{}"), Rejected)
    assert h.sample("kairos_dispatcher_rejections_total", code="invalid_request") == 3
    assert h.sample("kairos_dispatcher_rejections_total", code="not_found") == 1


# ---------------------------------------------------------------------------------------------
# No nodes, pass-through paths and internal errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        pytest.param("POST", COMPLETIONS, completion_body(100), id="no decode node makes a completion a 503"),
        pytest.param("GET", "/v1/models", None, id="no decode node makes GET /v1/models a 503"),
    ],
)
async def test_no_decode_node_is_503(harness: HarnessFactory, method: str, path: str, body: bytes | None) -> None:
    h = harness(make_cluster(decode=False))
    rejected = await h.dispatcher.route(RequestHead.of(method, path, {}), body)

    assert isinstance(rejected, Rejected), rejected
    assert (rejected.status, rejected.code) == (503, "no_healthy_node")
    error = error_of(rejected)
    assert (error["code"], error["type"]) == ("no_healthy_node", "service_unavailable")
    assert h.sample("kairos_dispatcher_rejections_total", code="no_healthy_node") == 1


@pytest.mark.parametrize(
    ("policy", "cluster"),
    [
        pytest.param("kairos", {"prefill": False}, id="kairos, no prefill node"),
        pytest.param("pd", {"prefill": False}, id="pd, no prefill node"),
        pytest.param("kairos", {"prefill_age_s": 5.0}, id="kairos, only stale prefill nodes (kept as last resort)"),
    ],
)
async def test_no_prefill_node_degrades_to_a_decode_node_prefilling(
    harness: HarnessFactory, models: LatencyModels, policy: str, cluster: dict[str, Any]
) -> None:
    """With no fresh prefill node (dead, or heartbeats lost), a decode node prefills the request
    itself under a TBT-safe schedule, whatever the policy, instead of a 503."""
    h = harness(
        make_cluster(**cluster),
        create_policy(policy, models),
        no_prefill_policy=NoPrefillPoolPolicy(models, DeciderConfig()),
    )
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(3000))

    assert isinstance(routed, Routed), routed
    headers = dict(routed.set_headers)
    assert headers[c.H_ROUTE] == "deflect" and headers[c.H_REASON] == "deflect_no_prefill_node"
    assert headers[c.H_DECODE_NODE] == "d0"  # B=8 beats d1's B=16
    assert routed.decision.predicted_ttft_prefill_s is None and routed.decision.predicted_ttft_decode_s
    assert h.sample("kairos_dispatcher_decisions_total", route="deflect", reason="deflect_no_prefill_node") == 1
    assert h.cluster.reservations == []  # serving beats serialising: no reservation round trip


@pytest.mark.parametrize(
    ("cluster", "route", "reason"),
    [
        pytest.param(
            {"prefill_age_s": 0.35, "decode_age_s": 0.25, "degraded": True},
            "keep",
            "keep_slo_room",
            id="Redis lost: prefill beats aged past staleness a beat before decode's, still P/D",
        ),
        pytest.param(
            {"prefill": False, "degraded": True},
            "deflect",
            "deflect_no_prefill_node",
            id="Redis lost with no prefill node known at all: decode nodes prefill",
        ),
        pytest.param(
            {"prefill_age_s": 0.35, "decode_age_s": 0.25},
            "deflect",
            "deflect_no_prefill_node",
            id="Redis up: prefill beats stopped while decode's go on, the pool is gone",
        ),
    ],
)
async def test_a_redis_outage_is_not_mistaken_for_a_dead_prefill_pool(
    harness: HarnessFactory, models: LatencyModels, cluster: dict[str, Any], route: str, reason: str
) -> None:
    """Heartbeats stop together when Redis goes; the one published a little earlier turns stale a
    little earlier. That must not read as "every prefill node died" (a CI run deflected there)."""
    h = harness(
        make_cluster(**cluster),
        create_policy("kairos", models),
        no_prefill_policy=NoPrefillPoolPolicy(models, DeciderConfig(stale_after_s=0.3)),
    )
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(3000))

    assert isinstance(routed, Routed), routed
    headers = dict(routed.set_headers)
    assert (headers[c.H_ROUTE], headers[c.H_REASON]) == (route, reason)


async def test_late_prefill_nodes_and_no_decode_node_within_bounds_route_pd_not_503(
    harness: HarnessFactory, models: LatencyModels
) -> None:
    """Prefill beats late on a starved host while the decode nodes are past their overload line:
    the degraded mode cannot place the request, but the prefill nodes are known, so it goes P/D
    to them (their sidecar hop fails over if one is really gone) rather than a 503."""
    h = harness(
        make_cluster(prefill_age_s=0.5),
        create_policy("kairos", models),
        no_prefill_policy=NoPrefillPoolPolicy(models, DeciderConfig()),
    )
    tight = {c.H_SLO_TPOT_MS: "1"}  # every decode node's decode-only step is over a 1 ms line
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, tight), completion_body(3000))

    assert isinstance(routed, Routed), routed
    headers = dict(routed.set_headers)
    assert headers[c.H_ROUTE] == "keep" and routed.decision.prefill_node in ("p0", "p1")


async def test_no_prefill_node_known_and_no_decode_node_within_bounds_is_503(
    harness: HarnessFactory, models: LatencyModels
) -> None:
    h = harness(
        make_cluster(prefill=False),
        create_policy("kairos", models),
        no_prefill_policy=NoPrefillPoolPolicy(models, DeciderConfig()),
    )
    tight = {c.H_SLO_TPOT_MS: "1"}
    rejected = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, tight), completion_body(3000))
    assert isinstance(rejected, Rejected) and rejected.status == 503
    assert "over its overload line" in error_of(rejected)["message"]


async def test_no_prefill_node_without_the_degraded_policy_is_503(harness: HarnessFactory) -> None:
    rejected = await harness(make_cluster(prefill=False)).dispatcher.route(
        RequestHead.of("POST", COMPLETIONS, {}), completion_body(50)
    )
    assert isinstance(rejected, Rejected) and rejected.status == 503
    assert "no prefill node" in error_of(rejected)["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("GET", "/v1/models", id="GET /v1/models goes to a decode sidecar"),
        pytest.param("GET", "/health", id="GET /health goes to a decode sidecar"),
        pytest.param("GET", "/version", id="GET /version goes to a decode sidecar"),
        pytest.param("POST", "/tokenize", id="POST /tokenize goes to a decode sidecar"),
        pytest.param("POST", "/detokenize", id="POST /detokenize goes to a decode sidecar"),
    ],
)
async def test_pass_through_goes_to_decode_sidecars_round_robin(
    harness: HarnessFactory, method: str, path: str
) -> None:
    h = harness(make_cluster())
    first = await h.dispatcher.route(RequestHead.of(method, path, {}), None)
    second = await h.dispatcher.route(RequestHead.of(method, path, {}), None)

    assert isinstance(first, Routed) and isinstance(second, Routed)
    assert first.decision is None and second.decision is None
    assert first.destinations == (SIDECAR["d0"], SIDECAR["d1"])
    assert second.destinations == (SIDECAR["d1"], SIDECAR["d0"])
    assert first.set_headers == ()
    assert h.cluster.recorded == [] and h.cluster.reservations == []
    assert h.sample("kairos_dispatcher_decision_seconds_count") == 0


async def test_a_bug_in_the_policy_is_a_generic_500(harness: HarnessFactory, caplog: pytest.LogCaptureFixture) -> None:
    h = harness(make_cluster(), policy=ExplodingPolicy())
    with caplog.at_level("ERROR", logger="kairos.extproc.dispatcher"):
        rejected = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(100))

    assert isinstance(rejected, Rejected), rejected
    assert (rejected.status, rejected.code) == (500, "internal_error")
    error = error_of(rejected)
    assert error == {"message": INTERNAL_MESSAGE, "type": "internal_error", "param": None, "code": "internal_error"}
    assert b"secret" not in rejected.body and b"RuntimeError" not in rejected.body
    assert h.sample("kairos_dispatcher_rejections_total", code="internal_error") == 1
    assert any(r.exc_info and r.exc_info[0] is RuntimeError for r in caplog.records), "traceback not logged"
    assert h.cluster.recorded == []


# ---------------------------------------------------------------------------------------------
# Long bodies are parsed off the event loop
# ---------------------------------------------------------------------------------------------
def _refused_by_the_fast_counter(tokenizer: PromptTokenizer) -> PromptTokenizer:
    """The tiny model's tokenizer with an NFKC normalizer: counted by tokenizers' Rust encode."""
    raw = Tokenizer.from_str(tokenizer.raw_tokenizer.to_str())
    raw.normalizer = normalizers.NFKC()
    refused = PromptTokenizer(raw)
    assert refused.counter_refusal is not None
    return refused


@dataclass(frozen=True)
class ParseCase:
    size: int
    off_loop: bool
    text: str = "ascii"  # "ascii", "escaped" (a JSON \u escape) or "utf8" (raw non-ASCII bytes)
    python_counter: bool = True  # False: a tokenizer the exact Python counter refuses


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(ParseCase(2_000, False), id="small body on the loop"),
        pytest.param(ParseCase(16_384, False, "utf8"), id="16 KB of any text on the loop"),
        pytest.param(ParseCase(16_385, True, "utf8"), id="over 16 KB with non-ASCII text in the pool"),
        pytest.param(ParseCase(50_000, True, "escaped"), id="JSON-escaped non-ASCII in the pool"),
        pytest.param(ParseCase(200_000, False), id="200 KB of ASCII, counted in Python, on the loop"),
        pytest.param(ParseCase(262_144, False), id="ASCII up to count_inline_bytes on the loop"),
        pytest.param(ParseCase(262_145, True), id="ASCII over count_inline_bytes in the pool"),
        pytest.param(ParseCase(16_385, True, python_counter=False), id="over 16 KB counted by Rust in the pool"),
        pytest.param(ParseCase(16_384, False, python_counter=False), id="16 KB counted by Rust on the loop"),
    ],
)
async def test_where_a_body_is_parsed(
    harness: HarnessFactory, tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch, case: ParseCase
) -> None:
    """On the event loop unless Rust will do the work (it releases the GIL in a pool thread) or
    the body is long; the exact Python counter holds the GIL, so its ASCII bodies stay inline."""
    original = dispatcher_module.parse_request
    threads: list[int] = []

    def recording_parse(*args: Any, **kwargs: Any) -> ParsedRequest:
        threads.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(dispatcher_module, "parse_request", recording_parse)
    counter = None if case.python_counter else _refused_by_the_fast_counter(tokenizer)
    h = harness(make_cluster(), counter=counter)
    extra = {"ascii": {}, "escaped": {"user": "caf\u00e9"}, "utf8": {"user": "caf\u00e9"}}[case.text]
    body = completion_body(50, size=case.size, **extra)
    if case.text == "utf8":
        body = body.replace(b"caf\\u00e9", "caf\u00e9    ".encode())  # the same 9 bytes, raw UTF-8
    assert len(body) == case.size and body.isascii() is (case.text != "utf8")
    loop_thread = threading.get_ident()
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), body)

    assert isinstance(routed, Routed), routed
    assert routed.decision is not None and routed.decision.prompt_tokens == 50
    assert len(threads) == 1
    assert (threads[0] != loop_thread) is case.off_loop


async def test_the_loop_keeps_serving_while_a_long_body_is_parsed(
    harness: HarnessFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a slow parse runs in the pool, a small request on the same dispatcher completes."""
    original = dispatcher_module.parse_request
    started, release = threading.Event(), threading.Event()

    def slow_for_long_bodies(
        path: str, body: bytes, tokenizer: PromptTokenizer, limits: RequestLimits, **options: bool
    ) -> ParsedRequest:
        if len(body) > 16_384:
            started.set()
            assert release.wait(30), "the small request never finished"
        return original(path, body, tokenizer, limits, **options)

    monkeypatch.setattr(dispatcher_module, "parse_request", slow_for_long_bodies)
    h = harness(make_cluster())
    long_body = completion_body(50, size=300_000)  # over count_inline_bytes: parsed in the pool
    long_task = asyncio.create_task(h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), long_body))
    await eventually(started.is_set, what="the long body's parse running in the pool")
    small = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(60))
    assert not long_task.done()
    release.set()
    long = await asyncio.wait_for(long_task, 30)

    assert isinstance(small, Routed) and isinstance(long, Routed)
    assert small.decision is not None and small.decision.prompt_tokens == 60
    assert long.decision is not None and long.decision.prompt_tokens == 50


async def test_a_parse_that_outlasts_its_budget_is_a_413_before_envoys_timeout(
    harness: HarnessFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer that must encode a huge prompt whole could take seconds: the client gets a
    413 that says so when the budget passes, not Envoy's bare 504 at its message timeout."""
    original = dispatcher_module.parse_request
    release = threading.Event()

    def stuck(path: str, body: bytes, tokenizer: PromptTokenizer, limits: RequestLimits, **options: bool) -> Any:
        assert release.wait(30), "never released"
        return original(path, body, tokenizer, limits, **options)

    monkeypatch.setattr(dispatcher_module, "parse_request", stuck)
    h = harness(make_cluster(), settings=DispatchSettings(parse_timeout_s=0.2))
    try:
        rejected = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(50, size=300_000))
    finally:
        release.set()
    assert isinstance(rejected, Rejected), rejected
    assert (rejected.status, rejected.code) == (413, "payload_too_large")
    assert "could not be read and counted within 0.2 s" in error_of(rejected)["message"]


async def test_a_node_with_another_dispatchers_deflection_takes_one_more_behind_it(harness: HarnessFactory) -> None:
    """Refused because another dispatcher promised d0 a deflection the view lacked, the
    dispatcher decides again with it in the view and promises d0 again: one node, two
    deflections in flight, the second scheduled behind the first."""
    cluster = make_cluster(prefill_queue=LOADED_QUEUE, foreign={"d0": (300,)})
    cluster.tracker.remove("d1")
    del cluster.nodes["d1"]
    h = harness(cluster, settings=DispatchSettings(dispatcher_id=OWNER))
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))

    assert isinstance(routed, Routed) and routed.decision is not None
    assert (routed.decision.route, routed.decision.decode_node) == (Route.DEFLECT, "d0")
    assert cluster.reservations == [("d0", OWNER), ("d0", OWNER)]
    assert h.sample("kairos_dispatcher_reservation_conflicts_total") == 1
    (d0,) = cluster.view().decode
    assert d0.prefill_backlog_tokens == (300, 1000)  # the other dispatcher's, then its own


# ---------------------------------------------------------------------------------------------
# Profile reload: the policies swap as one object
# ---------------------------------------------------------------------------------------------
@dataclass
class GatedCluster(FakeCluster):
    """try_reserve waits for ``gate``: a decision stays in flight until the test opens it."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: asyncio.Event = field(default_factory=asyncio.Event)
    entered: int = 0  # try_reserve calls that reached the gate

    async def try_reserve(self, node_id: str, owner: str, tokens: int) -> Reservation:
        self.entered += 1
        self.waiting.set()
        await self.gate.wait()
        return await super().try_reserve(node_id, owner, tokens)


async def test_a_decision_in_flight_finishes_on_the_policies_it_started_with(harness: HarnessFactory) -> None:
    base = make_cluster(prefill_queue=LOADED_QUEUE, refuse=("d0", "d1"))
    cluster = GatedCluster(tracker=base.tracker, nodes=base.nodes, refuse=base.refuse)
    h = harness(cluster)
    in_flight = asyncio.create_task(h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000)))
    await asyncio.wait_for(cluster.waiting.wait(), 5)  # deflecting to d0, waiting for its reservation
    swapped = Policies(ExplodingPolicy(), ExplodingPolicy())
    h.dispatcher.policies = swapped  # a reload: one assignment
    assert h.dispatcher.policy is swapped.policy and h.dispatcher.keep_policy is swapped.keep_policy
    cluster.gate.set()
    routed = await asyncio.wait_for(in_flight, 5)

    # Both reservations lost, then the old P/D policy kept it: no exploding policy was asked.
    assert isinstance(routed, Routed) and routed.decision is not None
    assert (routed.decision.route, routed.decision.reason) == (Route.KEEP, Reason.KEEP_POLICY)
    assert cluster.reservations == [("d0", OWNER), ("d1", OWNER)]
    # The next request reads the new policies.
    after = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))
    assert isinstance(after, Rejected) and after.status == 500


async def test_a_deflection_whose_promise_is_in_flight_is_in_the_view_of_concurrent_requests(
    harness: HarnessFactory,
) -> None:
    """While one request's promise on d0 is in flight, the next request of the same dispatcher
    sees that deflection on d0 (d0 is slower behind it: d1); the third sees both, and schedules
    behind one of them. None is refused: a dispatcher's own promises never conflict."""
    base = make_cluster(prefill_queue=LOADED_QUEUE)
    cluster = GatedCluster(tracker=base.tracker, nodes=base.nodes)
    h = harness(cluster, settings=DispatchSettings(dispatcher_id=OWNER))
    first = asyncio.create_task(h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000)))
    await asyncio.wait_for(cluster.waiting.wait(), 5)
    second = asyncio.create_task(h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000)))
    third = asyncio.create_task(h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000)))
    while cluster.entered < 3:  # each task reaches the gate within a few loop turns
        await asyncio.sleep(0)
    cluster.gate.set()
    routed = [await asyncio.wait_for(t, 5) for t in (first, second, third)]
    nodes = [r.decision.decode_node for r in routed if isinstance(r, Routed) and r.decision is not None]
    assert [r.decision.route for r in routed if isinstance(r, Routed) and r.decision is not None] == [Route.DEFLECT] * 3
    assert nodes[:2] == ["d0", "d1"] and nodes[2] in ("d0", "d1")
    assert h.sample("kairos_dispatcher_reservation_conflicts_total") == 0


async def test_the_next_decision_uses_the_swapped_in_models(harness: HarnessFactory, models: LatencyModels) -> None:
    h = harness(make_cluster(prefill_queue=LOADED_QUEUE))
    first = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))
    assert isinstance(first, Routed) and first.decision is not None and first.decision.route is Route.DEFLECT
    # A profile whose decode steps cost 10 s each: no chunk schedule can meet the TBT SLO.
    slow = dataclasses.replace(models, decode=dataclasses.replace(models.decode, intercept=10.0))
    h.dispatcher.policies = Policies(create_policy("kairos", slow), create_policy("pd", slow))
    second = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))
    assert isinstance(second, Routed) and second.decision is not None
    assert second.decision.route is Route.KEEP


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
async def test_one_reservation_attempt_keeps_after_the_first_conflict(harness: HarnessFactory) -> None:
    settings = DispatchSettings(reservation_attempts=1, dispatcher_id=OWNER)
    h = harness(make_cluster(prefill_queue=LOADED_QUEUE, refuse=("d0",)), settings=settings)
    routed = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))

    assert isinstance(routed, Routed) and routed.decision is not None
    assert (routed.decision.route, routed.decision.reason) == (Route.KEEP, Reason.KEEP_POLICY)
    assert h.cluster.reservations == [("d0", OWNER)]
    assert h.sample("kairos_dispatcher_reservation_conflicts_total") == 1


async def test_an_empty_dispatcher_id_gets_a_unique_owner(harness: HarnessFactory) -> None:
    a = harness(make_cluster(prefill_queue=LOADED_QUEUE), settings=DispatchSettings())
    b = harness(make_cluster(prefill_queue=LOADED_QUEUE), settings=DispatchSettings())
    assert a.dispatcher.owner.startswith("dispatcher-") and a.dispatcher.owner != b.dispatcher.owner
    await a.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000))
    assert a.cluster.reservations == [("d0", a.dispatcher.owner)]


async def test_custom_limits_apply(harness: HarnessFactory) -> None:
    limits = RequestLimits(max_body_bytes=1024, max_model_len=2048, default_max_tokens=16)
    h = harness(make_cluster(), settings=DispatchSettings(limits=limits, dispatcher_id=OWNER))
    too_big = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(10, size=1025))
    too_long = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(300, max_tokens=2000))

    assert isinstance(too_big, Rejected) and too_big.status == 413
    assert isinstance(too_long, Rejected) and too_long.status == 400
    assert "2048" in error_of(too_long)["message"]


def _head(count: int, size: int | None = None) -> dict[str, str]:
    """A head of ``count`` headers, ``size`` bytes of names and values in all when given (Envoy's
    limits: 100 headers, 60 KiB; the dispatcher keeps 10 and 8 KiB for its own)."""
    head = {f"x-h{i:03d}": "v" for i in range(count)}
    if size is not None:
        head["x-h000"] = "v" * (size - sum(len(k) + len(v) for k, v in head.items()) + 1)
    return head


async def test_a_bodiless_inference_request_needs_room_for_the_routing_headers_too(
    harness: HarnessFactory,
) -> None:
    """A request without a body never reaches check_headers: route() checks its head itself, if
    it is routed with headers of the dispatcher's (a relayed GET gets none, so Envoy's limit is
    its only one)."""
    h = harness(make_cluster(), settings=DispatchSettings(dispatcher_id=OWNER))
    refused = await h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, _head(91)), None)
    relayed = await h.dispatcher.route(RequestHead.of("GET", "/v1/models", _head(99)), None)

    assert isinstance(refused, Rejected) and (refused.status, refused.code) == (431, "request_headers_too_large")
    assert "at most 90 headers and 53248 bytes" in error_of(refused)["message"]
    assert isinstance(relayed, Routed) and relayed.set_headers == ()


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code"),
    [
        pytest.param("CONNECT", "", {}, 404, "not_found", id="CONNECT has no path"),
        pytest.param("POST", "/v1/embeddings", {}, 404, "not_found", id="unserved path"),
        pytest.param("PUT", CHAT, {}, 405, "method_not_allowed", id="unserved method"),
        pytest.param("POST", COMPLETIONS, {"content-encoding": "gzip"}, 415, "unsupported_content_encoding", id="gzip"),
        pytest.param("POST", f"{COMPLETIONS}?x=1", {"content-length": "1025"}, 413, "payload_too_large", id="too long"),
        pytest.param("POST", COMPLETIONS, {"content-length": "1024"}, None, None, id="at the limit: wait for it"),
        pytest.param("POST", "/tokenize", {"content-length": "4096"}, None, None, id="relayed body: no limit here"),
        pytest.param("POST", "/tokenize", _head(99), None, None, id="relayed: no routing headers to fit"),
        pytest.param("POST", CHAT, {"content-length": "x"}, None, None, id="malformed length: Envoy's to refuse"),
        pytest.param("POST", CHAT, _head(90), None, None, id="90 headers: room for the routing ones"),
        pytest.param("POST", CHAT, _head(91), 431, "request_headers_too_large", id="91 headers: no room"),
        pytest.param("POST", CHAT, _head(1, 53_248), None, None, id="52 KiB: room"),
        pytest.param("POST", CHAT, _head(1, 53_249), 431, "request_headers_too_large", id="one byte more"),
    ],
)
def test_the_headers_alone_refuse_what_no_body_can_mend(
    harness: HarnessFactory, method: str, path: str, headers: dict[str, str], status: int | None, code: str | None
) -> None:
    limits = RequestLimits(max_body_bytes=1024)
    h = harness(make_cluster(), settings=DispatchSettings(limits=limits, dispatcher_id=OWNER))
    refused = h.dispatcher.check_headers(RequestHead.of(method, path, headers))

    if status is None:
        assert refused is None
        return
    assert isinstance(refused, Rejected) and (refused.status, refused.code) == (status, code)
    if method == "CONNECT":
        assert error_of(refused)["message"].startswith("CONNECT without a path is not served"), refused.body
    assert h.sample("kairos_dispatcher_rejections_total", code=code) == 1
    assert h.cluster.recorded == []


async def test_under_the_papers_limit_concurrent_requests_never_deflect_twice_onto_one_node(
    harness: HarnessFactory, models: LatencyModels
) -> None:
    """kairos:pending=1: three requests decide while the first two promises are in flight; the
    in-flight deflections are in the view, so no node takes two and the third keeps."""
    base = make_cluster(prefill_queue=LOADED_QUEUE)
    cluster = GatedCluster(tracker=base.tracker, nodes=base.nodes)
    h = harness(
        cluster, policy=create_policy("kairos:pending=1", models), settings=DispatchSettings(dispatcher_id=OWNER)
    )
    tasks = [
        asyncio.create_task(h.dispatcher.route(RequestHead.of("POST", COMPLETIONS, {}), completion_body(1000)))
        for _ in range(3)
    ]
    while cluster.entered < 2:  # two promises in flight, the third request decided without one
        await asyncio.sleep(0)
    cluster.gate.set()
    routed = [await asyncio.wait_for(t, 5) for t in tasks]
    decisions = [r.decision for r in routed if isinstance(r, Routed) and r.decision is not None]
    deflected = [d.decode_node for d in decisions if d.route is Route.DEFLECT]
    assert sorted(deflected) == ["d0", "d1"]
    assert [d.route for d in decisions].count(Route.KEEP) == 1
