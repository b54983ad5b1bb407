"""Each completion judged against its own SLOs at its stream's end: the class it is counted in, the SLOs
it is judged by, and what its stream showed (:class:`Timing`), as ``kairos replay`` judges it."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kairos.common import contracts as c
from kairos.common.errors import InvalidRequestError
from kairos.core.slo import DEFAULT_SLO, RequestSLO, SloClass, classify, meets_slo, request_slo
from kairos.nodeagent.sidecar.metrics import SLO_MET, SLO_MISSED, SLO_UNOBSERVED

# An SSE event that carries vLLM's error object ({"error": {...}}) rather than a token.
ERROR_EVENT = re.compile(rb'data: ?\{\s*"error"')


# Every choice event of a completion or chat stream has this key, once per choice; a usage-only
# event and [DONE] have none. A JSON string's quotes are escaped, so no token text matches it.
CHOICE_KEY = b'"finish_reason"'
ROLE_KEY = b'"role"'  # a chat stream's role event (one per choice), sent with the first token
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')  # a usage event's


@dataclass
class Timing:
    """TTFT parts of one request, for the metrics and the per-request DEBUG line."""

    path: str
    started: float = field(default_factory=time.perf_counter)
    hop1_s: float | None = None
    ttfb_s: float | None = None
    ttft_s: float | None = None
    unobserved: str | None = None  # why ttft_s is None (one of UNOBSERVED), once known
    predicted_s: float | None = None  # the dispatcher's TTFT prediction for the path it chose
    node: str = ""  # the decode node the dispatcher named (the feedback sample's node)
    # Its SLO judgement: the class it is counted in (None: not judged here, a batch's fan-out),
    # the SLOs it is judged by, and what its stream showed (set at the stream's end).
    slo_class: str | None = None
    slo: RequestSLO = DEFAULT_SLO
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each token chunk after the first
    token_events: int = 0
    stream_tail: bytes = b""  # the stream's last two chunks (its usage and [DONE], or an error event)
    stream_end: str | None = None  # "complete" or "failed" (None: not streamed to its end)


def judged_by(headers: Mapping[str, str], classes: Sequence[SloClass]) -> tuple[str, RequestSLO]:
    """The class a request is counted in and the SLOs it is judged by: its own (the client's
    ``x-slo-*`` headers), else those the dispatcher decided it by, else the cluster's defaults,
    as ``kairos replay`` judges it (with an SLO-blind policy the dispatcher decides by the
    cluster's, but a request is still judged by its own). The class: the dispatcher's where it
    names one of ``classes``, else the class those SLOs fall in."""
    try:
        decided = request_slo(headers.get(c.H_DECIDED_TTFT_SLO_MS), headers.get(c.H_DECIDED_TPOT_SLO_MS))
    except InvalidRequestError:
        decided = DEFAULT_SLO
    try:
        slo = request_slo(headers.get(c.H_SLO_TTFT_MS), headers.get(c.H_SLO_TPOT_MS), 0, decided.ttft_s, decided.tpot_s)
    except InvalidRequestError:  # the gateway answers such a request 400; one sent here directly is judged as decided
        slo = decided
    named = headers.get(c.H_SLO_CLASS)
    if named is not None and any(k.name == named for k in classes):
        return named, slo
    return classify(slo.ttft_s, slo.tpot_s, classes), slo


def _gaps_over(first_at: float, arrivals: Sequence[float], tpot_s: float) -> int:
    """How many of a stream's gaps (between its token chunks' arrivals, from its first) exceed ``tpot_s``."""
    over, previous = 0, first_at
    for at in arrivals:
        over += at - previous > tpot_s
        previous = at
    return over


def _output_tokens(tail: bytes, token_events: int) -> int:
    """A stream's output tokens: its usage's completion_tokens where it has one (the client asked
    for it, or continuous usage stats), else its token events (one token each on vLLM, unless a
    step emits several: speculative decoding)."""
    found = _COMPLETION_TOKENS.findall(tail)
    return int(found[-1]) if found else token_events


def slo_outcome(timing: Timing) -> tuple[str, int]:
    """(outcome, output tokens) of a judged request at its end."""
    if timing.ttft_s is None or timing.stream_end is None:
        return SLO_UNOBSERVED, 0  # no first token, not streamed, or the client left
    if timing.stream_end != "complete" or ERROR_EVENT.search(timing.stream_tail):
        return SLO_MISSED, 0  # it broke off or ended in an error after its first token
    first_at = timing.started + timing.ttft_s
    gaps = timing.arrivals
    met = meets_slo(timing.ttft_s, timing.slo.ttft_s, _gaps_over(first_at, gaps, timing.slo.tpot_s), len(gaps))
    return (SLO_MET, _output_tokens(timing.stream_tail, timing.token_events)) if met else (SLO_MISSED, 0)
