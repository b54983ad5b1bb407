"""Algorithm 1 of the Kairos paper: the per-request deflection decision (Eqs. 1-7).

Pure and clock-free: ``decide`` reads a :class:`ClusterView` and the time ``now`` it is given,
and returns a :class:`Decision`. The ext_proc server, the simulator and the benchmarks all call
this same function.

One module per step of the decision, each importing only those above it:

- ``config``: :class:`DeciderConfig` and the lines it draws on a node (step budget, overload);
- ``prefill_estimate``: the prefill node's TTFT (§4.2: Eqs. 1-3, and the packed full estimate);
- ``decode_load``: a decode node's committed batch and its decode-only step time;
- ``keep_estimate``: the keep path's TTFT (Eq. 1 and the hand-off to its decode node);
- ``schedule``: the decode node's feasibility checker, the greedy TBT-safe schedule (§4.3);
- ``bounds``: a node's derived facts and the lower bound on its deflection TTFT;
- ``eligibility``: which nodes may take a deflection, and the keep path's nodes;
- ``search``: the deflection search over the eligible nodes (§4.4);
- ``split``: the split route, the prompt's first k tokens on a prefill node and the rest on a decode node;
- ``decide``: Algorithm 1 itself, and its degraded mode without a prefill pool.

This package exports the decision's public API below (what the policies, the dispatcher, the
simulator and the benchmarks use); the names its modules share only among themselves are
imported from the module that defines them.
"""

from kairos.core.algorithm.bounds import ttft_lower_bound_s
from kairos.core.algorithm.config import (
    DEFAULT_CHUNK_CANDIDATES,
    KEEP_ESTIMATES,
    SPLIT_CHOICES,
    DeciderConfig,
    keep_step_budget_s,
    node_overload_s,
    node_step_budget_s,
    with_request_slo,
)
from kairos.core.algorithm.decide import decide, decide_without_prefill_pool, validate_prompt
from kairos.core.algorithm.decode_load import committed_batch, decode_load_after_s, decode_load_s
from kairos.core.algorithm.eligibility import (
    best_prefill_node,
    cached_prefix,
    can_take_deflection,
    decode_pressure_refusal,
    deflection_gate_open,
    is_fresh,
    pick_keep_decode_node,
)
from kairos.core.algorithm.keep_estimate import keep_handoff_s, keep_ttft_s
from kairos.core.algorithm.prefill_estimate import (
    keep_prefill_s,
    packed_prefill_s,
    prefill_exec_s,
    prefill_queue_wait_s,
    prefill_ttft_s,
)
from kairos.core.algorithm.schedule import (
    backlog_end,
    expand_runs,
    greedy_schedule,
    plan_on_decode_node,
    planning_batch,
)
from kairos.core.algorithm.split import SplitPlan, best_split, split_points

__all__ = [
    "DEFAULT_CHUNK_CANDIDATES",
    "KEEP_ESTIMATES",
    "SPLIT_CHOICES",
    "DeciderConfig",
    "SplitPlan",
    "backlog_end",
    "best_prefill_node",
    "best_split",
    "cached_prefix",
    "can_take_deflection",
    "committed_batch",
    "decide",
    "decide_without_prefill_pool",
    "decode_load_after_s",
    "decode_load_s",
    "decode_pressure_refusal",
    "deflection_gate_open",
    "expand_runs",
    "greedy_schedule",
    "is_fresh",
    "keep_handoff_s",
    "keep_prefill_s",
    "keep_step_budget_s",
    "keep_ttft_s",
    "node_overload_s",
    "node_step_budget_s",
    "packed_prefill_s",
    "pick_keep_decode_node",
    "plan_on_decode_node",
    "planning_batch",
    "prefill_exec_s",
    "prefill_queue_wait_s",
    "prefill_ttft_s",
    "split_points",
    "ttft_lower_bound_s",
    "validate_prompt",
    "with_request_slo",
]
