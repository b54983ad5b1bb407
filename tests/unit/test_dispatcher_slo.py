"""The dispatcher decides each request by its own SLOs: the x-slo-ttft-ms / x-slo-tpot-ms headers
and vLLM's priority (kairos.core.slo), answers with the SLOs it used and the request's class, counts
decisions by class, and refuses a bad value with an OpenAI-style 400 (before the body, from the head)."""

from __future__ import annotations

from kairos.common import contracts as c
from kairos.core.latency import LatencyModels
from kairos.core.policies import create_policy
from kairos.extproc.dispatcher import Rejected, RequestHead, Routed
from tests.unit import test_dispatcher as base
from tests.unit.test_dispatcher import (
    COMPLETIONS,
    LOADED_QUEUE,
    HarnessFactory,
    completion_body,
    error_of,
    headers_of,
    make_cluster,
)

# The dispatcher tests' fixtures: a tiny model's tokenizer, the packaged profile, a harness.
tokenizer, models, harness = base.tokenizer, base.models, base.harness
SLO_HEADERS = (c.H_DECIDED_TTFT_SLO_MS, c.H_DECIDED_TPOT_SLO_MS, c.H_SLO_CLASS)


def head(**slo: str) -> RequestHead:
    headers = {":method": "POST", ":path": COMPLETIONS, "content-type": "application/json"}
    headers |= {name.replace("_", "-"): value for name, value in slo.items()}
    return RequestHead.of("POST", COMPLETIONS, headers)


async def test_a_request_is_decided_by_its_own_ttft_slo(harness: HarnessFactory) -> None:
    h = harness(make_cluster(prefill_queue=LOADED_QUEUE))
    plain = await h.dispatcher.route(head(), completion_body(1000))
    assert isinstance(plain, Routed)
    got = headers_of(plain)
    assert got[c.H_ROUTE] == "deflect"  # the loaded prefill queue: a decode node is faster
    assert tuple(map(got.get, SLO_HEADERS)) == (
        "4000",
        "70",
        "standard",
    )
    # The same request with a TTFT SLO no deflection can meet: kept, Eq. 7's SLO clause.
    tight = await h.dispatcher.route(head(x_slo_ttft_ms="20", x_slo_tpot_ms="60"), completion_body(1000))
    assert isinstance(tight, Routed)
    got = headers_of(tight)
    assert (got[c.H_ROUTE], got[c.H_REASON]) == ("keep", "keep_decode_over_slo")
    assert tuple(map(got.get, SLO_HEADERS)) == (
        "20",
        "60",
        "interactive",
    )
    assert tight.decision is not None and tight.decision.slo is not None and tight.decision.slo.ttft_s == 0.02
    assert h.sample("kairos_dispatcher_class_decisions_total", **{"class": "interactive", "route": "keep"}) == 1
    assert h.sample("kairos_dispatcher_class_decisions_total", **{"class": "standard", "route": "deflect"}) == 1


async def test_a_policy_without_slos_decides_by_the_cluster_slo(harness: HarnessFactory, models: LatencyModels) -> None:
    h = harness(make_cluster(prefill_queue=LOADED_QUEUE), policy=create_policy("kairos:slo=off", models))
    routed = await h.dispatcher.route(head(x_slo_ttft_ms="20", x_slo_tpot_ms="60"), completion_body(1000))
    assert isinstance(routed, Routed)
    got = headers_of(routed)
    assert got[c.H_ROUTE] == "deflect"
    # The SLOs it used are the cluster's; the class is still the request's own.
    assert tuple(map(got.get, SLO_HEADERS)) == (
        "4000",
        "70",
        "interactive",
    )


async def test_a_bad_slo_header_is_a_400_from_the_head_and_from_the_whole_request(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    for bad in ({"x_slo_ttft_ms": "soon"}, {"x_slo_tpot_ms": "-1"}, {"x_slo_ttft_ms": "0"}):
        early = h.dispatcher.check_headers(head(**bad))
        assert isinstance(early, Rejected) and early.status == 400
        name = next(iter(bad)).replace("_", "-")
        assert name in error_of(early)["message"] and error_of(early)["type"] == "invalid_request_error"
        whole = await h.dispatcher.route(head(**bad), completion_body(10))
        assert isinstance(whole, Rejected) and whole.status == 400
    assert h.dispatcher.check_headers(head(x_slo_ttft_ms="1000", x_slo_tpot_ms="60")) is None
    assert h.sample("kairos_dispatcher_rejections_total", code="invalid_request") == 6


async def test_priority_is_checked_as_vllm_reads_it_and_forwarded_as_sent(harness: HarnessFactory) -> None:
    h = harness(make_cluster())
    for good, value in ((3, 3), (-2, -2), ("7", 7), (1.0, 1)):
        routed = await h.dispatcher.route(head(), completion_body(10, priority=good))
        assert isinstance(routed, Routed) and routed.decision is not None
        assert routed.decision.slo is not None and routed.decision.slo.priority == value
    for bad in (None, "high", 1.5, [1]):
        refused = await h.dispatcher.route(head(), completion_body(10, priority=bad))
        assert isinstance(refused, Rejected) and refused.status == 400
        assert error_of(refused)["param"] == "priority"
