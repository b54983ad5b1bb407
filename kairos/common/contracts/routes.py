"""Route names: the paths a routed request takes, as the dispatcher's ``x-kairos-route`` header,
the sidecar, the TTFT feedback stream, metric labels and reports spell them."""

from __future__ import annotations

from enum import StrEnum


class Route(StrEnum):
    """A routing decision's path (kairos.core.decision.Decision.route)."""

    KEEP = "keep"  # prefill on a prefill node, KV transfer, decode on a decode node
    DEFLECT = "deflect"  # chunked prefill in place on a decode node, no transfer
    # The prompt's first k tokens on a prefill node, their KV pulled by the decode node, which
    # prefills the rest as a chunk schedule beside its decodes (x-kairos-split-tokens: k).
    SPLIT = "split"


# A batch (several prompts in one /v1/completions body): the sidecar sends each prompt back
# through the gateway, where each gets a decision of its own, and merges the answers as vLLM.
# The x-kairos-route value of the batch itself, never a decision's route.
ROUTE_FANOUT = "fanout"
