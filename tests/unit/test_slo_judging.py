"""One request judged against its own SLOs (kairos.core.slo.meets_slo, the simulator's, replay's
and the sidecar's one definition), and the sidecar's pure helpers around it: the SLOs and class
a request is judged by from its headers, its stream's gaps over its TPOT SLO, its output tokens."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.core.slo import DEFAULT_CLASSES, TBT_OVER_SLO_SHARE, RequestSLO, meets_slo, parse_classes
from kairos.launcher.replay import ReplayConfig, RequestResult, _meets_slo
from kairos.nodeagent.sidecar.judgement import _gaps_over, _output_tokens, judged_by


def test_a_request_within_both_slos_meets_them() -> None:
    assert meets_slo(0.9, 1.0, 0, 40)
    assert meets_slo(1.0, 1.0, 2, 40)  # at the TTFT SLO is within it; 2 of 40 gaps over is 5%


def test_a_ttft_over_its_slo_or_no_first_token_misses() -> None:
    assert not meets_slo(1.001, 1.0, 0, 40)
    assert not meets_slo(None, 1.0, 0, 0)


def test_the_tpot_slo_allows_five_percent_of_the_gaps_over_it() -> None:
    assert TBT_OVER_SLO_SHARE == 0.05
    assert meets_slo(0.5, 1.0, 5, 100)  # exactly 5%: the request's P95 gap is within its TPOT
    assert not meets_slo(0.5, 1.0, 6, 100)
    assert meets_slo(0.5, 1.0, 1, 20) and not meets_slo(0.5, 1.0, 1, 19)  # 1 of 19 is 5.3%
    assert not meets_slo(0.5, 1.0, 1, 10)  # a short stream has no gap to spare


def test_a_request_without_gaps_is_judged_by_its_ttft_alone() -> None:
    assert meets_slo(0.5, 1.0, 0, 0)  # one token: no gap
    assert not meets_slo(1.5, 1.0, 0, 0)


def _result(ttft_s: float | None, gaps_ms: list[float], ok: bool = True) -> RequestResult:
    r = RequestResult("r", 0.0, 100, len(gaps_ms) + 1, ttft_slo_s=1.0, tpot_slo_s=0.050)
    r.status, r.ttft_s, r.tbt_ms = (200 if ok else 502), ttft_s, gaps_ms
    r.usage = {"completion_tokens": r.output_tokens}
    if not ok:
        r.error = "HTTP 502"
    return r


def test_replay_judges_by_the_same_definition() -> None:
    config = ReplayConfig()
    under, over = [40.0] * 19, [60.0]
    assert _meets_slo(_result(0.8, under + over), config)  # 1 of 20 gaps over 50 ms
    assert not _meets_slo(_result(0.8, under[:-1] + over), config)  # 1 of 19
    assert not _meets_slo(_result(1.2, under), config)
    assert not _meets_slo(_result(0.8, under, ok=False), config)  # a failed request misses


def _headers(**values: str) -> CIMultiDict[str]:
    return CIMultiDict(values)


def test_the_sidecar_judges_a_request_by_its_own_slos_and_the_dispatchers_class() -> None:
    decided = {c.H_DECIDED_TTFT_SLO_MS: "20000", c.H_DECIDED_TPOT_SLO_MS: "150", c.H_SLO_CLASS: "batch"}
    assert judged_by(_headers(**decided), DEFAULT_CLASSES) == ("batch", RequestSLO(20.0, 0.150))
    # An SLO-blind policy decides by the cluster's SLOs; the request is judged by its own.
    blind = {
        c.H_DECIDED_TTFT_SLO_MS: "4000",
        c.H_DECIDED_TPOT_SLO_MS: "70",
        c.H_SLO_CLASS: "interactive",
        c.H_SLO_TTFT_MS: "1000",
        c.H_SLO_TPOT_MS: "60",
    }
    assert judged_by(_headers(**blind), DEFAULT_CLASSES) == ("interactive", RequestSLO(1.0, 0.060))
    # One own SLO: the other is the decided one.
    assert judged_by(_headers(**decided, **{c.H_SLO_TTFT_MS: "900"}), DEFAULT_CLASSES)[1] == RequestSLO(0.9, 0.150)


def test_the_sidecar_never_labels_with_a_class_it_does_not_know() -> None:
    default = RequestSLO(defaults.TTFT_SLO_S, defaults.TBT_SLO_S)
    # Sent straight to the sidecar: no headers, the cluster's defaults and their class.
    assert judged_by(_headers(), DEFAULT_CLASSES) == ("standard", default)
    # A class name that is none of the configured ones: the class its SLOs fall in.
    forged = _headers(**{c.H_SLO_CLASS: "vip\n{evil}", c.H_SLO_TTFT_MS: "900", c.H_SLO_TPOT_MS: "50"})
    assert judged_by(forged, DEFAULT_CLASSES) == ("interactive", RequestSLO(0.9, 0.050))
    # Malformed SLO values: the decided ones, else the defaults.
    bad = _headers(**{c.H_SLO_TTFT_MS: "soon", c.H_DECIDED_TTFT_SLO_MS: "nan", c.H_SLO_CLASS: "batch"})
    assert judged_by(bad, DEFAULT_CLASSES) == ("batch", default)
    # A sidecar configured with other classes counts by those.
    mine = parse_classes("gold=500/40,bronze=30000/200")
    assert judged_by(_headers(**{c.H_SLO_CLASS: "batch"}), mine) == ("bronze", default)
    assert judged_by(_headers(**{c.H_SLO_CLASS: "gold"}), mine)[0] == "gold"


def test_gaps_are_measured_from_the_first_token_chunk() -> None:
    assert _gaps_over(10.0, [], 0.05) == 0
    # Gaps 0.04, 0.06, 0.01, 0.051: two over 50 ms.
    assert _gaps_over(10.0, [10.04, 10.10, 10.11, 10.161], 0.05) == 2


@pytest.mark.parametrize(
    ("tail", "events", "tokens"),
    [
        (b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":17,"total_tokens":26}}\n\n', 3, 17),
        (b'data: {"usage":{"completion_tokens": 5}}\n\ndata: {"usage":{"completion_tokens": 6}}\n\n', 1, 6),
        (b'data: {"choices":[{"text":"a","finish_reason":"length"}]}\n\ndata: [DONE]\n\n', 12, 12),
    ],
)
def test_output_tokens_are_the_usage_where_the_stream_has_one_else_its_token_events(
    tail: bytes, events: int, tokens: int
) -> None:
    assert _output_tokens(tail, events) == tokens
