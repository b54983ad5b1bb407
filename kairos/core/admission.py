"""Admission control: how many requests the cluster may hold at once, from what the view knows.

The dispatcher sees a request only until it routes it, so what is in flight is read off the
cluster view (heartbeats, plus this dispatcher's own dispatches since them, which the view's
overlay adds at once): requests queued or prefilling on the prefill nodes, decodes running on the
decode nodes, deflected prefills in their backlogs, KV transfers they are pulling. The budget is
what the decode nodes can run (``seats_per_decode_node`` each, vLLM's ``max_num_seqs``) plus a
queue as deep again (``queue_per_seat``): past it, a new request would only wait behind a whole
batch's turnover, and the KV the admitted ones will hold (their prompts) must fit the decode
nodes' KV with the same allowance. Over either, a request waits at the dispatcher (bounded in
count and time, :class:`AdmissionLimits`) or is refused with a 429 and ``Retry-After``.

Pure: the I/O part (waiters, metrics) is ``kairos.extproc.admission``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kairos.common import defaults
from kairos.common.config import setting
from kairos.common.errors import ConfigError
from kairos.core.state import ClusterView


class Verdict(enum.Enum):
    ADMIT = "admit"
    OVER_REQUESTS = "requests"  # in-flight requests at the budget
    OVER_KV = "kv"  # the KV the in-flight requests will hold at the budget


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The budget's knobs (``kairos.common.defaults``, which says why each value)."""

    seats_per_decode_node: int = setting(
        defaults.MAX_RUNNING_REQUESTS, help="requests in flight the budget allows per decode node"
    )
    queue_per_seat: float = setting(
        defaults.ADMISSION_QUEUE_PER_SEAT, help="the cluster's queue past its seats, per seat, in the budget"
    )
    max_wait_s: float = setting(defaults.ADMISSION_MAX_WAIT_S, help="longest wait for a seat before a 429")
    waiting_per_seat: float = setting(
        defaults.ADMISSION_WAITING_PER_SEAT, help="requests waiting at the dispatcher for a seat, per decode seat"
    )

    def __post_init__(self) -> None:
        if self.seats_per_decode_node < 1:
            raise ConfigError(f"seats_per_decode_node must be >= 1, got {self.seats_per_decode_node}")
        if not 0 <= self.queue_per_seat < math.inf:
            raise ConfigError(f"queue_per_seat must be >= 0, got {self.queue_per_seat}")
        if not 0 <= self.max_wait_s < math.inf:
            raise ConfigError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if not 0 <= self.waiting_per_seat < math.inf:
            raise ConfigError(f"waiting_per_seat must be >= 0, got {self.waiting_per_seat}")

    @property
    def retry_after_s(self) -> int:
        """Retry-After for a refused request (whole seconds, at least 1): a waiter that got no
        seat in max_wait_s would likely get one in about as long again."""
        return max(1, math.ceil(self.max_wait_s))


def in_flight(view: ClusterView) -> int:
    """Requests the cluster holds, as the view counts them: each is in exactly one of these
    (a keep request in its prefill node's queue, then in its decode node's KV pulls, then its
    batch; a deflected one in its decode node's backlog, then its batch)."""
    queued = sum(p.queue_length for p in view.prefill)
    return queued + sum(
        d.decode_tokens + len(d.prefill_backlog_tokens) + len(d.pending_kv_pull_tokens) for d in view.decode
    )


def request_budget(view: ClusterView, limits: AdmissionLimits) -> int:
    """Requests the cluster may hold at once: every decode node's seats, and a queue as deep."""
    return math.floor(len(view.decode) * limits.seats_per_decode_node * (1 + limits.queue_per_seat))


def kv_committed(view: ClusterView) -> int:
    """KV tokens the in-flight requests hold or will hold on the decode nodes: what they hold,
    what is promised there (backlogs, pulls, incoming keeps) and the prompts still queued for
    prefill, each of which lands on a decode node once prefilled."""
    held = sum(d.kv_capacity_tokens - d.free_kv_tokens for d in view.decode)
    return held + sum(p.outstanding_tokens for p in view.prefill)


def kv_budget(view: ClusterView, limits: AdmissionLimits) -> int:
    return math.floor(sum(d.kv_capacity_tokens for d in view.decode) * (1 + limits.queue_per_seat))


def admission(view: ClusterView, prompt_tokens: int, limits: AdmissionLimits, admitted_unseen: int = 0) -> Verdict:
    """Whether one more request of ``prompt_tokens`` fits the budget now. ``admitted_unseen``:
    requests admitted but not yet in the view (being decided), which count as in flight. A view
    with no decode node admits: routing answers that request itself (a 503, or the no-prefill
    policy's plan), and no budget can be read off an empty cluster."""
    if not view.decode:
        return Verdict.ADMIT
    if in_flight(view) + admitted_unseen >= request_budget(view, limits):
        return Verdict.OVER_REQUESTS
    # Over the KV budget only once something is in flight: a lone prompt longer than the budget
    # is the context limit's to refuse, not this.
    committed = kv_committed(view)
    if committed and committed + prompt_tokens > kv_budget(view, limits):
        return Verdict.OVER_KV
    return Verdict.ADMIT


def max_waiting(view: ClusterView, limits: AdmissionLimits) -> int:
    """Requests that may wait at the dispatcher for a seat: past these, one's turn would come
    only after more turnover than ``max_wait_s`` is worth, and it is refused at once."""
    return math.floor(len(view.decode) * limits.seats_per_decode_node * limits.waiting_per_seat)
