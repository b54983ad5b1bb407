"""A lower bound on a node's deflection TTFT, from what its state alone determines.

What a decision derives from one decode node's state (:class:`NodeFacts`, kept on the state):
its load and lines, the time to run its backlog, and the greedy's prompt-independent path on it,
from which ``ttft_lower_bound_s`` bounds any prompt's schedule and ``plan_on_path`` reads a
schedule without running the greedy from the start. The eligibility scan reads the same facts."""

from __future__ import annotations

import bisect
import math
from collections.abc import Generator

from kairos.core.algorithm.config import DeciderConfig, node_overload_s, node_step_budget_s
from kairos.core.algorithm.decode_load import decode_load_s
from kairos.core.algorithm.schedule import (
    INFEASIBLE,
    TOO_SLOW,
    Plan,
    Run,
    StepTable,
    backlog_end,
    greedy_steps,
    plan_on_decode_node,
    safe_steps,
    start_shift_s,
    step_table,
)
from kairos.core.latency import LatencyModels
from kairos.core.state import DecodeNodeState

# Relative slack on every comparison of a bound with a computed TTFT: the bound and the
# schedule's time are sums of the same non-negative terms in different orders, whose rounding
# differs by ~1e-14 of their size.
BOUND_SLACK = 1e-9


# A run of the greedy on a node while more than its largest chunk remains: (cached tokens at its
# start, prefill tokens per step, steps or None when unbounded, first step's time, time added per
# step, time at its start, candidate index).
PathRun = tuple[int, int, int | None, float, float, float, int]


def _greedy_path(table: StepTable, step_budget_s: float, start_s: float) -> Generator[PathRun, None, float]:
    """The greedy's runs (``greedy_steps``') on one (B, K) while more than the largest chunk
    remains, one at a time, returning the time at their end. There every candidate is smaller
    than what remains, so the choice at each step depends on the cached tokens only, never on
    the prompt: every prompt's schedule takes exactly these steps, with the same floats (the
    same tests and sums from the same ``start_s``), until its last ``largest`` tokens. Ends where
    no candidate is safe any more (there the schedule of a longer prompt is infeasible). Needs a
    monotone profile (``mixed_monotone``: the candidate index only grows). A generator: a
    decision reads the path only as far as its prompt's tail (``NodeFacts.extend``)."""
    full, base, slope = table[6:]
    cached, t, idx = 0, start_s, 0
    while True:
        while idx < len(full) and full[idx] > 0 and base[idx] + slope[idx] * cached > step_budget_s:
            idx += 1
        if idx == len(full) or full[idx] <= 0:
            return t
        p = full[idx]
        first = base[idx] + slope[idx] * cached
        inc = slope[idx] * p
        n = safe_steps(first, inc, step_budget_s) if inc > 0 else None
        yield cached, p, n, first, inc, t, idx
        if n is None:
            return t
        t += n * first + inc * n * (n - 1) / 2
        cached += p * n


class NodeFacts:
    """What a decision derives from one decode node's state alone, for one (models, config):
    kept on the state (``DecodeNodeState.derived``), so a heartbeat or a dispatch, which
    replaces the state, is what recomputes it, not every decision."""

    __slots__ = (
        "b",
        "bound_step_s",
        "budget_s",
        "config",
        "decode_step_s",
        "end_s",
        "ends",
        "load_s",
        "models",
        "overload_s",
        "runs",
        "table",
        "unread",
        "wait_s",
    )
    wait_s: float  # the backlog's schedules, run first (inf: one of them is infeasible)
    b: int  # decodes beside the request's own steps (the backlog's requests decode by then)
    table: StepTable  # Eq. 4 for the request's own steps
    end_s: float  # time at the end of the path (once ``unread`` is None: the whole path is read)
    bound_step_s: float  # the longest step ttft_lower_bound_s lets a schedule's last step take

    def __init__(self, models: LatencyModels, config: DeciderConfig, node: DecodeNodeState) -> None:
        self.models, self.config = models, config
        self.load_s = decode_load_s(models, node)
        # The node's decode-only step T0(B, K): its step phase's period (start_shift_s), once per state.
        self.decode_step_s = models.decode_step_s(node.decode_tokens, node.kv_tokens)
        self.budget_s = node_step_budget_s(config, node)  # Eq. 5's line on this node
        self.overload_s = node_overload_s(config, node)
        self.runs: list[PathRun] | None = None  # the rest is built on the first bound asked for
        self.ends: list[float] = []  # cached tokens at each run's end (inf: unbounded)
        self.unread: Generator[PathRun, None, float] | None = None  # the path's runs not read yet

    def build_path(self, node: DecodeNodeState) -> None:
        """The time to run the node's backlog, then, for the request's own steps beside it:
        Eq. 4's coefficients, the largest chunk's prefill tokens and the start of the greedy's
        path (its runs are read as far as a prompt needs them: ``extend``)."""
        models, config, budget = self.models, self.config, self.budget_s
        b, k, end = backlog_end(models, config, node)
        t = math.inf if isinstance(end, str) else end
        self.wait_s, self.b = t, b
        self.table = step_table(models, b, k, config.chunk_candidates)
        self.unread = _greedy_path(self.table, budget, t)
        self.bound_step_s = budget * (1 + BOUND_SLACK)
        self.runs = []  # last: a set ``runs`` says the rest is there

    def extend(self, target: int) -> None:
        """Read the path's runs until one ends at ``target`` cached tokens or later (at least
        one run), or the path ends (then ``end_s`` is its end)."""
        runs, ends, rest = self.runs, self.ends, self.unread
        assert runs is not None
        while rest is not None and (not ends or ends[-1] < target):
            try:
                run = next(rest)
            except StopIteration as end:
                self.end_s, self.unread = end.value, None
                return
            c0, p, n = run[:3]
            runs.append(run)
            ends.append(math.inf if n is None else c0 + p * n)


def node_facts(models: LatencyModels, config: DeciderConfig, node: DecodeNodeState) -> NodeFacts:
    facts = node.derived
    if (
        type(facts) is not NodeFacts
        or facts.models is not models
        or not (facts.config is config or facts.config == config)
    ):
        facts = NodeFacts(models, config, node)
        object.__setattr__(node, "derived", facts)
    return facts


def _tail_start(facts: NodeFacts, node: DecodeNodeState, prompt_tokens: int) -> tuple[int, float, int, int] | None:
    """Where the greedy's schedule of this prompt leaves the node's path: (cached tokens, time
    then, the run it leaves in, steps taken of that run; the start when the prompt is no longer
    than the largest chunk), or None when the path ends first (no schedule: infeasible or too slow)."""
    runs = facts.runs
    if runs is None:
        facts.build_path(node)
        runs = facts.runs
        assert runs is not None
    full = facts.table[6]
    if full[0] <= 0:  # no chunk carries a prefill token beside B decodes
        return None
    target = prompt_tokens - full[0]
    ends = facts.ends
    if facts.unread is not None and (not ends or ends[-1] < target):
        facts.extend(target)  # the run the tail starts in, and the first one (the bound's chunk)
    if target <= 0:
        return 0, facts.wait_s, 0, 0
    r = bisect.bisect_left(facts.ends, target)  # the run in which the schedule reaches its tail
    if r == len(runs):
        return None
    c0, p, _, first, inc, t0, _ = runs[r]
    j = -((c0 - target) // p)  # the greedy's n_tail
    return c0 + j * p, t0 + (j * first + inc * j * (j - 1) / 2), r, j


def plan_on_path(
    models: LatencyModels,
    config: DeciderConfig,
    node: DecodeNodeState,
    prompt_tokens: int,
    give_up_after_s: float,
    cached_tokens: int = 0,
    now: float | None = None,
) -> Plan | str:
    """``plan_on_decode_node``, to the bit, on a monotone profile: for a node without a backlog
    the greedy's steps along the node's path are read from it, and the greedy runs on from where
    the prompt's tail starts. (The path starts from nothing cached: a cached prefix plans directly.)
    The path runs from the heartbeat; the TTFT from ``now`` is shifted after (``start_shift_s``),
    as ``plan_on_decode_node``'s is."""
    if node.prefill_backlog_tokens or cached_tokens:
        return plan_on_decode_node(models, config, node, prompt_tokens, give_up_after_s, cached_tokens, now)
    facts = node_facts(models, config, node)
    tail = _tail_start(facts, node, prompt_tokens)
    shift = start_shift_s(models, config, node, facts.wait_s, now, facts.decode_step_s)
    give_up_after_s += shift  # on the path's clock, from the heartbeat
    if tail is None:  # the greedy follows the whole path (read to its end), then finds no safe candidate
        return TOO_SLOW if facts.runs and facts.end_s > give_up_after_s else INFEASIBLE
    cached, t, r, j = tail
    runs: list[Run] = []
    idx = 0
    if j:
        if t > give_up_after_s:  # the greedy's earlier run ends are no later
            return TOO_SLOW
        path = facts.runs
        assert path is not None  # built by _tail_start
        for _, p, n, first, inc, _, _ in path[:r]:
            assert n is not None  # only a path's last run is unbounded
            runs.append((p, n, first, inc))
        _, p, _, first, inc, _, idx = path[r]
        runs.append((p, j, first, inc))
    done = greedy_steps(
        facts.table, facts.b, True, facts.budget_s, give_up_after_s, prompt_tokens - cached, cached, idx, t, runs
    )
    if isinstance(done, str):
        return done
    return Plan(decode_tokens=facts.b, runs=tuple(done[0]), ttft_s=done[1] - shift, step_budget_s=facts.budget_s)


def ttft_lower_bound_s(
    models: LatencyModels, config: DeciderConfig, node: DecodeNodeState, prompt_tokens: int, now: float | None = None
) -> float:
    """A TTFT no schedule ``plan_on_decode_node`` finds on ``node`` for this prompt beats
    (``math.inf``: it finds none), valid when ``models.mixed_nonnegative``.

    The request's schedule takes the node's prompt-independent greedy path (``_greedy_path``)
    until at most ``largest`` tokens remain, at cached c*; that time is exact. Each step after
    costs at least ``a0 + a_c c* + p (b0 + b1 c*)`` for its p tokens, only the last one carries
    more than the run's chunk at c* (the greedy's candidate index only grows), and the last one
    carries no more than a TBT-safe step at c* can. From ``now``, shifted as the schedule's TTFT is.
    """
    return lower_bound_from_facts(node_facts(models, config, node), node, prompt_tokens, now)


def lower_bound_from_facts(
    facts: NodeFacts, node: DecodeNodeState, prompt_tokens: int, now: float | None = None
) -> float:
    """``ttft_lower_bound_s`` from the node's facts (the search has them at hand)."""
    tail = _tail_start(facts, node, prompt_tokens)
    if tail is None:
        return math.inf
    cached, t, r, _ = tail
    runs = facts.runs
    chunk = runs[r][1] if runs else 0
    a0, a_c, b0, b1 = facts.table[:4]
    rest = prompt_tokens - cached
    head = a0 + a_c * cached
    per_token = b0 + b1 * cached
    steps = 1
    if per_token > 0 and chunk > 0:
        last_max = (facts.bound_step_s - head) / per_token
        if rest > last_max:  # integers from here: the count must not round up
            steps += -((math.floor(max(0.0, last_max)) - rest) // chunk)
    bound = t + steps * head + rest * per_token
    if now is None or node.running_step_elapsed_s is None:
        return bound
    return bound - start_shift_s(facts.models, facts.config, node, facts.wait_s, now, facts.decode_step_s)
