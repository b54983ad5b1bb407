"""Routing policies: spec parsing, the static SQ/SL rules, P/D and Kairos/Oracle.

Flat models (builders): prefill step 0.010 + 1e-4 n; a decode-node step of p prefill tokens
beside B decodes costs 0.040 + 0.001 B + 1e-4 p. Prefill nodes have chi_p = 1000, so Eq. 1 for
queue Q and prompt l <= 1000 is Q/1000 x 0.110 + 0.010 + 1e-4 l.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kairos.common.errors import ConfigError, InvalidRequestError, NoHealthyNodeError, UnknownPolicyError
from kairos.core.algorithm import DeciderConfig, decide
from kairos.core.decision import Reason, Route
from kairos.core.policies import KairosPolicy, PDPolicy, StaticPolicy, make_policy, parse_policy_spec
from kairos.core.state import DecodeNodeState, PrefillNodeState
from tests.builders import decode_node, flat_models, make_models, prefill_node, view

FLAT = flat_models()

# ---------------------------------------------------------------------------------------------
# Spec parsing
# ---------------------------------------------------------------------------------------------
PARSED = [
    pytest.param("pd", PDPolicy, {"label": "pd", "fresh_state": False}, id="pd"),
    pytest.param(
        "sq:theta=4",
        StaticPolicy,
        {"kind": "sq", "threshold": 4, "chunk_tokens": 128, "label": "sq(theta=4)", "fresh_state": False},
        id="sq-theta-4",
    ),
    pytest.param("sq", StaticPolicy, {"kind": "sq", "threshold": 4}, id="sq-defaults-to-theta-4"),
    pytest.param(
        "sl:l=2048",
        StaticPolicy,
        {"kind": "sl", "threshold": 2048, "chunk_tokens": 128, "label": "sl(l=2048)"},
        id="sl-l-2048",
    ),
    pytest.param("sl", StaticPolicy, {"kind": "sl", "threshold": 2048}, id="sl-defaults-to-l-2048"),
    pytest.param("sl:l=1024,chunk=256", StaticPolicy, {"threshold": 1024, "chunk_tokens": 256}, id="sl-with-chunk"),
    pytest.param(
        "kairos:alpha=1.3,beta=0.9",
        KairosPolicy,
        {
            "config.alpha": 1.3,
            "config.beta": 0.9,
            "config.max_pending_deflections": 1,
            "fresh_state": False,
            "label": "kairos(alpha=1.3,beta=0.9)",
        },
        id="kairos-alpha-beta",
    ),
    pytest.param(
        "kairos:pending=none",
        KairosPolicy,
        {"config.max_pending_deflections": None, "config.alpha": 1.3},
        id="kairos-pending-none",
    ),
    pytest.param("kairos:pending=2", KairosPolicy, {"config.max_pending_deflections": 2}, id="kairos-pending-2"),
    pytest.param(
        "oracle",
        KairosPolicy,
        {"fresh_state": True, "config.max_pending_deflections": None, "config.alpha": 1.3, "config.beta": 1.0},
        id="oracle-sees-true-state-no-pending-limit",
    ),
    pytest.param("  KAIROS : Alpha = 1.5 ", KairosPolicy, {"config.alpha": 1.5}, id="case-and-spaces-tolerated"),
]


def _attr(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("spec", "cls", "attrs"), PARSED)
def test_make_policy_parses(spec: str, cls: type, attrs: dict[str, object]) -> None:
    policy = make_policy(spec, FLAT)
    assert isinstance(policy, cls)
    assert {k: _attr(policy, k) for k in attrs} == attrs


def test_parse_policy_spec_splits_name_and_params() -> None:
    assert parse_policy_spec("kairos:alpha=1.3,beta=0.9") == ("kairos", {"alpha": "1.3", "beta": "0.9"})
    assert parse_policy_spec("pd") == ("pd", {})


def test_make_policy_keeps_the_base_config() -> None:
    base = DeciderConfig(tbt_slo_s=0.05, ttft_slo_s=2.0, chunk_candidates=(256, 128))
    policy = make_policy("kairos:alpha=2", FLAT, base=base)
    assert isinstance(policy, KairosPolicy)
    cfg = policy.config
    assert (cfg.alpha, cfg.beta, cfg.tbt_slo_s, cfg.ttft_slo_s, cfg.chunk_candidates) == (
        2.0,
        1.0,
        0.05,
        2.0,
        (256, 128),
    )


UNKNOWN = [
    pytest.param(
        "fifo", ["unknown policy 'fifo'", "known policies", "'pd'", "'kairos'", "'oracle'"], id="unknown-name"
    ),
    pytest.param("", ["unknown policy ''"], id="empty-spec"),
    pytest.param("pd:theta=1", ["bad parameter 'theta=1'", "accepted: none"], id="pd-takes-no-params"),
    pytest.param("sq:l=100", ["bad parameter 'l=100'", "'theta'", "'chunk'"], id="sq-takes-theta-not-l"),
    pytest.param("sl:theta=1", ["bad parameter 'theta=1'", "'l'", "'chunk'"], id="sl-takes-l-not-theta"),
    pytest.param("kairos:gamma=2", ["'gamma=2'", "'alpha'", "'beta'", "'pending'"], id="kairos-unknown-param"),
    pytest.param("oracle:pending=none", ["'pending=none'", "'alpha'", "'beta'"], id="oracle-has-no-pending"),
    pytest.param("kairos:alpha", ["bad parameter 'alpha'"], id="param-without-value"),
    pytest.param("sq:theta=four", ["theta='four' is not a int"], id="theta-not-a-number"),
    pytest.param("sq:theta=1.5", ["theta='1.5' is not a int"], id="theta-not-an-integer"),
    pytest.param("kairos:alpha=high", ["alpha='high' is not a float"], id="alpha-not-a-number"),
    pytest.param("kairos:pending=many", ["pending='many' is not a int"], id="pending-not-a-number"),
    pytest.param("sq:theta=-1", ["threshold=-1 must be >= 0"], id="negative-theta"),
    pytest.param("sl:chunk=1", ["chunk=1 >= 2"], id="chunk-below-2"),
]


@pytest.mark.parametrize(("spec", "fragments"), UNKNOWN)
def test_make_policy_rejects_unknown_names_params_and_values(spec: str, fragments: list[str]) -> None:
    with pytest.raises(UnknownPolicyError) as info:
        make_policy(spec, FLAT)
    for fragment in fragments:
        assert fragment in info.value.message
    assert info.value.code == "unknown_policy"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        pytest.param("kairos:alpha=0.9", "alpha must be a finite number >= 1", id="alpha-below-1"),
        # NaN compares false with everything: it must not slip through "alpha < 1" and disable Eq. 7
        pytest.param("kairos:alpha=nan", "alpha", id="alpha-nan"),
        pytest.param("kairos:beta=0", "beta must be in (0, 2]", id="beta-0"),
        pytest.param("oracle:beta=3", "beta must be in (0, 2]", id="beta-over-2"),
        pytest.param("kairos:pending=0", "max_pending_deflections", id="pending-0"),
    ],
)
def test_make_policy_rejects_out_of_range_values(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_policy(spec, FLAT)
    assert fragment in info.value.message


# ---------------------------------------------------------------------------------------------
# Static rules (default config: tau = 0.070, which they ignore)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StaticCase:
    spec: str
    prompt: int
    prefill: tuple[PrefillNodeState, ...]
    decode: tuple[DecodeNodeState, ...]
    route: Route
    reason: Reason
    decode_node: str
    chunks: tuple[int, ...] = ()
    step_times: tuple[float, ...] = ()
    ttft_dec: float | None = None


TWO_BUSY = (prefill_node("p1", (100, 100)), prefill_node("p2", (100, 100)))
B28 = (decode_node("d1", b=28),)
# B=28, chi=128: 100 tokens per step at 0.068 + 0.010 = 0.078 (> tau 0.070); the last 50 at 0.073
SQ_DEFLECT = {"chunks": (100, 100, 50), "step_times": (0.078, 0.078, 0.073), "ttft_dec": 0.229}
STATIC_CASES = [
    pytest.param(
        StaticCase(
            spec="sq:theta=1",
            prompt=250,
            prefill=TWO_BUSY,
            decode=B28,
            route=Route.DEFLECT,
            reason=Reason.DEFLECT_STATIC_RULE,
            decode_node="d1",
            **SQ_DEFLECT,
        ),
        id="sq1: both queues hold 2 > 1: deflects 100 (chi-B) per step, TBT ignored",
    ),
    pytest.param(
        StaticCase(
            spec="sq:theta=1",
            prompt=250,
            prefill=(prefill_node("p1", (100, 100)), prefill_node("p2", (100,))),
            decode=B28,
            route=Route.KEEP,
            reason=Reason.KEEP_STATIC_RULE,
            decode_node="d1",
        ),
        id="sq1: one queue holds exactly 1: keeps",
    ),
    pytest.param(
        StaticCase(
            spec="sq:theta=1",
            prompt=250,
            prefill=(prefill_node("p1", (100, 100)), prefill_node("p2", reported_at=-1.0)),
            decode=B28,
            route=Route.DEFLECT,
            reason=Reason.DEFLECT_STATIC_RULE,
            decode_node="d1",
            **SQ_DEFLECT,
        ),
        id="sq1: the stale idle prefill node is not counted: deflects",
    ),
    pytest.param(
        StaticCase(
            spec="sq:theta=1",
            prompt=250,
            prefill=(prefill_node("p1", (100, 100), reported_at=-1.0),),
            decode=B28,
            route=Route.KEEP,
            reason=Reason.KEEP_STATIC_RULE,
            decode_node="d1",
        ),
        id="sq1: no fresh prefill node: never fires",
    ),
    pytest.param(
        StaticCase(
            spec="sq:theta=0",
            prompt=250,
            prefill=(prefill_node("p1"),),
            decode=B28,
            route=Route.KEEP,
            reason=Reason.KEEP_STATIC_RULE,
            decode_node="d1",
        ),
        id="sq0: an empty queue does not exceed 0: keeps",
    ),
    pytest.param(
        StaticCase(
            spec="sq:theta=0",
            prompt=250,
            prefill=(prefill_node("p1", (5,)),),
            decode=B28,
            route=Route.DEFLECT,
            reason=Reason.DEFLECT_STATIC_RULE,
            decode_node="d1",
            **SQ_DEFLECT,
        ),
        id="sq0: one queued request exceeds 0: deflects",
    ),
    # B=8 is the least loaded (T0 0.048 vs 0.068): 120 per step at 0.060, the last 59 at 0.0539
    pytest.param(
        StaticCase(
            spec="sl:l=300",
            prompt=299,
            prefill=(prefill_node(),),
            decode=(decode_node("d1", b=28), decode_node("d2", b=8)),
            route=Route.DEFLECT,
            reason=Reason.DEFLECT_STATIC_RULE,
            decode_node="d2",
            chunks=(120, 120, 59),
            step_times=(0.060, 0.060, 0.0539),
            ttft_dec=0.1739,
        ),
        id="sl300: 299 tokens deflect to the least loaded node, 120 per step",
    ),
    pytest.param(
        StaticCase(
            spec="sl:l=300",
            prompt=300,
            prefill=(prefill_node(),),
            decode=B28,
            route=Route.KEEP,
            reason=Reason.KEEP_STATIC_RULE,
            decode_node="d1",
        ),
        id="sl300: 300 tokens is not below l: keeps",
    ),
    pytest.param(
        StaticCase(
            spec="sl:l=300",
            prompt=2000,
            prefill=TWO_BUSY,
            decode=B28,
            route=Route.KEEP,
            reason=Reason.KEEP_STATIC_RULE,
            decode_node="d1",
        ),
        id="sl300: long prompt keeps whatever the queues",
    ),
    # chi = 256: 228 per step at 0.068 + 0.0228, the last 71 at 0.068 + 0.0071
    pytest.param(
        StaticCase(
            spec="sl:l=300,chunk=256",
            prompt=299,
            prefill=(prefill_node(),),
            decode=B28,
            route=Route.DEFLECT,
            reason=Reason.DEFLECT_STATIC_RULE,
            decode_node="d1",
            chunks=(228, 71),
            step_times=(0.0908, 0.0751),
            ttft_dec=0.1659,
        ),
        id="sl300 chunk 256: 228 (chi-B) per step",
    ),
    pytest.param(
        StaticCase(
            spec="sl:l=300",
            prompt=299,
            prefill=(prefill_node(),),
            decode=(decode_node("d1", b=128),),
            route=Route.KEEP,
            reason=Reason.KEEP_NO_ELIGIBLE_DECODE,
            decode_node="d1",
        ),
        id="sl300: B=128 leaves no room in a 128 step: no eligible node",
    ),
    pytest.param(
        StaticCase(
            spec="sl:l=300",
            prompt=299,
            prefill=(prefill_node(),),
            decode=(decode_node("d1", b=28, reported_at=-1.0),),
            route=Route.KEEP,
            reason=Reason.KEEP_NO_ELIGIBLE_DECODE,
            decode_node="d1",
        ),
        id="sl300: stale decode node: no eligible node",
    ),
    pytest.param(
        StaticCase(
            spec="sl:l=300",
            prompt=299,
            prefill=(prefill_node(),),
            decode=(decode_node("d1", b=28, k=900, capacity=1000),),
            route=Route.KEEP,
            reason=Reason.KEEP_NO_ELIGIBLE_DECODE,
            decode_node="d1",
        ),
        id="sl300: 100 free KV tokens for 299: no eligible node",
    ),
]


@pytest.mark.parametrize("case", STATIC_CASES)
def test_static_policy(case: StaticCase) -> None:
    d = make_policy(case.spec, FLAT).decide(case.prompt, view(case.prefill, case.decode), 0.0)
    assert (d.route, d.reason, d.decode_node) == (case.route, case.reason, case.decode_node)
    assert d.chunk_sizes == case.chunks
    assert d.predicted_step_s == pytest.approx(case.step_times)
    assert d.predicted_ttft_decode_s == pytest.approx(case.ttft_dec)
    if d.route is Route.DEFLECT:
        assert d.prefill_node is None
        assert d.step_budget_s is None  # static rules send no TBT guard
    else:
        assert d.prefill_node is not None


def test_static_policy_costs_later_chunks_with_the_cached_prefill() -> None:
    # B=28, 1e-7 p c: (100, c=0) 0.078; (100, c=100) 0.078 + 0.001; (50, c=200) 0.073 + 0.001
    d = make_policy("sl:l=300", make_models()).decide(250, view((prefill_node(),), B28), 0.0)
    assert d.chunk_sizes == (100, 100, 50)
    assert d.predicted_step_s == pytest.approx((0.078, 0.079, 0.074))
    assert d.predicted_ttft_decode_s == pytest.approx(0.231)
    assert [(s.step_tokens, s.cached_tokens) for s in d.schedule] == [(128, 0), (128, 100), (78, 200)]


def test_static_deflection_reports_the_prefill_estimate() -> None:
    # both nodes Q=200: 0.2 x 0.110 + 0.010 + 0.025 = 0.057
    d = make_policy("sq:theta=1", FLAT).decide(250, view(TWO_BUSY, B28), 0.0)
    assert d.predicted_ttft_prefill_s == pytest.approx(0.057)


# ---------------------------------------------------------------------------------------------
# P/D baseline and Kairos / Oracle
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("decode", "expected"),
    [
        pytest.param((decode_node("d1", b=0),), "d1", id="one-idle-node"),
        pytest.param((decode_node("d1", b=30), decode_node("d2", b=10)), "d2", id="least-loaded-decode-node"),
    ],
)
def test_pd_never_deflects(decode: tuple[DecodeNodeState, ...], expected: str) -> None:
    # Q=100000: 100 x 0.110 + 0.110 = 11.11 s on the prefill path, still kept
    d = make_policy("pd", FLAT).decide(1000, view((prefill_node(queue=(100_000,)),), decode), 0.0)
    assert (d.route, d.reason, d.prefill_node, d.decode_node) == (Route.KEEP, Reason.KEEP_POLICY, "p1", expected)
    assert d.predicted_ttft_prefill_s == pytest.approx(11.11)
    assert d.predicted_ttft_decode_s is None
    assert d.chunk_sizes == ()


@pytest.mark.parametrize("spec", ["pd", "sq:theta=0", "sl:l=100", "kairos", "oracle"])
def test_every_policy_rejects_an_empty_prompt(spec: str) -> None:
    with pytest.raises(InvalidRequestError):
        make_policy(spec, FLAT).decide(0, view((prefill_node(),), (decode_node(),)), 0.0)


def test_pd_without_decode_nodes_raises() -> None:
    with pytest.raises(NoHealthyNodeError):
        make_policy("pd", FLAT).decide(100, view((prefill_node(),), ()), 0.0)


# tau = 0.105, candidates (420, 220, 120); Q=1700: Eq. 1 = 0.297, bound 0.3861. d1 carries one
# deflected 300-token prefill: 0.090, then the request beside B=21: 0.1009 + 0.1009 + 0.0812.
KAIROS_BASE = DeciderConfig(tbt_slo_s=0.105, chunk_candidates=(420, 220, 120))
BACKLOGGED = view((prefill_node(queue=(1700,)),), (decode_node("d1", b=20, backlog=(300,)),))


@pytest.mark.parametrize(
    ("spec", "route", "reason", "chunks", "ttft_dec"),
    [
        pytest.param("kairos", Route.KEEP, Reason.KEEP_NO_ELIGIBLE_DECODE, (), None, id="kairos: pending 1 keeps"),
        pytest.param(
            "kairos:pending=none",
            Route.DEFLECT,
            Reason.DEFLECT_WITHIN_MARGIN,
            (399, 399, 202),
            0.373,
            id="kairos pending none: deflects behind the backlog",
        ),
        pytest.param(
            "oracle",
            Route.DEFLECT,
            Reason.DEFLECT_WITHIN_MARGIN,
            (399, 399, 202),
            0.373,
            id="oracle: no pending limit, deflects",
        ),
        pytest.param(
            "kairos:alpha=1.2,pending=none",
            Route.KEEP,
            Reason.KEEP_DECODE_SLOWER,
            (),
            None,
            id="kairos alpha 1.2: 0.373 > 1.2 x 0.297 = 0.3564 keeps",
        ),
    ],
)
def test_kairos_and_oracle(
    spec: str, route: Route, reason: Reason, chunks: tuple[int, ...], ttft_dec: float | None
) -> None:
    policy = make_policy(spec, FLAT, base=KAIROS_BASE)
    d = policy.decide(1000, BACKLOGGED, 0.0)
    assert (d.route, d.reason, d.chunk_sizes) == (route, reason, chunks)
    assert d.predicted_ttft_prefill_s == pytest.approx(0.297)
    assert d.predicted_ttft_decode_s == pytest.approx(ttft_dec)
    assert isinstance(policy, KairosPolicy)
    assert d == decide(1000, BACKLOGGED, 0.0, FLAT, policy.config)


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        pytest.param("kairos", "kairos(alpha=1.3,beta=1)", id="kairos-defaults"),
        pytest.param("kairos:pending=none", "kairos(alpha=1.3,beta=1,pending=none)", id="kairos-pending-none"),
        pytest.param("oracle:alpha=1.5", "oracle(alpha=1.5,beta=1)", id="oracle"),
        pytest.param("sl:l=512", "sl(l=512)", id="sl"),
    ],
)
def test_policy_labels(spec: str, label: str) -> None:
    assert make_policy(spec, FLAT).label == label
