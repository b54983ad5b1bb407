"""Metrics the node agents export: the sidecar's paths, and step-budget overruns."""

from __future__ import annotations

from collections.abc import Iterable

# ---------------------------------------------------------------------------------------------
# Metrics the node agents export: the sidecar's path, and step-budget overruns (a node's steps that
# broke the budget a deflected chunk carried), counted by the emulated node (its /metrics) and the
# vLLM plugin (its state server's /metrics) alike.
# ---------------------------------------------------------------------------------------------
SIDECAR_METRICS_PATH = "/kairos/metrics"  # a decode sidecar's Prometheus metrics (kairos_sidecar_*)
# The node agent's probe of its decode sidecar, every heartbeat: the sidecar's own event loop
# answers 204, touching nothing else (its metrics page costs ~1 ms to render, ten times a second).
SIDECAR_PROBE_PATH = "/kairos/probe"
STEP_BUDGET_OVERRUNS_METRIC = "kairos_node_step_budget_overruns"  # a counter: exported with _total
STEP_BUDGET_OVERRUNS_HELP = (
    "Steps with running decodes that took longer than the step budget of a deflected chunk they "
    "carried (the decodes' TBT went over what the dispatcher planned for)"
)


def overran_step_budget(
    decode_tokens: int, budgets_s: Iterable[float | None], duration_s: float, step_calibration: float = 1.0
) -> bool:
    """Whether one step counts as an overrun: decodes ran in it (the budget protects their TBT;
    with none running it does not apply) and it lasted longer than the tightest budget of its
    chunks times the node's step calibration (a budget is predicted time, beta x tau / the
    calibration the dispatcher planned with: a step of the planned length is allowed to run that
    much slower than its prediction)."""
    budgets = [b for b in budgets_s if b is not None]
    return decode_tokens > 0 and bool(budgets) and duration_s > min(budgets) * step_calibration
