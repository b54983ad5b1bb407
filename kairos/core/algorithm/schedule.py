"""The decode-node feasibility checker (§4.3): the greedy TBT-safe chunk schedule of Eqs. 4-6 in
closed form, the node's backlog of deflected prefills run first, and a request's plan on one
decode node (``plan_on_decode_node``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kairos.core.algorithm.config import DeciderConfig, node_step_budget_s
from kairos.core.latency import LatencyModels
from kairos.core.state import DecodeNodeState

# A run of equal steps: (prefill tokens per step, steps, first step's time, time added per step).
Run = tuple[int, int, float, float]


def expand_runs(runs: list[Run] | tuple[Run, ...]) -> tuple[list[int], list[float]]:
    """Per-step prefill tokens and predicted times of a schedule kept as runs."""
    sizes: list[int] = []
    times: list[float] = []
    for p, n, first, inc in runs:
        sizes.extend([p] * n)
        times.extend([first + j * inc for j in range(n)])
    return sizes, times


@dataclass(frozen=True, slots=True)
class Plan:
    decode_tokens: int  # B the request's own steps run beside (after any backlog finished)
    runs: tuple[Run, ...]  # the request's schedule
    ttft_s: float  # includes the wait behind the node's backlog, if any
    step_budget_s: float  # the node's step budget the schedule was planned to (node_step_budget_s)


INFEASIBLE = "infeasible"  # no TBT-safe chunk exists at some step
TOO_SLOW = "too_slow"  # abandoned: already slower than the bound that could make it win


# Eq. 4 on one (B, K), for the schedule search: (a0, a_c, b0, b1, k_coef, knee) as in
# mixed_step_coefficients, then per candidate its full chunk's prefill tokens, base and slope.
StepTable = tuple[float, float, float, float, float, float, list[int], list[float], list[float]]


def step_table(models: LatencyModels, decode_tokens: int, kv_tokens: int, candidates: tuple[int, ...]) -> StepTable:
    """Eq. 4 on one (B, K): its coefficients (``mixed_step_coefficients``), and per candidate
    chi the prefill tokens of a full chunk and its step time ``base + slope * cached``."""
    a0, a_c, b0, b1, k_coef, knee = models.mixed_step_coefficients(decode_tokens, kv_tokens)
    full = [x - decode_tokens for x in candidates]
    base = [a0 + p * b0 + (k_coef * (x - knee) if x > knee else 0.0) for x, p in zip(candidates, full, strict=True)]
    slope = [a_c + p * b1 for p in full]
    return a0, a_c, b0, b1, k_coef, knee, full, base, slope


def safe_steps(first: float, inc: float, step_budget_s: float) -> int:
    """How many steps of a run (``first``, growing by ``inc`` > 0) stay within the budget."""
    n = int((step_budget_s - first) / inc) + 1
    while n > 1 and first + (n - 1) * inc > step_budget_s:  # float rounding
        n -= 1
    return n


def greedy_schedule(
    models: LatencyModels,
    prompt_tokens: int,
    decode_tokens: int,
    kv_tokens: int,
    candidates: tuple[int, ...],
    step_budget_s: float,
    give_up_after_s: float = math.inf,
    start_s: float = 0.0,
    cached_tokens: int = 0,
) -> tuple[list[Run], float] | str:
    """Eq. 5 and 6: at each step take the largest candidate chi whose step stays within
    ``step_budget_s``; a step of chi tokens carries chi - B prefill tokens (§3.2), and the KV
    the request has built so far adds to the node's K. With a prefix of ``cached_tokens`` in the
    node's cache, the steps cover the rest, each over that prefix too.

    The final step carries only the tokens left, and is costed with them. Returns the schedule
    as runs of equal steps and the finishing time (``start_s`` + the step times), or
    ``INFEASIBLE`` / ``TOO_SLOW``.

    This runs for every decode node on every request, so Eq. 4 is unrolled: with B and K
    fixed, a step of chi tokens over c cached ones costs ``base[chi] + slope[chi] * c``, and
    the greedy keeps one chi for as many steps as that stays within budget, a count and a time
    sum that are closed-form. The result is the step-by-step greedy's, in O(candidates).
    """
    table = step_table(models, decode_tokens, kv_tokens, candidates)
    return greedy_steps(
        table,
        decode_tokens,
        models.mixed_monotone,
        step_budget_s,
        give_up_after_s,
        prompt_tokens - cached_tokens,
        cached_tokens,
        0,
        start_s,
        [],
    )


def greedy_steps(
    table: StepTable,
    b: int,
    monotone: bool,
    step_budget_s: float,
    give_up_after_s: float,
    remaining: int,
    cached: int,
    idx: int,
    t: float,
    runs: list[Run],
) -> tuple[list[Run], float] | str:
    """``greedy_schedule``'s loop, from any point of a schedule: ``remaining`` tokens left over
    ``cached`` ones, ``idx`` the candidate reached (those above it were unsafe as full chunks;
    they only get costlier as c grows), ``t`` the time so far, ``runs`` the runs so far (extended)."""
    a0, a_c, b0, b1, k_coef, knee, full, base, slope = table
    n_cand = len(full)
    largest = full[0]
    while remaining > 0:
        if not monotone:
            idx = 0
        # Finish in one step if the largest candidate can hold the rest and that step is safe.
        if remaining <= largest:
            x = b + remaining
            s = a0 + a_c * cached + remaining * (b0 + b1 * cached) + (k_coef * (x - knee) if x > knee else 0.0)
            if s <= step_budget_s:
                t += s
                if t > give_up_after_s:
                    return TOO_SLOW
                runs.append((remaining, 1, s, 0.0))
                return runs, t
        while idx < n_cand:
            f = full[idx]
            if f <= 0:  # this and every smaller candidate carry no prefill token
                idx = n_cand
                break
            if f < remaining and base[idx] + slope[idx] * cached <= step_budget_s:
                break
            idx += 1
        if idx >= n_cand:
            return INFEASIBLE
        p = full[idx]
        first = base[idx] + slope[idx] * cached
        inc = slope[idx] * p
        # Steps of p tokens: while each stays within budget, while a full chunk is still less
        # than what remains, and (once the rest fits the largest candidate) one at a time so the
        # finishing check above runs.
        if not monotone:
            n = 1
        elif remaining <= largest:
            # In the tail, walk the run just until the rest could finish in one safe step.
            n, c_j, r_j = 1, cached + p, remaining - p
            while r_j > p and first + n * inc <= step_budget_s:
                x = b + r_j
                fin = a0 + a_c * c_j + r_j * (b0 + b1 * c_j) + (k_coef * (x - knee) if x > knee else 0.0)
                if fin <= step_budget_s:
                    break
                n, c_j, r_j = n + 1, c_j + p, r_j - p
        else:
            n = (remaining - 1) // p
            n_tail = (remaining - largest + p - 1) // p
            if n_tail < n:
                n = n_tail
            if inc > 0:
                n_safe = safe_steps(first, inc, step_budget_s)
                if n_safe < n:
                    n = n_safe
            if n < 1:
                n = 1
        t += n * first + inc * n * (n - 1) / 2
        if t > give_up_after_s:
            return TOO_SLOW
        runs.append((p, n, first, inc))
        cached += p * n
        remaining -= p * n
    return runs, t


def planning_batch(config: DeciderConfig, node: DecodeNodeState) -> tuple[int, int]:
    """The decodes and KV tokens a deflection on ``node`` is planned beside, before its backlog:
    the heartbeat's, with the KV pulls it reports joined (``DeciderConfig.plan_with_pulls``)."""
    pulls = node.pending_kv_pull_tokens
    if config.plan_with_pulls and pulls:
        return node.decode_tokens + len(pulls), node.kv_tokens + sum(pulls)
    return node.decode_tokens, node.kv_tokens


def _backlog_schedule(
    models: LatencyModels,
    node: DecodeNodeState,
    i: int,
    remaining: int,
    b: int,
    k: int,
    candidates: tuple[int, ...],
    step_budget_s: float,
    give_up_after_s: float,
    start_s: float,
) -> tuple[list[Run], float] | str:
    """The schedule of the node's backlog entry ``i`` (``remaining`` tokens left), run first:
    over its computed prefix, which its chunks attend to. K holds that prefix already, and the
    greedy adds a request's cached tokens to K, so it plans on K without it."""
    computed = node.backlog_computed(i)
    return greedy_schedule(
        models,
        computed + remaining,
        b,
        max(0, k - computed),
        candidates,
        step_budget_s,
        give_up_after_s,
        start_s,
        computed,
    )


def decode_step_left_s(models: LatencyModels, node: DecodeNodeState, elapsed: float | None) -> float:
    """What is left of the decode-only step ``node`` is running, ``elapsed`` after one of them
    began: its decodes' steps run back to back, each T0(B, K) of its batch as reported (half a
    step where ``elapsed`` is None: the phase unknown)."""
    step = models.decode_step_s(node.decode_tokens, node.kv_tokens)
    if elapsed is None or step <= 0.0:
        return 0.5 * step
    return step - elapsed % step


def backlog_end(
    models: LatencyModels, config: DeciderConfig, node: DecodeNodeState, give_up_after_s: float = math.inf
) -> tuple[int, int, float | str]:
    """Where a new request's own steps start on ``node``: the decodes and KV tokens beside them
    (the planning batch, with the node's backlog decoding by then), and when, from its heartbeat
    (``start_shift_s`` takes it to now); or, for the time, why the backlog has no schedule
    (``INFEASIBLE``, or ``TOO_SLOW`` past ``give_up_after_s``).

    The engine takes a request in at a step boundary: after the step it is running (with
    ``keep_estimate="eq1"``, whose Eq. 1 has no join on the keep path either, both start at once,
    as in the paper). The node says how long that step had run at its heartbeat
    (``running_step_elapsed_s``); one that does not is taken to be half through it, on average.
    If the heartbeat showed a backlog, that step is the backlog head's chunk, which its schedule
    counts whole, so the backlog ends that much earlier (at most the head's whole schedule). Else
    it is the node's decodes' (none on an idle node: it starts at once), one of a train of equal
    steps (``decode_step_left_s``), and a backlog sent since the heartbeat (the view's overlay,
    ``overlay_backlog``) starts after it. Then each backlog prefill runs in turn (only with the
    pending-deflection limit lifted), over its computed prefix."""
    b, k = planning_batch(config, node)
    backlog = node.prefill_backlog_tokens
    eq1 = config.keep_estimate == "eq1"
    elapsed = node.running_step_elapsed_s
    running_chunk = not eq1 and len(backlog) > node.overlay_backlog  # the reported head's
    t: float | str = 0.0
    if not (eq1 or running_chunk or not node.decode_tokens):
        t = decode_step_left_s(models, node, elapsed)
    if not backlog:
        return b, k, t
    cands, budget = config.chunk_candidates, node_step_budget_s(config, node)
    for i, tokens in enumerate(backlog):
        if not isinstance(t, str):
            done = _backlog_schedule(
                models, node, i, tokens, b, k, cands, budget, math.inf if i == 0 else give_up_after_s, t
            )
            if isinstance(done, str):
                t = done
            else:
                t = done[1]
                if i == 0 and running_chunk:  # less what the node has run of the head's chunk
                    t -= 0.5 * done[0][0][2] if elapsed is None else min(elapsed, t)
                if t > give_up_after_s:
                    t = TOO_SLOW
        b, k = b + 1, k + tokens  # the backlog request decodes on the node from then on
    return b, k, t


def start_shift_s(
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    start_s: float,
    now: float | None,
    decode_step_s: float | None = None,
) -> float:
    """How much sooner than ``start_s`` (``backlog_end``'s, from the heartbeat) a new request's
    own steps start on ``node``, seen from ``now``: the node has run for the heartbeat's age
    since. Running a backlog the heartbeat showed, that much of it, as far as it lasts; else its
    train of decode steps, whose phase at ``now`` the step in flight then says (the shift is
    negative where a step began since). 0.0 without ``now``, for an idle node, for a node that
    does not say how long its step had run (planned from its heartbeat, as before the field), and
    with ``keep_estimate="eq1"`` (the paper's: from the heartbeat, at once). ``decode_step_s``:
    the node's decode-only step T0(B, K) where the caller holds it (``NodeFacts``), else computed."""
    elapsed = node.running_step_elapsed_s
    if now is None or elapsed is None or config.keep_estimate == "eq1":
        return 0.0
    age = now - node.reported_at
    if age <= 0.0:
        return 0.0
    if len(node.prefill_backlog_tokens) > node.overlay_backlog:
        return age if age < start_s else start_s
    if not node.decode_tokens:
        return 0.0
    step = models.decode_step_s(node.decode_tokens, node.kv_tokens) if decode_step_s is None else decode_step_s
    return (elapsed + age) % step - elapsed % step if step > 0.0 else 0.0


def plan_on_decode_node(
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    give_up_after_s: float,
    cached_tokens: int = 0,
    now: float | None = None,
) -> Plan | str:
    """Schedule the request on one decode node from its next step (``backlog_end``), behind any
    deflected prefills already there, over the prompt's tokens the node does not have cached;
    its TTFT from ``now`` (``start_shift_s``; None: from the heartbeat). The schedule is planned
    from the heartbeat and shifted after, so that ``plan_on_path``'s sums are the same floats."""
    age = 0.0 if now is None else max(0.0, now - node.reported_at)  # no shift of a backlog exceeds it
    b, k, t = backlog_end(models, config, node, give_up_after_s + age)
    if isinstance(t, str):
        return t
    shift = start_shift_s(models, config, node, t, now)
    cands, budget = config.chunk_candidates, node_step_budget_s(config, node)
    done = greedy_schedule(models, prompt_tokens, b, k, cands, budget, give_up_after_s + shift, t, cached_tokens)
    if isinstance(done, str):
        return done
    return Plan(decode_tokens=b, runs=tuple(done[0]), ttft_s=done[1] - shift, step_budget_s=budget)
