"""Algorithm 1 (Eqs. 1-7) with hand-computed expectations.

Unless a case says otherwise the models are the builders' round ones:
prefill step 0.010 + 1e-4 n; T0(B, K) = 0.040 + 0.001 B; a chunk of p prefill tokens over c
cached ones adds 1e-4 p + 1e-7 p c (``make_models``) or 1e-4 p (``flat_models``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest

from kairos.common import defaults
from kairos.common.errors import ConfigError, InvalidRequestError, NoHealthyNodeError
from kairos.core import algorithm as alg
from kairos.core.algorithm import (
    DeciderConfig,
    decide,
    decide_without_prefill_pool,
    deflection_gate_open,
    greedy_schedule,
    prefill_exec_s,
    prefill_queue_wait_s,
    prefill_ttft_s,
)
from kairos.core.algorithm.schedule import INFEASIBLE, TOO_SLOW
from kairos.core.decision import ChunkStep, Decision, Reason, Route
from kairos.core.state import DecodeNodeState, PrefillNodeState
from tests.builders import decode_node, flat_models, make_models, prefill_node, view

# ---------------------------------------------------------------------------------------------
# Eq. 2: queue wait = (sum l_i / chi_p) x T_step(chi_p, sum l_i^2 / (2 sum l_i)): each step over
# half of its own prompt cached on average (the paper: half the whole queue, sum l_i / 2)
# ---------------------------------------------------------------------------------------------
CACHED_PREFILL = make_models(prefill_x_cached=1e-8)  # prefill step 0.010 + 1e-4 n + 1e-8 n c


@pytest.mark.parametrize(
    ("queue", "chunk", "expected"),
    [
        pytest.param((), 512, 0.0, id="empty-queue-waits-nothing"),
        # 2048/512 = 4 steps x (0.010 + 0.0512 + 1e-8*512*1024) = 4 x 0.06644288
        pytest.param((2048,), 512, 0.26577152, id="one-2048-request: 4 steps at half cached"),
        # 4 steps x (0.010 + 0.0512 + 1e-8*512*512): each prompt's chunks over its own 512, not 1024
        pytest.param((1024, 1024), 512, 0.25528576, id="two-1024-requests-wait-less-than-one-2048"),
        # 3 steps x (0.010 + 0.0512 + 1e-8*512*c), c = (1024^2 + 512^2) / (2 x 1536) = 426.67
        pytest.param((1024, 512), 512, 0.1901536, id="uneven-prompts: token-weighted half"),
        # 300/1000 = 0.3 steps x (0.010 + 0.1 + 1e-8*1000*150) = 0.3 x 0.1115
        pytest.param((300,), 1000, 0.03345, id="fractional-step-count"),
    ],
)
def test_prefill_queue_wait_eq2(queue: tuple[int, ...], chunk: int, expected: float) -> None:
    node = prefill_node(queue=queue, chunk=chunk)
    assert prefill_queue_wait_s(CACHED_PREFILL, node) == pytest.approx(expected)


# A queue of 40 prompts of 200 tokens and a 100-token request, chi_p = 1000, prefill step 0.010 +
# 1e-4 n + 1e-7 n c. Eq. 2: 8 steps x (0.110 + 1e-4 x 100 cached) = 0.960; Eq. 3: 0.020; Eq. 1 =
# 0.980, under the gate's 1 s: the keep path meets the SLO with room, and it keeps. The paper's
# Eq. 2 costs each step over half the queue (4000 cached: 8 x 0.510 = 4.080) and put the keep
# path past the 4 s SLO, and the idle decode node took the request (DEFLECT_WITHIN_MARGIN). Under
# sustained load that over-prediction held keep-path requests incoming on their decode nodes long
# after they arrived, until no node could take a deflection (Bursty 8 RPS: 710 deflections).
def test_a_queue_of_short_prompts_is_not_one_long_prompt() -> None:
    models = make_models(prefill_x_cached=1e-7)
    cfg = dataclasses.replace(CFG, deflect_gate_share=0.25)
    v = view((prefill_node(queue=(200,) * 40),), (decode_node("d1"),))
    d = decide(100, v, 0.0, models, cfg)
    assert (d.route, d.reason) == (Route.KEEP, Reason.KEEP_SLO_ROOM)
    assert d.predicted_ttft_prefill_s == pytest.approx(0.980)


# ---------------------------------------------------------------------------------------------
# Eq. 3: ceil(l / chi_p) steps, chunk i over i x chi_p cached, the last one trimmed
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "chunk", "expected"),
    [
        pytest.param(0, 512, 0.0, id="no-prompt-no-steps"),
        pytest.param(1, 512, 0.0101, id="one-token: 0.010+1e-4"),
        pytest.param(300, 512, 0.040, id="shorter-than-a-chunk: one trimmed step"),
        # 0.0612 (c=0) + 0.0612 + 1e-8*512*512 (c=512) = 0.0612 + 0.06382144
        pytest.param(1024, 512, 0.12502144, id="two-full-chunks-no-extra-step"),
        # + last chunk of 176 over 1024 cached: 0.010 + 0.0176 + 1e-8*176*1024 = 0.02940224
        pytest.param(1200, 512, 0.15442368, id="two-full-chunks-and-a-trimmed-176"),
    ],
)
def test_prefill_exec_eq3(prompt: int, chunk: int, expected: float) -> None:
    assert prefill_exec_s(CACHED_PREFILL, prompt, chunk) == pytest.approx(expected)


def test_prefill_ttft_eq1_is_queue_wait_plus_exec() -> None:
    # 0.26577152 (Eq. 2, queue (2048,)) + 0.15442368 (Eq. 3, prompt 1200), chi_p = 512
    node = prefill_node(queue=(2048,), chunk=512)
    assert prefill_ttft_s(CACHED_PREFILL, node, 1200) == pytest.approx(0.4201952)


# ---------------------------------------------------------------------------------------------
# Eqs. 5-6: the greedy chunk schedule
# ---------------------------------------------------------------------------------------------
Step = tuple[int, float]  # (prefill tokens chi - B, predicted step seconds)


def _per_step(got: object) -> tuple[list[int], list[float], float]:
    """greedy_schedule's result as per-step prefill tokens, per-step times and finishing time."""
    assert not isinstance(got, str), got
    runs, finish = got  # type: ignore[misc]
    sizes, times = alg.expand_runs(runs)
    return sizes, times, finish


@dataclass(frozen=True)
class GreedyCase:
    prompt: int
    b: int
    k: int
    candidates: tuple[int, ...]
    budget: float
    steps: tuple[Step, ...] | str  # expected steps, or INFEASIBLE
    ttft: float = 0.0
    models: dict[str, float] = field(default_factory=dict)
    flat: bool = False


GREEDY_CASES = [
    # T0(20) = 0.060; p tokens over c cost 0.060 + 1e-4 p + 1e-7 p c <= 0.105
    pytest.param(
        GreedyCase(
            prompt=2000,
            b=20,
            k=0,
            candidates=(420, 220, 120),
            budget=0.105,
            steps=(
                (400, 0.100),  # 0.060 + 0.040; at c=400 the 400 chunk would be 0.116
                (200, 0.088),  # 0.060 + 0.020 + 0.008
                (200, 0.092),
                (200, 0.096),
                (200, 0.100),
                (200, 0.104),  # at c=1400 the 200 chunk would be 0.108
                (100, 0.084),  # 0.060 + 0.010 + 0.014
                (100, 0.085),
                (100, 0.086),
                (100, 0.087),
                (100, 0.088),
                (100, 0.089),
            ),
            ttft=1.099,  # 0.580 for the first six steps + 0.519 for the last six
        ),
        id="B20-2000-tokens: chunks shrink 400-200-100 as cached prefill grows",
    ),
    pytest.param(
        GreedyCase(
            prompt=1000,
            b=20,
            k=0,
            candidates=(420, 220, 120),
            budget=0.105,
            # last 400 in one step would be 0.060 + 0.040 + 0.024 = 0.124, so 200 + a trimmed 200
            steps=((400, 0.100), (200, 0.088), (200, 0.092), (200, 0.096)),
            ttft=0.376,
        ),
        id="B20-1000-tokens: 400-200-200-200",
    ),
    pytest.param(
        GreedyCase(300, 20, 0, (420, 220, 120), 0.105, ((300, 0.090),), 0.090),
        id="B20-300-tokens: one trimmed step 0.060+0.030",
    ),
    pytest.param(
        GreedyCase(1, 20, 0, (420, 220, 120), 0.105, ((1, 0.0601),), 0.0601),
        id="one-token-prompt: one step of B+1",
    ),
    # T0 = 0.040 + 0.010 + 1e-6 (K + c); a p chunk adds 1e-4 p
    pytest.param(
        GreedyCase(
            prompt=1000,
            b=10,
            k=10_000,
            candidates=(410, 210, 110),
            budget=0.102,
            steps=((400, 0.100), (400, 0.1004), (200, 0.0808)),
            ttft=0.2812,
            models={"decode_per_k": 1e-6},
            flat=True,
        ),
        id="K10000: 400-chunks fit, and the cached prefill counts as KV (0.1004)",
    ),
    pytest.param(
        GreedyCase(
            prompt=600,
            b=10,
            k=30_000,
            candidates=(410, 210, 110),
            budget=0.102,
            # T0 = 0.080 + 1e-6 c: a 400 chunk is 0.120, a 200 chunk 0.100 + 1e-6 c
            steps=((200, 0.100), (200, 0.1002), (200, 0.1004)),
            ttft=0.3006,
            models={"decode_per_k": 1e-6},
            flat=True,
        ),
        id="K30000: the same node with more KV only fits 200-chunks",
    ),
    # T0(150) = 0.190; candidate 120 <= B carries no prefill token
    pytest.param(
        GreedyCase(
            prompt=140,
            b=150,
            k=0,
            candidates=(420, 220, 120),
            budget=0.200,
            # 140 in one step: 0.204 > 0.200; 220 -> 70 tokens: 0.197; then 70 over 70: 0.197 + 0.00049
            steps=((70, 0.197), (70, 0.19749)),
            ttft=0.39449,
        ),
        id="B150: candidate 120 <= B never used, 220 carries 70",
    ),
    pytest.param(
        # 420 -> 270 tokens: 0.217, 220 -> 70: 0.197, both > 0.195; 120 carries -30: skipped (T0 alone fits)
        GreedyCase(300, 150, 0, (420, 220, 120), 0.195, INFEASIBLE),
        id="B150: candidates <= B skipped, so infeasible",
    ),
    pytest.param(
        # T0(120) = 0.160; 420 -> 300: 0.190, 220 -> 100: 0.170 > 0.165; candidate 120 == B carries 0
        GreedyCase(500, 120, 0, (420, 220, 120), 0.165, INFEASIBLE),
        id="B120: candidate equal to B skipped, so infeasible",
    ),
    pytest.param(
        GreedyCase(100, 40, 0, defaults.PAPER_CHUNK_CANDIDATES, 0.070, INFEASIBLE),
        id="B40: T0 0.080 over the 0.070 budget, infeasible",
    ),
    pytest.param(
        # T0(10) = 0.050; only 128 fits: 0.0618 + 1e-7*118*c <= 0.070 while c <= 694
        GreedyCase(1000, 10, 0, defaults.PAPER_CHUNK_CANDIDATES, 0.070, INFEASIBLE),
        id="B10-1000-tokens: infeasible once 708 tokens are cached (0.0701544)",
    ),
    pytest.param(
        GreedyCase(
            prompt=700,
            b=10,
            k=0,
            candidates=defaults.PAPER_CHUNK_CANDIDATES,
            budget=0.070,
            steps=(
                (118, 0.0618),  # 0.050 + 0.0118
                (118, 0.0631924),  # + 1e-7*118*118
                (118, 0.0645848),
                (118, 0.0659772),
                (118, 0.0673696),
                (110, 0.06749),  # 0.050 + 0.011 + 1e-7*110*590
            ),
            ttft=0.390414,
        ),
        id="B10-700-tokens: five 118-chunks and a trimmed 110 just fit",
    ),
    pytest.param(
        GreedyCase(
            prompt=700,
            b=10,
            k=0,
            candidates=defaults.CHUNK_CANDIDATES,  # four per octave: 192, 160 and 128 here
            budget=0.070,
            steps=(
                (182, 0.0682),  # 0.050 + 0.0182
                (150, 0.06773),  # 182 more would be 0.0715: 0.050 + 0.015 + 1e-7*150*182
                (150, 0.06998),
                (118, 0.0674876),  # 150 would be 0.0722
                (100, 0.066),
            ),
            ttft=0.3393976,
        ),
        id="B10-700-tokens, the default chunks: five steps where the paper's take six",
    ),
    # flat, knee at 300 step tokens, 1e-4 per token over it: 420 -> 400 costs 0.100 + 0.012 = 0.112;
    # 220 -> 200 is under the knee (0.080); the last 300 ride a 320-token step: 0.090 + 0.002
    pytest.param(
        GreedyCase(
            prompt=500,
            b=20,
            k=0,
            candidates=(420, 220, 120),
            budget=0.105,
            steps=((200, 0.080), (300, 0.092)),
            ttft=0.172,
            models={"mixed_over_knee": 1e-4, "mixed_knee": 300},
            flat=True,
        ),
        id="knee at 300 step tokens (B counted): 200 then a trimmed 300 instead of 400 + 100",
    ),
    # mixed_p_x_cached < 0: later chunks get cheaper, so the search restarts from the top each step
    pytest.param(
        GreedyCase(
            prompt=1000,
            b=10,
            k=0,
            candidates=(410, 210, 110),
            budget=0.075,
            # a p chunk over c: 0.050 + p*(1e-4 - 1e-7 c)
            steps=((200, 0.070), (200, 0.066), (400, 0.074), (200, 0.054)),
            ttft=0.264,
            models={"mixed_p_x_cached": -1e-7},
        ),
        id="not-monotone: chunk grows back to 400 once it is cheap enough",
    ),
]


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_greedy_schedule(case: GreedyCase) -> None:
    models = flat_models(**case.models) if case.flat else make_models(**case.models)
    got = greedy_schedule(models, case.prompt, case.b, case.k, case.candidates, case.budget)
    if isinstance(case.steps, str):
        assert got == case.steps
        return
    sizes, times, ttft = _per_step(got)
    assert sizes == [p for p, _ in case.steps]
    assert times == pytest.approx([t for _, t in case.steps])
    assert ttft == pytest.approx(case.ttft)
    assert sum(sizes) == case.prompt
    assert all(t <= case.budget for t in times)


@pytest.mark.parametrize(
    ("beta", "budget", "expected"),
    [
        # T0(10) = 0.050, flat: a p chunk costs 0.050 + 1e-4 p. Budget 0.070: 400 in one step is
        # 0.090, 256 -> 246 is 0.0746, 128 -> 118 is 0.0618; the last 164 (256 trimmed) is 0.0664
        pytest.param(1.0, 0.070, ((118, 0.0618), (118, 0.0618), (164, 0.0664)), id="beta1: 118-118-164"),
        pytest.param(1.5, 0.105, ((400, 0.090),), id="beta1.5: the whole 400 in one step"),
        pytest.param(0.5, 0.035, INFEASIBLE, id="beta0.5: below T0, infeasible"),
    ],
)
def test_beta_scales_the_step_budget(beta: float, budget: float, expected: tuple[tuple[int, float], ...] | str) -> None:
    cfg = DeciderConfig(beta=beta, tbt_slo_s=0.070)
    assert cfg.step_budget_s == pytest.approx(budget)
    got = greedy_schedule(flat_models(), 400, 10, 0, defaults.PAPER_CHUNK_CANDIDATES, cfg.step_budget_s)
    if isinstance(expected, str):
        assert got == expected
        return
    sizes, times, _ = _per_step(got)
    assert sizes == [p for p, _ in expected]
    assert times == pytest.approx([t for _, t in expected])


def test_greedy_start_time_and_give_up() -> None:
    models = make_models()
    # steps 0.100, 0.088, 0.092, 0.096: cumulative 0.100, 0.188, 0.280, 0.376
    done = greedy_schedule(models, 1000, 20, 0, (420, 220, 120), 0.105, start_s=1.0)
    sizes, times, finish = _per_step(done)
    assert sizes == [400, 200, 200, 200]
    assert times == pytest.approx([0.100, 0.088, 0.092, 0.096])
    assert finish == pytest.approx(1.376)
    assert greedy_schedule(models, 1000, 20, 0, (420, 220, 120), 0.105, give_up_after_s=0.3) == TOO_SLOW
    assert not isinstance(greedy_schedule(models, 1000, 20, 0, (420, 220, 120), 0.105, give_up_after_s=0.38), str)


def test_a_deflection_is_planned_beside_the_decodes_whose_kv_the_node_pulls() -> None:
    """Each reported pull joins the node's batch once its KV is in (within the link's time):
    the plan runs beside them, as on a node with those decodes already in; pulls=off plans on
    the heartbeat's B alone (the paper). Flat models, tau = 0.105: a 1000-token prompt on B=10
    takes 0.250 s, on B=20 (ten pulls of 100 tokens) 0.280 s; either starts after half the step
    the node runs now, with its 10 decodes (0.025)."""
    config = DeciderConfig(chunk_candidates=(420, 220, 120), tbt_slo_s=0.105, decode_overload_guard=False)
    models = flat_models()
    pulling = dataclasses.replace(decode_node(b=10, k=1000), pending_kv_pull_tokens=(100,) * 10)
    joined = decode_node(b=20, k=2000)
    plan = alg.plan_on_decode_node(models, config, pulling, 1000, math.inf)
    assert not isinstance(plan, str) and plan.decode_tokens == 20
    in_already = alg.plan_on_decode_node(models, config, joined, 1000, math.inf)
    assert not isinstance(in_already, str) and plan.runs == in_already.runs
    assert plan.ttft_s == pytest.approx(0.025 + 0.280) and in_already.ttft_s == pytest.approx(0.030 + 0.280)
    alone = alg.plan_on_decode_node(models, dataclasses.replace(config, plan_with_pulls=False), pulling, 1000, math.inf)
    assert not isinstance(alone, str) and alone.decode_tokens == 10 and alone.ttft_s == pytest.approx(0.025 + 0.250)


# ---------------------------------------------------------------------------------------------
# decide(): Algorithm 1
# ---------------------------------------------------------------------------------------------
# Flat models, candidates (420, 220, 120), tau = 0.105. For a 1000-token prompt:
#   decode B=10: 410 + 410 + 180 -> 0.091 + 0.091 + 0.068 = 0.250
#   decode B=20: 400 + 400 + 200 -> 0.100 + 0.100 + 0.080 = 0.280
#   decode B=40: 180 x 5 + 100  -> 0.098 x 5 + 0.090     = 0.580
#   decode B=70: T0 = 0.110 > 0.105                       -> no safe schedule
#   prefill chi_p=1000, queue Q: Eq. 1 = Q/1000 x 0.110 + 0.110
# These tables check Algorithm 1's comparisons (Eqs. 5-7) against the paper's Eq. 1
# (keep_estimate="eq1"): the builders' 1 MB/s link would add a second to every keep. The keep
# path's full estimate (Eq. 1 + the KV hand-off) has its own tables below (KEEP_HANDOFF_CASES),
# and so has the deflection gate (GATE_CASES), off here so that Eq. 7 decides alone.
CFG = DeciderConfig(
    keep_estimate="eq1",
    deflect_gate_share=None,
    alpha=1.3,
    beta=1.0,
    tbt_slo_s=0.105,
    ttft_slo_s=4.0,
    chunk_candidates=(420, 220, 120),
    stale_after_s=0.35,
    max_pending_deflections=1,
)
FLAT = flat_models()


@dataclass(frozen=True)
class DecideCase:
    prefill: tuple[PrefillNodeState, ...]
    decode: tuple[DecodeNodeState, ...]
    route: Route
    reason: Reason
    decode_node: str
    prefill_node: str | None
    ttft_pf: float
    ttft_dec: float | None
    chunks: tuple[int, ...] = ()
    step_tokens: tuple[int, ...] = ()
    config: dict[str, object] = field(default_factory=dict)
    prompt: int = 1000


def _deflect(
    q: int,
    decode: tuple[DecodeNodeState, ...],
    node: str,
    ttft_pf: float,
    ttft_dec: float,
    chunks: tuple[int, ...],
    **config: object,
) -> DecideCase:
    return DecideCase(
        prefill=(prefill_node(queue=(q,)),),
        decode=decode,
        route=Route.DEFLECT,
        reason=Reason.DEFLECT_WITHIN_MARGIN,
        decode_node=node,
        prefill_node=None,
        ttft_pf=ttft_pf,
        ttft_dec=ttft_dec,
        chunks=chunks,
        config=config,
    )


def _keep(
    q: int, decode: tuple[DecodeNodeState, ...], reason: Reason, node: str, ttft_pf: float, **config: object
) -> DecideCase:
    return DecideCase(
        prefill=(prefill_node(queue=(q,)),),
        decode=decode,
        route=Route.KEEP,
        reason=reason,
        decode_node=node,
        prefill_node="p1",
        ttft_pf=ttft_pf,
        ttft_dec=None,
        config=config,
    )


B20 = (decode_node("d1", b=20),)


def _incoming(node: DecodeNodeState, keeps: int) -> DecodeNodeState:
    return dataclasses.replace(node, incoming_keeps=keeps)


# Never worse than P/D: no deflection to a node whose decode-only step with its backlog and
# incoming keeps, T0 = 0.040 + 0.001 (B + backlog + incoming), is over min(tau, beta tau). The
# schedule search plans on the heartbeat's B alone, so without the rule every one of these
# deflects (test_overload_guard_off_deflects).
OVERLOAD_CASES = [
    pytest.param(
        _keep(5000, (_incoming(decode_node("d1", b=20), 50),), Reason.KEEP_DECODE_OVERLOADED, "d1", 0.660),
        id="B20 + 50 incoming keeps: T0 0.110 > tau 0.105, keeps",
    ),
    # (with the decode pressure rule off: with the request joined, 0.105 is over its line)
    pytest.param(
        _deflect(
            5000,
            (_incoming(decode_node("d1", b=20), 44),),
            "d1",
            0.660,
            0.280,
            (400, 400, 200),
            decode_pressure_share=None,
        ),
        id="B20 + 44 incoming keeps: T0 0.104 <= tau, deflects",
    ),
    pytest.param(
        _deflect(
            5000, (_incoming(decode_node("d1", b=10), 60), decode_node("d2", b=20)), "d2", 0.660, 0.280, (400, 400, 200)
        ),
        id="B10 + 60 incoming (0.250 on its heartbeat) overloaded: the B20 node (0.280) takes it",
    ),
    # beta 0.9: the line is beta tau = 0.0945; the plan on B20 alone fits 345-token chunks
    pytest.param(
        _keep(5000, (_incoming(decode_node("d1", b=20), 36),), Reason.KEEP_DECODE_OVERLOADED, "d1", 0.660, beta=0.9),
        id="beta 0.9: B20 + 36 incoming, T0 0.096 > 0.9 tau 0.0945, keeps",
    ),
    # beta 1.2: chunks may take 0.126, but the line stays at tau: B68's decodes alone (0.108)
    # already miss it; the plan would run 152-token chunks of 0.1232
    pytest.param(
        _keep(10000, (decode_node("d1", b=68),), Reason.KEEP_DECODE_OVERLOADED, "d1", 1.210, beta=1.2),
        id="beta 1.2: B68 T0 0.108 > tau (< 1.2 tau), keeps",
    ),
]
# Decode pressure: while the keep path meets the TTFT SLO (4 s), no deflection to a node whose
# decode-only step with the request joined, 0.040 + 0.001 (B + incoming + 1), is over
# decode_pressure_share (0.85) x tau = 0.08925. The request decodes on a decode node either way;
# what the rule refuses is its chunks on a node that P/D's own decodes already bring near tau.
PRESSURE_CASES = [
    pytest.param(
        _keep(5000, (_incoming(decode_node("d1", b=20), 30),), Reason.KEEP_DECODE_OVERLOADED, "d1", 0.660),
        id="pressure: B20 + 30 incoming, with the request T0 0.091 > 0.85 tau, keeps",
    ),
    pytest.param(
        _deflect(5000, (_incoming(decode_node("d1", b=20), 28),), "d1", 0.660, 0.280, (400, 400, 200)),
        id="pressure: B20 + 28 incoming, with the request T0 0.089 <= 0.85 tau, deflects",
    ),
    pytest.param(
        _deflect(
            5000, (_incoming(decode_node("d1", b=10), 40), decode_node("d2", b=20)), "d2", 0.660, 0.280, (400, 400, 200)
        ),
        id="pressure: B10 + 40 incoming (0.250 on its heartbeat) refused, the B20 node (0.280) takes it",
    ),
    pytest.param(
        _keep(5000, (_incoming(decode_node("d1", b=20), 36),), Reason.KEEP_DECODE_OVERLOADED, "d1", 0.660, beta=1.2),
        id="pressure: the line is 0.85 min(tau, beta tau), beta 1.2 does not raise it: B20 + 36, keeps",
    ),
    # Q=40000: Eq. 1 = 40 x 0.110 + 0.110 = 4.51 > the 4 s SLO: the deflection rescues the request
    pytest.param(
        _deflect(40000, (_incoming(decode_node("d1", b=20), 30),), "d1", 4.510, 0.280, (400, 400, 200)),
        id="pressure: B20 + 30 incoming, but the keep path (4.51 s) misses the TTFT SLO: deflects",
    ),
]
# The deflection gate: no deflection while the keep path's TTFT estimate, Q/1000 x 0.110 + 0.110,
# is under deflect_gate_share of the 4 s TTFT SLO. B10's decode path takes 0.250 for the
# 1000-token prompt, within alpha of every keep path below: Eq. 7 alone deflects each of them.
B10 = (decode_node("d1", b=10),)
GATE_CASES = [
    # Q=8000: 0.880 + 0.110 = 0.990 < 0.25 x 4 s
    pytest.param(
        _keep(8000, B10, Reason.KEEP_SLO_ROOM, "d1", 0.990, deflect_gate_share=0.25),
        id="gate 0.25: keep path 0.990 s under 1 s, keeps",
    ),
    # Q=9000: 0.990 + 0.110 = 1.100 >= 1 s: Eq. 7 decides, 0.250 <= 1.3 x 1.100
    pytest.param(
        _deflect(9000, B10, "d1", 1.100, 0.250, (410, 410, 180), deflect_gate_share=0.25),
        id="gate 0.25: keep path 1.100 s over 1 s, deflects",
    ),
    # gate 1: rescue only. Q=30000: 3.410 < 4 keeps; Q=40000: 4.510 >= 4 deflects
    pytest.param(
        _keep(30000, B10, Reason.KEEP_SLO_ROOM, "d1", 3.410, deflect_gate_share=1.0),
        id="gate 1: keep path 3.41 s meets the 4 s SLO, keeps",
    ),
    pytest.param(
        _deflect(40000, B10, "d1", 4.510, 0.250, (410, 410, 180), deflect_gate_share=1.0),
        id="gate 1: keep path 4.51 s misses the 4 s SLO, the deflection rescues it",
    ),
    pytest.param(
        _keep(0, (decode_node("d3", b=70),), Reason.KEEP_DECODE_OVERLOADED, "d3", 0.110, deflect_gate_share=0.25),
        id="gate 0.25: idle prefill and an overloaded node: the node's reason comes first",
    ),
]
DECIDE_CASES = [
    # Q=960: Eq. 1 = 0.1056 + 0.110 = 0.2156; x1.3 = 0.28028 >= 0.280
    pytest.param(
        DecideCase(
            prefill=(prefill_node(queue=(960,)),),
            decode=B20,
            route=Route.DEFLECT,
            reason=Reason.DEFLECT_WITHIN_MARGIN,
            decode_node="d1",
            prefill_node=None,
            ttft_pf=0.2156,
            ttft_dec=0.280,
            chunks=(400, 400, 200),
            step_tokens=(420, 420, 220),
        ),
        id="B20 decode 0.280 just inside 1.3 x 0.2156: deflects",
    ),
    # Q=950: 0.1045 + 0.110 = 0.2145; x1.3 = 0.27885 < 0.280 (the search gives up: no decode TTFT)
    pytest.param(_keep(950, B20, Reason.KEEP_DECODE_SLOWER, "d1", 0.2145), id="0.280 just outside 1.3 x 0.2145: keeps"),
    pytest.param(
        _keep(960, B20, Reason.KEEP_DECODE_SLOWER, "d1", 0.2156, alpha=1.0),
        id="alpha 1: 0.280 > 0.2156 keeps",
    ),
    # Q=2000: 0.220 + 0.110 = 0.330 >= 0.280
    pytest.param(
        _deflect(2000, B20, "d1", 0.330, 0.280, (400, 400, 200), alpha=1.0),
        id="alpha 1: 0.280 <= 0.330 deflects",
    ),
    pytest.param(
        _keep(960, B20, Reason.KEEP_DECODE_OVER_SLO, "d1", 0.2156, alpha=2.0, ttft_slo_s=0.25),
        id="within 2 x 0.2156 but over the 0.25 TTFT SLO: keeps",
    ),
    pytest.param(
        _deflect(960, B20, "d1", 0.2156, 0.280, (400, 400, 200), alpha=2.0, ttft_slo_s=0.30),
        id="within 2 x 0.2156 and under the 0.30 TTFT SLO: deflects",
    ),
    pytest.param(
        _keep(950, (decode_node("d1", b=20), decode_node("d3", b=70)), Reason.KEEP_DECODE_SLOWER, "d1", 0.2145),
        id="one node too slow, the other infeasible: keeps as decode slower on the lower-T0 node",
    ),
    # Q=5000: 0.550 + 0.110 = 0.660, bound 0.858; ids sorted: d1 0.580, d2 0.250, d3 infeasible, d4 0.280
    pytest.param(
        _deflect(
            5000,
            (decode_node("d1", b=40), decode_node("d2", b=10), decode_node("d3", b=70), decode_node("d4", b=20)),
            "d2",
            0.660,
            0.250,
            (410, 410, 180),
        ),
        id="fastest feasible node B10 (0.250) beats B20, B40 and an infeasible B70",
    ),
    pytest.param(
        _deflect(5000, (decode_node("d2", b=20), decode_node("d1", b=20)), "d1", 0.660, 0.280, (400, 400, 200)),
        id="two identical nodes: the lower id wins",
    ),
    pytest.param(
        _keep(5000, (decode_node("d3", b=70),), Reason.KEEP_DECODE_OVERLOADED, "d3", 0.660),
        id="only B70 (T0 0.110 > tau): decode overloaded, keeps",
    ),
    # B64: T0 0.104 is within tau, but the smallest candidate's 56 prefill tokens make 0.1096
    pytest.param(
        _keep(5000, (decode_node("d3", b=64),), Reason.KEEP_NO_SAFE_SCHEDULE, "d3", 0.660, decode_pressure_share=None),
        id="only B64 (T0 0.104, no chunk fits): no safe schedule, keeps",
    ),
    *OVERLOAD_CASES,
    *PRESSURE_CASES,
    *GATE_CASES,
    pytest.param(
        _keep(
            5000,
            (decode_node("d1", b=60, backlog=(300,) * 6),),
            Reason.KEEP_DECODE_OVERLOADED,
            "d1",
            0.660,
            max_pending_deflections=None,
        ),
        id="B60 + 6 deflections queued (pending none): T0 0.106 > tau, keeps before planning behind them",
    ),
    pytest.param(
        _keep(5000, (decode_node("d1", b=20, reported_at=-0.36),), Reason.KEEP_NO_ELIGIBLE_DECODE, "d1", 0.660),
        id="decode heartbeat 0.36 s old (stale): no eligible node, keeps on it anyway",
    ),
    pytest.param(
        _deflect(5000, (decode_node("d1", b=20, reported_at=-0.35),), "d1", 0.660, 0.280, (400, 400, 200)),
        id="decode heartbeat exactly 0.35 s old is still fresh: deflects",
    ),
    pytest.param(
        _keep(5000, (decode_node("d1", b=20, backlog=(300,)),), Reason.KEEP_NO_ELIGIBLE_DECODE, "d1", 0.660),
        id="backlog of one deflection under max_pending 1: no eligible node",
    ),
    # Q=1700: 0.187 + 0.110 = 0.297, bound 0.3861. Backlog 300 first: 0.060 + 0.030 = 0.090; then
    # B=21 (399-token chunks): 0.061 + 0.0399 = 0.1009 twice, 0.061 + 0.0202 = 0.0812 -> 0.373
    pytest.param(
        DecideCase(
            prefill=(prefill_node(queue=(1700,)),),
            decode=(decode_node("d1", b=20, backlog=(300,)),),
            route=Route.DEFLECT,
            reason=Reason.DEFLECT_WITHIN_MARGIN,
            decode_node="d1",
            prefill_node=None,
            ttft_pf=0.297,
            ttft_dec=0.373,
            chunks=(399, 399, 202),
            step_tokens=(420, 420, 223),
            config={"max_pending_deflections": None},
        ),
        id="backlog of one under max_pending None: deflects behind it, TTFT includes its 0.090",
    ),
    pytest.param(
        _keep(
            960,
            (decode_node("d1", b=20, backlog=(300,)),),
            Reason.KEEP_DECODE_SLOWER,
            "d1",
            0.2156,
            max_pending_deflections=None,
        ),
        id="backlog pushes the same node (0.373) past 1.3 x 0.2156: keeps",
    ),
    pytest.param(
        _keep(5000, (decode_node("d1", b=20, k=9500, capacity=10_000),), Reason.KEEP_NO_ELIGIBLE_DECODE, "d1", 0.660),
        id="500 free KV tokens for a 1000-token prompt: no eligible node",
    ),
    pytest.param(
        _deflect(5000, (decode_node("d1", b=20, k=9000, capacity=10_000),), "d1", 0.660, 0.280, (400, 400, 200)),
        id="exactly 1000 free KV tokens: deflects",
    ),
    pytest.param(
        _keep(
            5000,
            (decode_node("d1", b=20, k=8500, capacity=10_000, backlog=(600,)),),
            Reason.KEEP_NO_ELIGIBLE_DECODE,
            "d1",
            0.660,
            max_pending_deflections=None,
        ),
        id="backlog's KV counts: 10000 - 8500 - 600 = 900 free, no eligible node",
    ),
    # Eq. 1 on the prefill side: p1 3 short requests 0.3 x 0.110 + 0.110 = 0.143; p2 one long
    # request 2.0 x 0.110 + 0.110 = 0.330; p3 idle but chi_p 100: 10 x 0.020 = 0.200
    pytest.param(
        DecideCase(
            prefill=(
                prefill_node("p3", (), chunk=100),
                prefill_node("p2", (2000,)),
                prefill_node("p1", (100, 100, 100)),
            ),
            decode=B20,
            route=Route.KEEP,
            reason=Reason.KEEP_DECODE_SLOWER,
            decode_node="d1",
            prefill_node="p1",
            ttft_pf=0.143,
            ttft_dec=None,
        ),
        id="keep on the lowest Eq.1 prefill node (3 short requests beat 1 long and an idle small-chunk node)",
    ),
    pytest.param(
        DecideCase(
            prefill=(prefill_node("p2"), prefill_node("p1")),
            decode=B20,
            route=Route.KEEP,
            reason=Reason.KEEP_DECODE_SLOWER,
            decode_node="d1",
            prefill_node="p1",
            ttft_pf=0.110,
            ttft_dec=None,
        ),
        id="equal prefill nodes: the lower id keeps",
    ),
    pytest.param(
        DecideCase(
            prefill=(prefill_node("p1", reported_at=-1.0), prefill_node("p2", (2000,))),
            decode=(decode_node("d3", b=70),),
            route=Route.KEEP,
            reason=Reason.KEEP_DECODE_OVERLOADED,
            decode_node="d3",
            prefill_node="p2",
            ttft_pf=0.330,
            ttft_dec=None,
        ),
        id="stale idle prefill node skipped for a fresh busy one",
    ),
    pytest.param(
        DecideCase(
            prefill=(prefill_node("p2", (2000,), reported_at=-1.0), prefill_node("p1", reported_at=-1.0)),
            decode=(decode_node("d3", b=70),),
            route=Route.KEEP,
            reason=Reason.KEEP_DECODE_OVERLOADED,
            decode_node="d3",
            prefill_node="p1",
            ttft_pf=0.110,
            ttft_dec=None,
        ),
        id="all prefill nodes stale: falls back to all of them",
    ),
]


def test_decide_cases_cover_every_algorithm_1_reason() -> None:
    reasons = {p.values[0].reason for p in DECIDE_CASES}
    assert reasons == {
        Reason.DEFLECT_WITHIN_MARGIN,
        Reason.KEEP_DECODE_SLOWER,
        Reason.KEEP_DECODE_OVER_SLO,
        Reason.KEEP_NO_SAFE_SCHEDULE,
        Reason.KEEP_NO_ELIGIBLE_DECODE,
        Reason.KEEP_DECODE_OVERLOADED,
        Reason.KEEP_SLO_ROOM,
    }


@pytest.mark.parametrize("case", DECIDE_CASES)
def test_decide(case: DecideCase) -> None:
    cfg = dataclasses.replace(CFG, **case.config)  # type: ignore[arg-type]
    d = decide(case.prompt, view(case.prefill, case.decode), 0.0, FLAT, cfg)
    assert (d.route, d.reason, d.decode_node, d.prefill_node) == (
        case.route,
        case.reason,
        case.decode_node,
        case.prefill_node,
    )
    assert d.predicted_ttft_prefill_s == pytest.approx(case.ttft_pf)
    assert d.predicted_ttft_decode_s == pytest.approx(case.ttft_dec)
    assert d.chunk_sizes == case.chunks
    if case.step_tokens:
        assert tuple(s.step_tokens for s in d.schedule) == case.step_tokens
    assert d.prompt_tokens == case.prompt
    if d.route is Route.DEFLECT:
        assert sum(d.chunk_sizes) == case.prompt
        assert all(s.predicted_s <= cfg.step_budget_s for s in d.schedule)  # Eq. 5 on every step


# A step model with a 10% mean absolute error: predicted steps are held under tau / 1.20615 =
# 0.087054 (the P95 of normal errors: 1 + 1.6449 x sqrt(pi/2) x 0.1), on both lines.
MODEL_ERROR_CASES = [
    pytest.param(
        (5000, 20, 0.0, Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN, (400, 400, 200), 0.105),
        id="B20, exact model: 400-token chunks of 0.100 under tau",
    ),
    pytest.param(
        (5000, 20, 0.1, Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN, (200,) * 5, 0.087054),
        id="B20, 10% error: 200-token chunks of 0.080, budget 0.087 sent to the node",
    ),
    pytest.param(
        (10000, 48, 0.0, Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN, (72,) * 12 + (136,), 0.105),
        id="B48 (T0 0.088), exact model: 72-token chunks of 0.0952",
    ),
    pytest.param(
        (10000, 48, 0.1, Route.KEEP, Reason.KEEP_DECODE_OVERLOADED, (), 0.087054),
        id="B48 (T0 0.088), 10% error: over 0.087, decode overloaded, keeps (with the node's budget)",
    ),
]


@pytest.mark.parametrize("case", MODEL_ERROR_CASES)
def test_model_error_shrinks_both_step_lines(
    case: tuple[int, int, float, Route, Reason, tuple[int, ...], float | None],
) -> None:
    queue, b, error, route, reason, chunks, budget = case
    cfg = dataclasses.replace(CFG, model_error=error)
    d = decide(1000, view((prefill_node(queue=(queue,)),), (decode_node("d1", b=b),)), 0.0, FLAT, cfg)
    assert (d.route, d.reason, d.chunk_sizes) == (route, reason, chunks)
    assert d.step_budget_s == pytest.approx(budget, abs=1e-6)
    assert all(s.predicted_s <= cfg.step_budget_s for s in d.schedule)


def test_error_margin_is_the_p95_of_normal_errors() -> None:
    assert DeciderConfig().error_margin == 1.0
    # 1 + z(0.95) x sqrt(pi/2) x 0.1 = 1 + 1.644854 x 1.253314 x 0.1
    assert DeciderConfig(model_error=0.1).error_margin == pytest.approx(1.2061518, abs=1e-7)
    assert DeciderConfig(model_error=0.1, beta=1.5).decode_overload_s == pytest.approx(0.070 / 1.2061518)


@pytest.mark.parametrize("case", OVERLOAD_CASES)
def test_overload_guard_off_deflects(case: DecideCase) -> None:
    """Algorithm 1 as the paper writes it deflects in every overload case: what the rule changes."""
    cfg = dataclasses.replace(CFG, **case.config, decode_overload_guard=False)  # type: ignore[arg-type]
    d = decide(case.prompt, view(case.prefill, case.decode), 0.0, FLAT, cfg)
    assert (d.route, d.reason) == (Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN)


@pytest.mark.parametrize("case", [*OVERLOAD_CASES, *PRESSURE_CASES])
def test_overload_guard_off_deflects_under_pressure_too(case: DecideCase) -> None:
    """The decode pressure rule is part of the overload guard: off with it."""
    cfg = dataclasses.replace(CFG, **case.config, decode_overload_guard=False)  # type: ignore[arg-type]
    d = decide(case.prompt, view(case.prefill, case.decode), 0.0, FLAT, cfg)
    assert d.route is Route.DEFLECT


@pytest.mark.parametrize("case", [c for c in PRESSURE_CASES if c.values[0].route is Route.KEEP])
def test_pressure_off_deflects(case: DecideCase) -> None:
    """Without the pressure rule (decode_pressure_share None) the overload line alone lets every
    case the rule refuses deflect: what the rule changes."""
    cfg = dataclasses.replace(CFG, **{**case.config, "decode_pressure_share": None})  # type: ignore[arg-type]
    d = decide(case.prompt, view(case.prefill, case.decode), 0.0, FLAT, cfg)
    assert (d.route, d.reason) == (Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN)


@pytest.mark.parametrize("case", [c for c in GATE_CASES if c.values[0].reason is Reason.KEEP_SLO_ROOM])
def test_gate_off_is_eq7_alone(case: DecideCase) -> None:
    """Without the gate (deflect_gate_share None, the paper) Eq. 7 deflects every case the gate
    keeps: what the gate changes."""
    cfg = dataclasses.replace(CFG, **{**case.config, "deflect_gate_share": None})  # type: ignore[arg-type]
    d = decide(case.prompt, view(case.prefill, case.decode), 0.0, FLAT, cfg)
    assert (d.route, d.reason) == (Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN)


@pytest.mark.parametrize(
    ("share", "ttft_pf", "open_"),
    [
        pytest.param(0.25, 0.999, False, id="under 0.25 x 4 s: shut"),
        pytest.param(0.25, 1.0, True, id="at the line: open"),
        pytest.param(0.25, 4.5, True, id="missing the SLO: open"),
        pytest.param(1.0, 3.999, False, id="share 1, meeting the SLO: shut"),
        pytest.param(1.0, 4.0, True, id="share 1, at the SLO: open"),
        pytest.param(None, 0.0, True, id="no gate: open"),
    ],
)
def test_deflection_gate(share: float | None, ttft_pf: float, open_: bool) -> None:
    assert deflection_gate_open(DeciderConfig(deflect_gate_share=share, ttft_slo_s=4.0), ttft_pf) is open_


@pytest.mark.parametrize("share", [0.0, -0.1, 1.01, math.nan, math.inf])
def test_deflect_gate_share_out_of_range_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="deflect_gate_share"):
        DeciderConfig(deflect_gate_share=share)


@pytest.mark.parametrize("share", [0.0, -0.1, 1.01, math.nan])
def test_decode_pressure_share_out_of_range_is_refused(share: float) -> None:
    with pytest.raises(ConfigError, match="decode_pressure_share"):
        DeciderConfig(decode_pressure_share=share)


@pytest.mark.parametrize(("beta", "line"), [(0.9, 0.0945), (1.0, 0.105), (1.2, 0.105), (2.0, 0.105)])
def test_decode_overload_line_is_the_lower_of_tau_and_the_step_budget(beta: float, line: float) -> None:
    assert dataclasses.replace(CFG, beta=beta).decode_overload_s == pytest.approx(line)


# Keep-path decode node: the lowest T0(B + backlog count, K + backlog tokens), ties by id. With
# T0 = 0.040 + 0.001 B + 1e-6 K and an idle prefill node (0.110, bound 0.143) every decode path
# (>= 3 steps of >= 0.05 s) is too slow, so these all keep.
KEEP_DECODE_CASES = [
    # d1: 0.040 + 0.010 + 0.050 = 0.100; d2: 0.040 + 0.030 + 0.010 = 0.080
    pytest.param(
        (decode_node("d1", b=10, k=50_000), decode_node("d2", b=30, k=10_000)), "d2", id="lower T0 beats lower B"
    ),
    # d1: B 21, K 30000 -> 0.091; d2: 0.040 + 0.025 + 0.010 = 0.075 (d1 alone would be 0.060)
    pytest.param(
        (decode_node("d1", b=20, backlog=(30_000,)), decode_node("d2", b=25, k=10_000)),
        "d2",
        id="backlog counts into T0",
    ),
    pytest.param((decode_node("d2", b=20), decode_node("d1", b=20)), "d1", id="equal T0: lower id"),
    pytest.param(
        (decode_node("d1", b=0, reported_at=-1.0), decode_node("d2", b=30)), "d2", id="stale idle node skipped"
    ),
    pytest.param(
        (decode_node("d1", b=0, capacity=500), decode_node("d2", b=30)), "d2", id="node without room for the KV skipped"
    ),
    pytest.param(
        (decode_node("d1", b=0, capacity=500), decode_node("d2", b=30, capacity=500)),
        "d1",
        id="no node has room: least loaded of all fresh",
    ),
]


@pytest.mark.parametrize(("decode", "expected"), KEEP_DECODE_CASES)
def test_keep_path_decode_node(decode: tuple[DecodeNodeState, ...], expected: str) -> None:
    d = decide(1000, view((prefill_node(),), decode), 0.0, flat_models(decode_per_k=1e-6), CFG)
    assert d.route is Route.KEEP
    assert d.decode_node == expected


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        pytest.param((prefill_node(),), (), "no decode node", id="no-decode-nodes"),
        pytest.param((), (decode_node(),), "no prefill node", id="no-prefill-nodes"),
    ],
)
def test_decide_without_nodes_raises(
    prefill: tuple[PrefillNodeState, ...], decode: tuple[DecodeNodeState, ...], message: str
) -> None:
    with pytest.raises(NoHealthyNodeError, match=message):
        decide(1000, view(prefill, decode), 0.0, FLAT, CFG)


def test_without_a_prefill_pool_the_fastest_safe_decode_node_prefills() -> None:
    decode = (decode_node("d0", b=30), decode_node("d1", b=4))
    d = decide_without_prefill_pool(3000, view((), decode), 0.0, FLAT, CFG)
    assert (d.route, d.reason, d.decode_node) == (Route.DEFLECT, Reason.DEFLECT_NO_PREFILL_NODE, "d1")
    assert d.chunk_sizes and d.predicted_ttft_prefill_s is None and d.predicted_ttft_decode_s
    assert all(t <= CFG.step_budget_s + 1e-12 for t in d.predicted_step_s)


def test_without_a_prefill_pool_and_no_safe_schedule_the_request_is_refused() -> None:
    """The normal path's bounds hold in degraded mode too (tests/unit/test_decision_inputs.py)."""
    tight = dataclasses.replace(CFG, tbt_slo_s=0.001)  # every decode-only step is over tau already
    with pytest.raises(NoHealthyNodeError, match="over its overload line"):
        decide_without_prefill_pool(500, view((), (decode_node("d0"), decode_node("d1"))), 0.0, FLAT, tight)


def test_without_any_node_there_is_nothing_to_route_to() -> None:
    with pytest.raises(NoHealthyNodeError, match="no prefill or decode node"):
        decide_without_prefill_pool(100, view((), ()), 0.0, FLAT, CFG)


@pytest.mark.parametrize("prompt", [0, -5])
def test_decide_rejects_empty_prompt(prompt: int) -> None:
    with pytest.raises(InvalidRequestError, match="at least 1"):
        decide(prompt, view((prefill_node(),), (decode_node(),)), 0.0, FLAT, CFG)


def test_decision_is_immutable_and_its_schedule_sums_to_the_prompt() -> None:
    d = decide(1000, view((prefill_node(queue=(960,)),), B20), 0.0, FLAT, CFG)
    assert d.route is Route.DEFLECT
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.route = Route.KEEP  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.schedule[0].prefill_tokens = 1  # type: ignore[misc]
    assert isinstance(d.chunk_sizes, tuple)
    assert sum(d.chunk_sizes) == d.prompt_tokens == 1000
    # step by step: B=20 beside each chunk, cached tokens accumulate, Eq. 6 is the sum of the steps
    assert d.schedule == (
        ChunkStep(420, 400, 0, pytest.approx(0.100)),  # type: ignore[arg-type]
        ChunkStep(420, 400, 400, pytest.approx(0.100)),  # type: ignore[arg-type]
        ChunkStep(220, 200, 800, pytest.approx(0.080)),  # type: ignore[arg-type]
    )
    assert d.planned_decode_tokens == 20
    assert d.step_budget_s == pytest.approx(0.105)  # beta x tau goes with the schedule (node_step_guard)
    assert d.predicted_ttft_decode_s == pytest.approx(sum(s.predicted_s for s in d.schedule))


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"route": Route.DEFLECT, "prefill_node": None, "chunk_sizes": ()}, id="deflect-without-schedule"),
        pytest.param(
            {"route": Route.DEFLECT, "prefill_node": "p1", "chunk_sizes": (100,)},
            id="deflect-with-prefill-node",
        ),
        pytest.param(
            {"route": Route.DEFLECT, "prefill_node": None, "chunk_sizes": (99,)},
            id="deflect-schedule-short-of-prompt",
        ),
        pytest.param({"route": Route.KEEP, "prefill_node": None, "chunk_sizes": ()}, id="keep-without-prefill-node"),
        pytest.param(
            {"route": Route.KEEP, "prefill_node": "p1", "chunk_sizes": (100,)},
            id="keep-with-schedule",
        ),
        pytest.param(
            {"route": Route.DEFLECT, "prefill_node": None, "chunk_sizes": (60, 40), "predicted_step_s": (0.07,)},
            id="deflect-one-step-time-for-two-chunks",
        ),
    ],
)
def test_inconsistent_decision_rejected(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "reason": Reason.KEEP_POLICY,
        "decode_node": "d1",
        "predicted_ttft_prefill_s": 0.1,
        "predicted_ttft_decode_s": None,
        "prompt_tokens": 100,
    }
    with pytest.raises(ValueError):
        Decision(**base, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"alpha": 0.99}, id="alpha-below-1"),
        pytest.param({"alpha": math.nan}, id="alpha-nan"),
        pytest.param({"beta": 0.0}, id="beta-0"),
        pytest.param({"beta": 2.01}, id="beta-over-2"),
        pytest.param({"tbt_slo_s": 0.0}, id="tbt-slo-0"),
        pytest.param({"ttft_slo_s": -1.0}, id="ttft-slo-negative"),
        pytest.param({"chunk_candidates": ()}, id="no-candidates"),
        pytest.param({"chunk_candidates": (128, 256)}, id="candidates-increasing"),
        pytest.param({"chunk_candidates": (256, 256)}, id="candidates-repeated"),
        pytest.param({"chunk_candidates": (256, 0)}, id="candidate-0"),
        pytest.param({"stale_after_s": 0.0}, id="stale-after-0"),
        pytest.param({"max_pending_deflections": 0}, id="pending-0"),
        pytest.param({"model_error": -0.1}, id="model-error-negative"),
        pytest.param({"model_error": 1.0}, id="model-error-1"),
        pytest.param({"model_error": math.nan}, id="model-error-nan"),
    ],
)
def test_bad_decider_config_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        DeciderConfig(**kwargs)  # type: ignore[arg-type]


def test_default_config_is_the_papers_but_for_alpha_the_pending_limit_the_gate_and_the_chunks() -> None:
    cfg = DeciderConfig()
    assert (cfg.beta, cfg.tbt_slo_s, cfg.ttft_slo_s) == (1.0, 0.070, 4.0)
    # Four step sizes per octave from 2048 to 128; the paper's powers of two are
    # kairos:chunks=2048/1024/512/256/128.
    assert cfg.chunk_candidates[::4] == defaults.PAPER_CHUNK_CANDIDATES == (2048, 1024, 512, 256, 128)
    assert len(cfg.chunk_candidates) == 17
    # The paper's one deflection in flight per decode node is kairos:pending=1; by default a
    # deflection is scheduled behind every one in flight (defaults.MAX_PENDING_DEFLECTIONS).
    assert cfg.max_pending_deflections is None
    # The paper's alpha 1.3 and no deflection gate are kairos:alpha=1.3,gate=off.
    assert (cfg.alpha, cfg.deflect_gate_share) == (1.0, 0.25)
    assert cfg.step_budget_s == pytest.approx(0.070)


# ---------------------------------------------------------------------------------------------
# Step calibration: each node's lines are beta x tau / its reported calibration (flat models,
# tau = 0.105, B = 20: T0 = 0.060, a chunk of p prefill tokens adds 1e-4 p)
# ---------------------------------------------------------------------------------------------
def calibrated(node_id: str, b: int, calibration: float) -> DecodeNodeState:
    return dataclasses.replace(decode_node(node_id, b=b), step_calibration=calibration)


@pytest.mark.parametrize(
    ("calibration", "chunks", "budget"),
    [
        pytest.param(1.0, (400, 400, 200), 0.105, id="1.0: the paper's line, 400-token chunks of 0.100"),
        pytest.param(1.25, (200,) * 5, 0.084, id="1.25: under 0.084 only 200-token chunks (0.080) fit"),
        pytest.param(0.875, (400, 400, 200), 0.12, id="0.875: a fast node's line is over tau"),
    ],
)
def test_each_node_plans_to_its_own_calibrated_budget_and_sends_it(
    calibration: float, chunks: tuple[int, ...], budget: float
) -> None:
    d = decide(1000, view((prefill_node(queue=(5000,)),), (calibrated("d1", 20, calibration),)), 0.0, FLAT, CFG)
    assert (d.route, d.chunk_sizes) == (Route.DEFLECT, chunks)
    assert d.step_budget_s == pytest.approx(budget)
    assert all(s.predicted_s <= budget for s in d.schedule)


def test_a_calibration_of_one_is_the_uncalibrated_line_to_the_bit() -> None:
    for cfg in (CFG, dataclasses.replace(CFG, beta=0.9, model_error=0.07)):
        node = decode_node("d1", b=20)
        assert alg.node_step_budget_s(cfg, node) == cfg.step_budget_s
        assert alg.node_overload_s(cfg, node) == cfg.decode_overload_s


def test_calibration_composes_with_beta_and_model_error_and_can_be_turned_off() -> None:
    node = calibrated("d1", 20, 1.25)
    cfg = dataclasses.replace(CFG, beta=0.9, model_error=0.1)
    assert alg.node_step_budget_s(cfg, node) == pytest.approx(0.9 * 0.105 / 1.2061518 / 1.25)
    off = dataclasses.replace(cfg, calibrate=False)
    assert alg.node_step_budget_s(off, node) == off.step_budget_s


def test_the_overload_line_is_calibrated_too() -> None:
    # B = 40: T0 = 0.080, under tau = 0.105 but over 0.105 / 1.4 = 0.075.
    v = view((prefill_node(queue=(5000,)),), (calibrated("d1", 40, 1.4),))
    assert decide(1000, v, 0.0, FLAT, CFG).reason is Reason.KEEP_DECODE_OVERLOADED
    off = decide(1000, v, 0.0, FLAT, dataclasses.replace(CFG, calibrate=False))
    assert off.route is Route.DEFLECT


def test_nodes_in_the_same_state_with_different_calibrations_are_planned_apart() -> None:
    """The search memoises a schedule per node state: the calibration is part of that state."""
    slow, fast = calibrated("d1", 20, 1.25), calibrated("d2", 20, 1.0)
    d = decide(1000, view((prefill_node(queue=(5000,)),), (slow, fast)), 0.0, FLAT, CFG)
    assert (d.decode_node, d.chunk_sizes, d.step_budget_s) == ("d2", (400, 400, 200), 0.105)
    assert d.predicted_ttft_decode_s == pytest.approx(0.280)


# The keep path's TTFT beyond Eq. 1: W_link + T_xfer + W_adm + T_join (keep_handoff_s)
# ---------------------------------------------------------------------------------------------
# Flat models: T0(B) = 0.040 + 0.001 B (no K term), T_xfer(n) = 0.001 + n x 1000 B / 1e6 B/s.
# A 1000-token prompt: T_xfer = 1.001; T_join = T0(b + 1) + T0(b) / 2 (T0(1) alone when b = 0).
# M = 72: a node short of D KV tokens frees them in D x 72 x T0(b) / k.
def _dn(b: int = 0, k: int = 0, capacity: int = 10_000_000, **fields: object) -> DecodeNodeState:
    return dataclasses.replace(decode_node("d1", b=b, k=k, capacity=capacity), **fields)  # type: ignore[arg-type]


KEEP_HANDOFF_CASES = [
    pytest.param(_dn(), 0.0, 1.001 + 0.041, id="idle node: transfer + one step of B=1"),
    pytest.param(_dn(b=10), 0.0, 1.001 + 0.051 + 0.025, id="B10: transfer + T0(11) + half of T0(10)"),
    # one pull of 2000 ahead: the link clears it 2.001 s from now, 0.5 s after this prefill ends
    pytest.param(
        _dn(pending_kv_pull_tokens=(2000,)), 0.5, 1.501 + 1.001 + 0.042 + 0.0205, id="a pull ahead: link wait 1.501"
    ),
    pytest.param(
        _dn(pending_kv_pull_tokens=(499,)), 0.5, 0.0 + 1.001 + 0.042 + 0.0205, id="link clears as the prefill ends: 0"
    ),
    pytest.param(
        _dn(pending_kv_pull_tokens=(999,)), 0.5, 0.5 + 1.001 + 0.042 + 0.0205, id="link clears 0.5 s after: 0.5"
    ),
    # two incoming keeps (1500 tokens) are not on the link yet (their pulls will show it); they
    # join the batch ahead of this one: T0(3) + T0(2) / 2
    pytest.param(
        _dn(incoming_keeps=2, incoming_keep_tokens=1500),
        0.2,
        1.001 + 0.043 + 0.021,
        id="incoming keeps join the batch ahead, not the link",
    ),
    # ... and promise their KV: 1500 + 1000 into 2000 is 500 short: 500 x 72 x 0.042 / 1500 = 1.008
    pytest.param(
        _dn(capacity=2_000, incoming_keeps=2, incoming_keep_tokens=1500),
        0.0,
        1.008 + 1.001 + 0.043 + 0.021,
        id="incoming keeps hold KV room",
    ),
    # B10 K9000: room for exactly the prompt: no wait; 500 short: 500 x 72 x 0.050 / 9000 = 0.2
    pytest.param(_dn(b=10, k=9000, capacity=10_000), 0.0, 1.001 + 0.076, id="KV fits exactly: no admission wait"),
    pytest.param(_dn(b=10, k=9000, capacity=9_500), 0.0, 0.2 + 1.001 + 0.076, id="500 tokens short: waits 0.2"),
    pytest.param(
        _dn(b=10, k=9000, capacity=9_500), 0.15, 0.05 + 1.001 + 0.076, id="short, but 0.15 s of prefill frees most"
    ),
    pytest.param(_dn(b=10, k=9000, capacity=9_500), 0.25, 1.001 + 0.076, id="short, but freed before the prefill ends"),
    # the backlog's 2000 tokens hold KV and join the batch: b 1, k 2000, 500 short:
    # 500 x 72 x 0.041 / 2000 = 0.738
    pytest.param(
        _dn(capacity=2_500, prefill_backlog_tokens=(2000,)), 0.0, 0.738 + 1.001 + 0.042 + 0.0205, id="backlog holds KV"
    ),
    pytest.param(_dn(capacity=500), 0.0, 1.001 + 0.041, id="nothing held, nothing to free: no wait"),
]


@pytest.mark.parametrize(("node", "prefill_s", "expected"), KEEP_HANDOFF_CASES)
def test_keep_handoff(node: DecodeNodeState, prefill_s: float, expected: float) -> None:
    cfg = DeciderConfig()
    assert alg.keep_handoff_s(FLAT, cfg, node, 1000, prefill_s) == pytest.approx(expected, abs=1e-9)
    assert alg.keep_ttft_s(FLAT, cfg, prefill_s, node, 1000) == pytest.approx(prefill_s + expected, abs=1e-9)
    assert alg.keep_ttft_s(FLAT, dataclasses.replace(cfg, keep_estimate="eq1"), prefill_s, node, 1000) == prefill_s


def test_admission_wait_scales_with_the_mean_output() -> None:
    node = _dn(b=10, k=9000, capacity=9_500)
    cfg = DeciderConfig(mean_output_tokens=36)
    assert alg.keep_handoff_s(FLAT, cfg, node, 1000, 0.0) == pytest.approx(0.1 + 1.001 + 0.076)


# Eq. 7 against the full keep estimate. A 100 MB/s link: T_xfer(1000) = 0.011; on B20 the
# hand-off is 0.011 + T0(21) + T0(20) / 2 = 0.011 + 0.061 + 0.030 = 0.102, and the B20 deflection,
# built alike, starts after half the running step too: 0.030 + 0.280 = 0.310. The prefill end is
# the packed queue's (packed_prefill_s): Q + 1000 tokens in steps of 1000, a full one of 0.110
# and one of Q, 0.010 + 1e-4 Q, less half the Q-token step running at the heartbeat: 0.115 +
# 5e-5 Q. Deflect when 1.3 x (that + 0.102) >= 0.310: 0.115 + 5e-5 Q >= 0.136462, Q >= 430.
FAST_LINK = flat_models(bandwidth_bytes_per_s=1e8)


@pytest.mark.parametrize(
    ("q", "models", "route", "reason", "ttft_pf"),
    [
        pytest.param(430, FAST_LINK, Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN, 0.1365 + 0.102, id="Q430: deflects"),
        pytest.param(429, FAST_LINK, Route.KEEP, Reason.KEEP_DECODE_SLOWER, 0.13645 + 0.102, id="Q429: keeps"),
        # the 1 MB/s link: a second of transfer; 1.3 x (0.1625 + 1.092) >= 0.310, where Eq. 1
        # alone keeps ("0.280 just outside 1.3 x 0.2145" above)
        pytest.param(950, FLAT, Route.DEFLECT, Reason.DEFLECT_WITHIN_MARGIN, 0.1625 + 1.092, id="slow link deflects"),
    ],
)
def test_eq7_compares_with_the_full_keep_estimate(
    q: int, models: object, route: Route, reason: Reason, ttft_pf: float
) -> None:
    # Eq. 7's two routes: the split, between them, is tested on its own (test_split.py)
    cfg = dataclasses.replace(CFG, keep_estimate="full", split="off")
    d = decide(1000, view((prefill_node(queue=(q,)),), B20), 0.0, models, cfg)  # type: ignore[arg-type]
    assert (d.route, d.reason) == (route, reason)
    assert d.predicted_ttft_prefill_s == pytest.approx(ttft_pf, abs=1e-9)
    if route is Route.KEEP:
        assert d.predicted_prefill_end_s == pytest.approx(0.115 + 5e-5 * q)
        eq1 = dataclasses.replace(CFG, split="off")
        assert decide(1000, view((prefill_node(queue=(q,)),), B20), 0.0, models, eq1).route is Route.KEEP  # type: ignore[arg-type]
    else:
        assert d.predicted_ttft_decode_s == pytest.approx(0.030 + 0.280)


def test_keep_estimate_is_checked() -> None:
    with pytest.raises(ConfigError, match="keep_estimate"):
        DeciderConfig(keep_estimate="eq2")
    with pytest.raises(ConfigError, match="mean_output_tokens"):
        DeciderConfig(mean_output_tokens=0.5)


def test_the_pressure_line_is_not_calibrated() -> None:
    """The step error's margin is in the calibrated overload line and budget; the pressure rule
    compares with 0.85 tau however slow the node's steps run against the model. B = 20 + 14
    incoming keeps, the request joined: T0 0.075, over 0.85 x 0.105 / 1.25 = 0.0714 but under
    0.85 x 0.105 = 0.08925 and under the calibrated overload line 0.105 / 1.25 = 0.084."""
    node = dataclasses.replace(_incoming(decode_node("d1", b=20), 14), step_calibration=1.25)
    d = decide(1000, view((prefill_node(queue=(5000,)),), (node,)), 0.0, FLAT, CFG)
    assert d.route is Route.DEFLECT and d.step_budget_s == pytest.approx(0.084)
