"""Routing policies: spec parsing, the static SQ/SL rules, P/D and Kairos/Oracle, and the field's
deciders (llm-d, Dynamo, AIBrix).

Flat models (builders): prefill step 0.010 + 1e-4 n; a decode-node step of p prefill tokens
beside B decodes costs 0.040 + 0.001 B + 1e-4 p. Prefill nodes have chi_p = 1000, so Eq. 1 for
queue Q and prompt l <= 1000 is Q/1000 x 0.110 + 0.010 + 1e-4 l.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest

from kairos.common.errors import ConfigError, InvalidRequestError, NoHealthyNodeError, UnknownPolicyError
from kairos.core.algorithm import DeciderConfig, decide
from kairos.core.decision import Reason, Route
from kairos.core.policies import (
    AibrixPolicy,
    DynamoPolicy,
    KairosPolicy,
    LlmdPolicy,
    PDPolicy,
    StaticPolicy,
    create_policy,
    parse_policy_spec,
)
from kairos.core.policies.kairos import gateway_settings
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
            "config.max_pending_deflections": None,
            "fresh_state": False,
            "label": "kairos(alpha=1.3,beta=0.9)",
        },
        id="kairos-alpha-beta",
    ),
    pytest.param(
        "kairos:pending=none",
        KairosPolicy,
        {"config.max_pending_deflections": None, "config.alpha": 1.0},
        id="kairos-pending-none",
    ),
    pytest.param("kairos:pending=2", KairosPolicy, {"config.max_pending_deflections": 2}, id="kairos-pending-2"),
    pytest.param(
        "kairos",
        KairosPolicy,
        {"config.decode_overload_guard": True, "label": "kairos(alpha=1,beta=1)"},
        id="kairos-overload-guard-on-by-default",
    ),
    pytest.param(
        "kairos:overload=off",
        KairosPolicy,
        {"config.decode_overload_guard": False, "label": "kairos(alpha=1,beta=1,overload=off)"},
        id="kairos-overload-off",
    ),
    pytest.param(
        "kairos",
        KairosPolicy,
        {"config.decode_pressure_share": 0.85},
        id="kairos-decode-pressure-on-by-default",
    ),
    pytest.param(
        "kairos:pressure=off",
        KairosPolicy,
        {"config.decode_pressure_share": None, "label": "kairos(alpha=1,beta=1,pressure=off)"},
        id="kairos-pressure-off",
    ),
    pytest.param(
        "kairos:pressure=0.9",
        KairosPolicy,
        {"config.decode_pressure_share": 0.9, "label": "kairos(alpha=1,beta=1,pressure=0.9)"},
        id="kairos-pressure-share",
    ),
    pytest.param("kairos", KairosPolicy, {"config.deflect_gate_share": 0.25}, id="kairos-gate-on-by-default"),
    pytest.param(
        "kairos:gate=off",
        KairosPolicy,
        {"config.deflect_gate_share": None, "label": "kairos(alpha=1,beta=1,gate=off)"},
        id="kairos-gate-off",
    ),
    pytest.param(
        "kairos:alpha=1.3,gate=off",
        KairosPolicy,
        {"config.alpha": 1.3, "config.deflect_gate_share": None, "label": "kairos(alpha=1.3,beta=1,gate=off)"},
        id="kairos-the-papers-eq7",
    ),
    pytest.param(
        "oracle:gate=1",
        KairosPolicy,
        {"fresh_state": True, "config.deflect_gate_share": 1.0, "label": "oracle(alpha=1,beta=1,gate=1)"},
        id="oracle-gate-share",
    ),
    pytest.param(
        "kairos:error=0.1",
        KairosPolicy,
        {"config.model_error": 0.1, "label": "kairos(alpha=1,beta=1,error=0.1)"},
        id="kairos-model-error",
    ),
    pytest.param(
        "oracle",
        KairosPolicy,
        {"fresh_state": True, "config.max_pending_deflections": None, "config.alpha": 1.0, "config.beta": 1.0},
        id="oracle-sees-true-state-no-pending-limit",
    ),
    pytest.param("  KAIROS : Alpha = 1.5 ", KairosPolicy, {"config.alpha": 1.5}, id="case-and-spaces-tolerated"),
    pytest.param(
        "llmd",
        LlmdPolicy,
        {"threshold": 16, "chunk_tokens": 4096, "label": "llmd(threshold=16)", "fresh_state": False},
        id="llmd-defaults: nonCachedTokens 16, the decode nodes' 4096-token step budget",
    ),
    pytest.param(
        "llmd:threshold=0,chunk=512",
        LlmdPolicy,
        {"threshold": 0, "chunk_tokens": 512, "label": "llmd(threshold=0,chunk=512)"},
        id="llmd-threshold-0-and-chunk",
    ),
    pytest.param(
        "dynamo",
        DynamoPolicy,
        {
            "mode": "isl",
            "isl_tokens": 2048,
            "isl_ratio": 0.7,
            "prefill_busy": 4.0,
            "kv_busy": 0.5,
            "chunk_tokens": 4096,
            "label": "dynamo(mode=isl,isl=2048,ratio=0.7,busy=4,kv=0.5)",
            "fresh_state": False,
        },
        id="dynamo-defaults: isl_bounding 2048 / 0.7, busy 4, KV guard 0.5",
    ),
    pytest.param(
        "dynamo:mode=Either,isl=1024,ratio=0.5,busy=1.5,kv=off",
        DynamoPolicy,
        {
            "mode": "either",
            "isl_tokens": 1024,
            "isl_ratio": 0.5,
            "prefill_busy": 1.5,
            "kv_busy": None,
            "label": "dynamo(mode=either,isl=1024,ratio=0.5,busy=1.5,kv=off)",
        },
        id="dynamo-every-parameter",
    ),
    pytest.param(
        "aibrix",
        AibrixPolicy,
        {"high_s": 1.0, "low_s": 0.25, "chunk_tokens": 4096, "label": "aibrix(high=1,low=0.25)"},
        id="aibrix-defaults: high 1 s, low 0.25 s",
    ),
    pytest.param(
        "aibrix:high=2,low=0.5,chunk=128",
        AibrixPolicy,
        {"high_s": 2.0, "low_s": 0.5, "chunk_tokens": 128, "label": "aibrix(high=2,low=0.5,chunk=128)"},
        id="aibrix-every-parameter",
    ),
]


def _attr(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("spec", "cls", "attrs"), PARSED)
def test_create_policy_parses(spec: str, cls: type, attrs: dict[str, object]) -> None:
    policy = create_policy(spec, FLAT)
    assert isinstance(policy, cls)
    assert {k: _attr(policy, k) for k in attrs} == attrs


def test_parse_policy_spec_splits_name_and_params() -> None:
    assert parse_policy_spec("kairos:alpha=1.3,beta=0.9") == ("kairos", {"alpha": "1.3", "beta": "0.9"})
    assert parse_policy_spec("pd") == ("pd", {})


def test_create_policy_keeps_the_base_config() -> None:
    base = DeciderConfig(tbt_slo_s=0.05, ttft_slo_s=2.0, chunk_candidates=(256, 128))
    policy = create_policy("kairos:alpha=2", FLAT, base=base)
    assert isinstance(policy, KairosPolicy)
    cfg = policy.config
    assert (cfg.alpha, cfg.beta, cfg.tbt_slo_s, cfg.ttft_slo_s, cfg.chunk_candidates) == (
        2.0,
        1.0,
        0.05,
        2.0,
        (256, 128),
    )


def test_a_specs_chunks_override_the_base_config() -> None:
    base = DeciderConfig(tbt_slo_s=0.05, chunk_candidates=(256, 128))
    policy = create_policy("kairos:chunks=1000/300/100", FLAT, base=base)
    assert isinstance(policy, KairosPolicy)
    assert (policy.config.chunk_candidates, policy.config.tbt_slo_s) == ((1000, 300, 100), 0.05)


UNKNOWN = [
    pytest.param(
        "fifo", ["unknown policy 'fifo'", "known policies", "'pd'", "'kairos'", "'oracle'"], id="unknown-name"
    ),
    pytest.param("", ["unknown policy ''"], id="empty-spec"),
    pytest.param("pd:theta=1", ["bad parameter 'theta=1'", "accepted: ['prefix']"], id="pd-takes-only-prefix"),
    pytest.param("pd:prefix=maybe", ["prefix='maybe' must be 'on' or 'off'"], id="pd-prefix-on-or-off"),
    pytest.param("sq:l=100", ["bad parameter 'l=100'", "'theta'", "'chunk'"], id="sq-takes-theta-not-l"),
    pytest.param("sl:theta=1", ["bad parameter 'theta=1'", "'l'", "'chunk'"], id="sl-takes-l-not-theta"),
    pytest.param("kairos:gamma=2", ["'gamma=2'", "'alpha'", "'beta'", "'pending'"], id="kairos-unknown-param"),
    pytest.param("oracle:pending=none", ["'pending=none'", "'alpha'", "'beta'"], id="oracle-has-no-pending"),
    pytest.param("kairos:alpha", ["bad parameter 'alpha'"], id="param-without-value"),
    pytest.param("sq:theta=four", ["theta='four' is not a int"], id="theta-not-a-number"),
    pytest.param("sq:theta=1.5", ["theta='1.5' is not a int"], id="theta-not-an-integer"),
    pytest.param("kairos:alpha=high", ["alpha='high' is not a float"], id="alpha-not-a-number"),
    pytest.param("kairos:pending=many", ["pending='many' is not a int"], id="pending-not-a-number"),
    pytest.param("kairos:error=tenth", ["error='tenth' is not a float"], id="error-not-a-number"),
    pytest.param("kairos:overload=no", ["overload='no' must be 'on' or 'off'"], id="overload-neither-on-nor-off"),
    pytest.param("kairos:gate=1.5", ["gate='1.5' must be in (0, 1] or 'off'"], id="gate-above-1"),
    pytest.param("kairos:gate=nan", ["gate='nan' must be in (0, 1] or 'off'"], id="gate-nan"),
    pytest.param("kairos:gate=0", ["gate='0' must be in (0, 1] or 'off'"], id="gate-zero"),
    pytest.param("kairos:gate=wide", ["gate='wide' is not a float"], id="gate-not-a-number"),
    pytest.param("kairos:pressure=1.5", ["pressure='1.5' must be in (0, 1] or 'off'"], id="pressure-above-1"),
    pytest.param("kairos:pressure=nan", ["pressure='nan' must be in (0, 1] or 'off'"], id="pressure-nan"),
    pytest.param("kairos:pressure=high", ["pressure='high' is not a float"], id="pressure-not-a-number"),
    pytest.param("sq:theta=-1", ["threshold=-1 must be >= 0"], id="negative-theta"),
    pytest.param("sl:chunk=1", ["chunk=1 >= 2"], id="chunk-below-2"),
    pytest.param("llmd:l=100", ["bad parameter 'l=100'", "'threshold'", "'chunk'"], id="llmd-takes-threshold"),
    pytest.param("llmd:threshold=-1", ["threshold=-1 must be >= 0"], id="llmd-negative-threshold"),
    pytest.param("llmd:threshold=1e3", ["threshold='1e3' is not a int"], id="llmd-threshold-not-an-integer"),
    pytest.param("llmd:chunk=1", ["chunk=1 must be >= 2"], id="llmd-chunk-below-2"),
    pytest.param("dynamo:mode=fast", ["mode='fast' must be one of", "'isl'", "'load'", "'either'"], id="dynamo-mode"),
    pytest.param("dynamo:ratio=1.5", ["ratio=1.5 must be in [0, 1]"], id="dynamo-ratio-over-1"),
    pytest.param("dynamo:ratio=nan", ["ratio=nan must be in [0, 1]"], id="dynamo-ratio-nan"),
    pytest.param("dynamo:kv=2", ["kv=2.0 must be in [0, 1]"], id="dynamo-kv-over-1"),
    pytest.param("dynamo:kv=on", ["kv='on' is not a float"], id="dynamo-kv-neither-number-nor-off"),
    pytest.param("dynamo:busy=-1", ["busy=-1.0 must be in [0, inf]"], id="dynamo-negative-busy"),
    pytest.param("dynamo:isl=-5", ["isl=-5 must be >= 0"], id="dynamo-negative-isl"),
    pytest.param("dynamo:threshold=8", ["bad parameter 'threshold=8'", "'mode'", "'kv'"], id="dynamo-unknown-param"),
    pytest.param("aibrix:low=-0.1", ["low=-0.1 must be in [0, inf]"], id="aibrix-negative-low"),
    pytest.param("aibrix:high=x", ["high='x' is not a float"], id="aibrix-high-not-a-number"),
    pytest.param("aibrix:theta=1", ["bad parameter 'theta=1'", "'high'", "'low'"], id="aibrix-unknown-param"),
    pytest.param("kairos:chunks=512,256", ["bad parameter '256'"], id="chunks-comma-separated"),
    pytest.param("oracle:chunks=512/big", ["chunks='512/big' must be integers separated by '/'"], id="chunks-not-ints"),
    pytest.param("pd:chunks=512", ["bad parameter 'chunks=512'"], id="pd-has-no-chunks"),
]


@pytest.mark.parametrize(("spec", "fragments"), UNKNOWN)
def test_create_policy_rejects_unknown_names_params_and_values(spec: str, fragments: list[str]) -> None:
    with pytest.raises(UnknownPolicyError) as info:
        create_policy(spec, FLAT)
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
        pytest.param("kairos:chunks=256/512", "strictly decreasing, got [256, 512]", id="chunks-increasing"),
        pytest.param("oracle:chunks=256/0", "must be positive", id="chunks-0"),
    ],
)
def test_create_policy_rejects_out_of_range_values(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        create_policy(spec, FLAT)
    assert fragment in info.value.message


# ---------------------------------------------------------------------------------------------
# Static rules (default config: tau = 0.070, which they ignore)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RuleCase:
    """One decision of a rule-based policy (static rules and the field's deciders)."""

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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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
        RuleCase(
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


def check_rule_case(case: RuleCase) -> None:
    d = create_policy(case.spec, FLAT).decide(case.prompt, view(case.prefill, case.decode), 0.0)
    assert (d.route, d.reason, d.decode_node) == (case.route, case.reason, case.decode_node)
    assert d.chunk_sizes == case.chunks
    assert d.predicted_step_s == pytest.approx(case.step_times)
    assert d.predicted_ttft_decode_s == pytest.approx(case.ttft_dec)
    if d.route is Route.DEFLECT:
        assert d.prefill_node is None
        assert d.step_budget_s is None  # no rule-based policy sends a TBT guard
        assert d.planned_decode_tokens == next(n.decode_tokens for n in case.decode if n.node_id == case.decode_node)
    else:
        assert d.prefill_node is not None


@pytest.mark.parametrize("case", STATIC_CASES)
def test_static_policy(case: RuleCase) -> None:
    check_rule_case(case)


def test_static_policy_costs_later_chunks_with_the_cached_prefill() -> None:
    # B=28, 1e-7 p c: (100, c=0) 0.078; (100, c=100) 0.078 + 0.001; (50, c=200) 0.073 + 0.001
    d = create_policy("sl:l=300", make_models()).decide(250, view((prefill_node(),), B28), 0.0)
    assert d.chunk_sizes == (100, 100, 50)
    assert d.predicted_step_s == pytest.approx((0.078, 0.079, 0.074))
    assert d.predicted_ttft_decode_s == pytest.approx(0.231)
    assert [(s.step_tokens, s.cached_tokens) for s in d.schedule] == [(128, 0), (128, 100), (78, 200)]


def test_static_deflection_reports_the_prefill_estimate() -> None:
    # both nodes Q=200: the 200-token step running at the heartbeat (0.030, half done), then the
    # prompt's (0.035): 0.050
    d = create_policy("sq:theta=1", FLAT).decide(250, view(TWO_BUSY, B28), 0.0)
    assert d.predicted_ttft_prefill_s == pytest.approx(0.050)


# ---------------------------------------------------------------------------------------------
# The field's deciders. With chunk=128 beside B=28 a 250-token prompt runs as SQ_DEFLECT above
# (the fixed 128-token budget, decodes first, TBT ignored); with the default 4096-token budget a
# short prompt is one step.
# ---------------------------------------------------------------------------------------------
IDLE = (prefill_node(),)
B28_B8 = (decode_node("d1", b=28), decode_node("d2", b=8))
# B=8, chi=128: 120 per step at 0.048 + 0.012, the last 10 at 0.048 + 0.001
TO_D2 = {"chunks": (120, 120, 10), "step_times": (0.060, 0.060, 0.049), "ttft_dec": 0.169}


def rule(
    spec: str,
    prompt: int,
    prefill: tuple[PrefillNodeState, ...],
    decode: tuple[DecodeNodeState, ...],
    route: Route,
    reason: Reason,
    node: str = "d1",
    **expected: Any,
) -> RuleCase:
    """A RuleCase written on one line: the decision's route, reason and node, then its schedule."""
    return RuleCase(spec, prompt, prefill, decode, route, reason, node, **expected)


D, K = Route.DEFLECT, Route.KEEP
LLMD_CASES = [
    pytest.param(
        rule("llmd:threshold=251,chunk=128", 250, IDLE, B28, D, Reason.DEFLECT_LLMD_THRESHOLD, **SQ_DEFLECT),
        id="250 uncached tokens below 251: the decode node prefills it",
    ),
    pytest.param(
        rule("llmd:threshold=250,chunk=128", 250, IDLE, B28, K, Reason.KEEP_LLMD_THRESHOLD),
        id="250 at the threshold: disaggregates",
    ),
    pytest.param(
        rule("llmd:threshold=249,chunk=128", 250, IDLE, B28, K, Reason.KEEP_LLMD_THRESHOLD),
        id="250 above 249: disaggregates",
    ),
    pytest.param(
        rule("llmd:threshold=0,chunk=128", 250, TWO_BUSY, B28, D, Reason.DEFLECT_LLMD_THRESHOLD, **SQ_DEFLECT),
        id="threshold 0 turns disaggregation off: every request on its decode node",
    ),
    pytest.param(
        rule(
            "llmd",
            15,
            IDLE,
            (decode_node("d1"),),
            D,
            Reason.DEFLECT_LLMD_THRESHOLD,
            chunks=(15,),
            step_times=(0.0415,),
            ttft_dec=0.0415,
        ),
        id="defaults: 15 tokens below 16, one step of the 4096-token budget",
    ),
    pytest.param(
        rule("llmd", 16, IDLE, (decode_node("d1"),), K, Reason.KEEP_LLMD_THRESHOLD),
        id="defaults: 16 tokens disaggregate",
    ),
    pytest.param(
        rule(
            "llmd:threshold=2048",
            2047,
            IDLE,
            B28,
            D,
            Reason.DEFLECT_LLMD_THRESHOLD,
            chunks=(2047,),
            step_times=(0.2727,),
            ttft_dec=0.2727,
        ),
        id="2047 tokens in one unguarded 0.27 s step (tau 0.070 ignored)",
    ),
    pytest.param(
        rule("llmd:threshold=300,chunk=128", 250, IDLE, B28_B8, D, Reason.DEFLECT_LLMD_THRESHOLD, "d2", **TO_D2),
        id="the least-loaded decode node takes it",
    ),
    pytest.param(
        rule(
            "llmd:threshold=300,chunk=128",
            250,
            IDLE,
            (decode_node("d1", b=28, reported_at=-1.0),),
            K,
            Reason.KEEP_NO_ELIGIBLE_DECODE,
        ),
        id="a stale decode node is never handed a prefill",
    ),
    pytest.param(
        rule("llmd:threshold=300,chunk=128", 250, IDLE, (decode_node("d1", b=128),), K, Reason.KEEP_NO_ELIGIBLE_DECODE),
        id="decodes fill the 128-token budget: no room to prefill",
    ),
    pytest.param(
        rule(
            "llmd:threshold=300,chunk=128",
            250,
            IDLE,
            (decode_node("d1", b=28, k=800, capacity=1000),),
            K,
            Reason.KEEP_NO_ELIGIBLE_DECODE,
        ),
        id="200 free KV tokens for 250: kept",
    ),
]


@pytest.mark.parametrize("case", LLMD_CASES)
def test_llmd_policy(case: RuleCase) -> None:
    check_rule_case(case)


BUSY = (prefill_node(queue=(4001,)),)  # chi_p = 1000: 4001 queued tokens > 4 x 1000
DYNAMO_CASES = [
    pytest.param(
        rule("dynamo:chunk=128", 250, (prefill_node(queue=(100_000,)),), B28, K, Reason.KEEP_DYNAMO_RULE),
        id="isl_bounding: effective/raw = 1 >= 0.7 without a prefix cache, however loaded the pool",
    ),
    pytest.param(
        rule("dynamo:mode=load,chunk=128", 250, (prefill_node(queue=(4000,)),), B28, K, Reason.KEEP_DYNAMO_RULE),
        id="prefill_load: 4000 queued tokens = 4 x chi_p is not busy",
    ),
    pytest.param(
        rule("dynamo:mode=load,chunk=128", 250, BUSY, B28, D, Reason.DEFLECT_DYNAMO_LOAD, **SQ_DEFLECT),
        id="prefill_load: 4001 > 4 x chi_p is busy: bypass",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,chunk=128",
            250,
            (prefill_node(queue=(2000, 2001)),),
            B28,
            D,
            Reason.DEFLECT_DYNAMO_LOAD,
            **SQ_DEFLECT,
        ),
        id="prefill_load counts every queued request's tokens",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,chunk=128",
            250,
            (prefill_node("p1", (5000,)), prefill_node("p2", (100,))),
            B28,
            K,
            Reason.KEEP_DYNAMO_RULE,
        ),
        id="prefill_load reads the prefill node it would pick (p2, idle), not the busiest",
    ),
    pytest.param(
        rule("dynamo:mode=load,busy=0,chunk=128", 250, IDLE, B28, K, Reason.KEEP_DYNAMO_RULE),
        id="busy 0: an empty queue is not busy",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,busy=0,chunk=128",
            250,
            (prefill_node(queue=(1,)),),
            B28,
            D,
            Reason.DEFLECT_DYNAMO_LOAD,
            **SQ_DEFLECT,
        ),
        id="busy 0: one queued token is busy",
    ),
    pytest.param(
        rule("dynamo:mode=either,chunk=128", 250, BUSY, B28, D, Reason.DEFLECT_DYNAMO_LOAD, **SQ_DEFLECT),
        id="either: the load condition alone bypasses",
    ),
    pytest.param(
        rule("dynamo:mode=either,chunk=128", 250, IDLE, B28, K, Reason.KEEP_DYNAMO_RULE),
        id="either: neither condition keeps",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,chunk=128",
            250,
            BUSY,
            (decode_node("d1", b=28, k=250, capacity=1000),),
            D,
            Reason.DEFLECT_DYNAMO_LOAD,
            **SQ_DEFLECT,
        ),
        id="KV guard 0.5: 250 used + 250 = 500 of 1000 is not over",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,chunk=128",
            250,
            BUSY,
            (decode_node("d1", b=28, k=251, capacity=1000),),
            K,
            Reason.KEEP_DYNAMO_KV_GUARD,
        ),
        id="KV guard 0.5: 251 + 250 = 501 of 1000 vetoes the bypass",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,chunk=128",
            250,
            BUSY,
            (decode_node("d1", b=28, capacity=1000, backlog=(251,)),),
            K,
            Reason.KEEP_DYNAMO_KV_GUARD,
        ),
        id="KV guard counts KV promised to deflected prefills",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,kv=off,chunk=128",
            250,
            BUSY,
            (decode_node("d1", b=28, k=700, capacity=1000),),
            D,
            Reason.DEFLECT_DYNAMO_LOAD,
            **SQ_DEFLECT,
        ),
        id="kv=off: 950 of 1000 still bypasses",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,kv=off,chunk=128",
            250,
            BUSY,
            (decode_node("d1", b=28, k=800, capacity=1000),),
            K,
            Reason.KEEP_NO_ELIGIBLE_DECODE,
        ),
        id="kv=off: 200 free KV tokens for 250 cannot take it",
    ),
    pytest.param(
        rule(
            "dynamo:mode=load,chunk=128",
            250,
            BUSY,
            (decode_node("d1", b=28, reported_at=-1.0),),
            K,
            Reason.KEEP_NO_ELIGIBLE_DECODE,
        ),
        id="a stale decode node is never handed a prefill",
    ),
]


@pytest.mark.parametrize("case", DYNAMO_CASES)
def test_dynamo_policy(case: RuleCase) -> None:
    check_rule_case(case)


@pytest.mark.parametrize(
    ("mode", "prompt", "reason"),
    [
        pytest.param("isl", 2047, Reason.DEFLECT_DYNAMO_ISL, id="isl: 2047 < 2048"),
        pytest.param("isl", 2048, Reason.KEEP_DYNAMO_RULE, id="isl: 2048 is not below 2048"),
        pytest.param("either", 2047, Reason.DEFLECT_DYNAMO_ISL, id="either: both hold, isl named"),
        pytest.param("load", 2047, Reason.DEFLECT_DYNAMO_LOAD, id="load ignores the ISL bound"),
    ],
)
def test_dynamo_isl_bounding_is_strict(mode: str, prompt: int, reason: Reason) -> None:
    """create_policy bounds the ratio to [0, 1] as Dynamo does, so a cache-less prompt (ratio 1)
    never passes; built directly with a ratio above 1, the ISL bound is checked on its own."""
    policy = DynamoPolicy(FLAT, DeciderConfig(), mode=mode, isl_ratio=1.01, kv_busy=None)
    d = policy.decide(prompt, view(BUSY, (decode_node("d1"),)), 0.0)
    assert d.reason == reason


AIBRIX_BUSY = (prefill_node(queue=(9091,)),)  # Eq. 2: 9.091 x 0.110 = 1.00001 s to drain > 1 s
AIBRIX_CASES = [
    pytest.param(
        rule("aibrix:chunk=128", 250, AIBRIX_BUSY, B28, D, Reason.DEFLECT_AIBRIX_DRAIN, **SQ_DEFLECT),
        id="a prefill node drains in 1.00001 s > 1 s, d1 in 0 < 0.25 s: combined",
    ),
    pytest.param(
        rule("aibrix:chunk=128", 250, (prefill_node(queue=(9090,)),), B28, K, Reason.KEEP_AIBRIX_DRAIN),
        id="0.9999 s is not over 1 s: P/D",
    ),
    pytest.param(
        rule(
            "aibrix:chunk=128",
            250,
            (prefill_node("p1", (9091,), reported_at=-1.0), prefill_node("p2")),
            B28,
            K,
            Reason.KEEP_AIBRIX_DRAIN,
        ),
        id="a stale prefill node's queue is not counted",
    ),
    pytest.param(
        rule(
            "aibrix:chunk=128",
            250,
            AIBRIX_BUSY,
            (decode_node("d1", b=20, backlog=(400,)),),
            K,
            Reason.KEEP_AIBRIX_DRAIN,
        ),
        id="the only decode node needs 0.28 s for its backlog (>= 0.25 s): P/D",
    ),
    pytest.param(
        rule(
            "aibrix:chunk=128",
            250,
            AIBRIX_BUSY,
            (decode_node("d1", b=20, backlog=(300,)),),
            D,
            Reason.DEFLECT_AIBRIX_DRAIN,
            chunks=(108, 108, 34),
            step_times=(0.0708, 0.0708, 0.0634),
            ttft_dec=0.205,
        ),
        id="backlog drains in 0.21 s < 0.25 s: combined, 108 (128 - 20) per step",
    ),
    pytest.param(
        rule(
            "aibrix:high=0.2,chunk=128",
            250,
            IDLE,
            (decode_node("d1", b=20, backlog=(300,)), decode_node("d2", b=8)),
            D,
            Reason.DEFLECT_AIBRIX_DRAIN,
            "d2",
            **TO_D2,
        ),
        id="idle prefill, but a decode node drains in 0.21 s > 0.2 s: the idle d2 takes it",
    ),
    pytest.param(
        rule(
            "aibrix:chunk=128",
            250,
            AIBRIX_BUSY,
            (decode_node("d1", b=28), decode_node("d2", backlog=(100,))),
            D,
            Reason.DEFLECT_AIBRIX_DRAIN,
            **SQ_DEFLECT,
        ),
        id="lowest drain score first (d1 0 s before d2 0.05 s), though d2 is less loaded",
    ),
    pytest.param(
        rule("aibrix:chunk=128", 250, AIBRIX_BUSY, B28_B8, D, Reason.DEFLECT_AIBRIX_DRAIN, "d2", **TO_D2),
        id="equal drain scores: the less loaded node",
    ),
    pytest.param(
        rule("aibrix:low=0,chunk=128", 250, AIBRIX_BUSY, B28, K, Reason.KEEP_AIBRIX_DRAIN),
        id="low 0: nothing drains in under 0 s",
    ),
    pytest.param(
        rule(
            "aibrix:chunk=128",
            250,
            AIBRIX_BUSY,
            (decode_node("d1", b=28, reported_at=-1.0),),
            K,
            Reason.KEEP_NO_ELIGIBLE_DECODE,
        ),
        id="a stale decode node is never handed a prefill",
    ),
]


@pytest.mark.parametrize("case", AIBRIX_CASES)
def test_aibrix_policy(case: RuleCase) -> None:
    check_rule_case(case)


def test_aibrix_backlog_never_drains_when_decodes_fill_the_step_budget() -> None:
    policy = create_policy("aibrix:chunk=128", FLAT)
    assert isinstance(policy, AibrixPolicy)
    assert policy.decode_drain_s(decode_node(b=128, backlog=(10,))) == float("inf")
    assert policy.decode_drain_s(decode_node(b=128)) == 0.0


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
    # Q=100000: the step running at the heartbeat, half done, then 100 packed steps, each 0.110:
    # 11.055 s on the prefill path, still kept
    d = create_policy("pd", FLAT).decide(1000, view((prefill_node(queue=(100_000,)),), decode), 0.0)
    assert (d.route, d.reason, d.prefill_node, d.decode_node) == (Route.KEEP, Reason.KEEP_POLICY, "p1", expected)
    # the keep path's TTFT: the prefill end (11.055) + the KV hand-off, 1.001 s of transfer + the
    # first decode step (0.041 on the idle d1; T0(11) + T0(10) / 2 = 0.076 on d2)
    assert d.predicted_prefill_end_s == pytest.approx(11.055)
    assert d.predicted_ttft_prefill_s == pytest.approx(11.055 + 1.001 + (0.041 if expected == "d1" else 0.076))
    assert d.predicted_ttft_decode_s is None
    assert d.chunk_sizes == ()


@pytest.mark.parametrize("spec", ["pd", "sq:theta=0", "sl:l=100", "kairos", "oracle", "llmd", "dynamo", "aibrix"])
def test_every_policy_rejects_an_empty_prompt(spec: str) -> None:
    with pytest.raises(InvalidRequestError):
        create_policy(spec, FLAT).decide(0, view((prefill_node(),), (decode_node(),)), 0.0)


def test_pd_without_decode_nodes_raises() -> None:
    with pytest.raises(NoHealthyNodeError):
        create_policy("pd", FLAT).decide(100, view((prefill_node(),), ()), 0.0)


# tau = 0.105, candidates (420, 220, 120); Q=1700: Eq. 1 = 0.297, bound 0.3861. d1 carries one
# deflected 300-token prefill: 0.090, then the request beside B=21: 0.1009 + 0.1009 + 0.0812.
# Against the paper's Eq. 1 (keep_estimate="eq1") and Eq. 7 (alpha 1.3, no deflection gate);
# test_kairos_keep_estimate adds the hand-off.
KAIROS_BASE = DeciderConfig(
    tbt_slo_s=0.105, chunk_candidates=(420, 220, 120), keep_estimate="eq1", alpha=1.3, deflect_gate_share=None
)
BACKLOGGED = view((prefill_node(queue=(1700,)),), (decode_node("d1", b=20, backlog=(300,)),))


@pytest.mark.parametrize(
    ("spec", "route", "reason", "chunks", "ttft_dec"),
    [
        pytest.param(
            "kairos:pending=1", Route.KEEP, Reason.KEEP_NO_ELIGIBLE_DECODE, (), None, id="kairos pending 1 keeps"
        ),
        pytest.param(
            "kairos",
            Route.DEFLECT,
            Reason.DEFLECT_WITHIN_MARGIN,
            (399, 399, 202),
            0.373,
            id="kairos (no pending limit): deflects behind the backlog",
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
    policy = create_policy(spec, FLAT, base=KAIROS_BASE)
    d = policy.decide(1000, BACKLOGGED, 0.0)
    assert (d.route, d.reason, d.chunk_sizes) == (route, reason, chunks)
    assert d.predicted_ttft_prefill_s == pytest.approx(0.297)
    assert d.predicted_ttft_decode_s == pytest.approx(ttft_dec)
    assert isinstance(policy, KairosPolicy)
    assert d == decide(1000, BACKLOGGED, 0.0, FLAT, policy.config)


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        pytest.param("kairos", "kairos(alpha=1,beta=1)", id="kairos-defaults"),
        pytest.param("kairos:pending=none", "kairos(alpha=1,beta=1)", id="kairos-pending-none-is-the-default"),
        pytest.param("kairos:pending=1", "kairos(alpha=1,beta=1,pending=1)", id="kairos-pending-1"),
        pytest.param("oracle:alpha=1.5", "oracle(alpha=1.5,beta=1)", id="oracle"),
        pytest.param("kairos:keep=eq1", "kairos(alpha=1,beta=1,keep=eq1)", id="kairos-keep-eq1"),
        pytest.param("kairos:keep=full", "kairos(alpha=1,beta=1)", id="kairos-keep-full-is-the-default"),
        pytest.param("sl:l=512", "sl(l=512)", id="sl"),
        pytest.param(
            "kairos:chunks=2048/1024/512/256/128",
            "kairos(alpha=1,beta=1,chunks=2048/1024/512/256/128)",
            id="kairos-the-papers-chunks",
        ),
        pytest.param(
            "oracle:chunks=2048/1792/1536/1280/1024/896/768/640/512/448/384/320/256/224/192/160/128",
            "oracle(alpha=1,beta=1)",
            id="oracle-the-default-chunks",
        ),
    ],
)
def test_policy_labels(spec: str, label: str) -> None:
    assert create_policy(spec, FLAT).label == label


def test_kairos_keep_estimate() -> None:
    """keep=full (the default) compares with the packed queue's prefill end (the 1000-token step
    running at the heartbeat, half done, 0.055, then 1,700 tokens in steps of 0.110 and 0.080: 0.245)
    + the KV hand-off to d1: 1.001 s of transfer and T0(22) + T0(21) / 2 = 0.0925 (B 20 + the
    backlog's request): 0.245 + 1.0935 = 1.3385, so alpha 1.2 now deflects (0.373 less half the
    backlog's running step, 0.045, = 0.328 <= 1.6062); keep=eq1 is the paper's Eq. 1 and keeps."""
    base = dataclasses.replace(KAIROS_BASE, keep_estimate="full")
    full = create_policy("kairos:alpha=1.2,pending=none", FLAT, base=base).decide(1000, BACKLOGGED, 0.0)
    assert (full.route, full.predicted_ttft_prefill_s) == (Route.DEFLECT, pytest.approx(1.3385))
    assert full.predicted_ttft_decode_s == pytest.approx(0.328)
    eq1 = create_policy("kairos:alpha=1.2,pending=none,keep=eq1", FLAT, base=base)
    assert isinstance(eq1, KairosPolicy) and eq1.config.keep_estimate == "eq1"
    d = eq1.decide(1000, BACKLOGGED, 0.0)
    assert (d.route, d.reason) == (Route.KEEP, Reason.KEEP_DECODE_SLOWER)
    assert d.predicted_ttft_prefill_s == pytest.approx(0.297)


@pytest.mark.parametrize("spec", ["kairos:keep=eq2", "oracle:keep=", "pd:keep=eq1"])
def test_keep_estimate_param_is_checked(spec: str) -> None:
    with pytest.raises(UnknownPolicyError, match="keep"):
        create_policy(spec, FLAT)


@pytest.mark.parametrize(
    ("spec", "policy", "settings"),
    [
        ("kairos:alpha=1.3,gate=off,prefix=off", "kairos:prefix=off", {"alpha": 1.3, "deflect_gate_share": None}),
        (
            "kairos:keep=eq1,pending=2,chunks=512/256",
            "kairos",
            {"keep_estimate": "eq1", "max_pending_deflections": 2, "chunk_candidates": (512, 256)},
        ),
        ("kairos:alpha=1", "kairos", {"alpha": 1.0}),  # given, though the default: the variant says it
        ("pd:prefix=off", "pd:prefix=off", {}),
    ],
)
def test_a_simulator_spec_in_its_gateway_form(spec: str, policy: str, settings: dict[str, object]) -> None:
    """A live benchmark runs a spec's variant on the gateway, which takes the decider's knobs as
    the dispatcher's own settings: the same DeciderConfig either way."""
    assert gateway_settings(spec) == (policy, settings)
    simulated = create_policy(spec, FLAT)
    gateway = create_policy(policy, FLAT, dataclasses.replace(DeciderConfig(), **settings))
    assert getattr(simulated, "config", None) == getattr(gateway, "config", None)
