"""The sidecar's Prometheus metrics (:class:`SidecarMetrics`) and their label values: the paths a request
is counted on, why a request has no TTFT sample, and the outcomes of its SLO judgement."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from kairos.common.contracts.routes import Route
from kairos.core.slo import DEFAULT_CLASSES, SloClass

PATH_LOCAL = "local"  # metrics label of requests served without a routing decision
PATHS = (*Route, PATH_LOCAL)
# Why a completion request has no TTFT sample (kairos_sidecar_ttft_unobserved_total's reasons).
NOT_STREAMED = "not_streamed"  # one JSON body after the last token: no first token to see
UNOBSERVED_ERROR = "error"  # an error status, a failed hop, or an error event first in the stream
ABORTED = "aborted"  # the client left before the first token
UNOBSERVED = (NOT_STREAMED, UNOBSERVED_ERROR, ABORTED)


# Why a split was served as a keep instead (kairos_sidecar_split_degraded_total's reasons).
SPLIT_PROMPT_MISMATCH = "prompt_mismatch"  # the local vLLM's prompt count is not the dispatcher's
SPLIT_TOKENIZE_FAILED = "tokenize_failed"  # the local vLLM's /tokenize refused, failed or timed out
# no one text or token-id prompt (a batch, embeddings), or one vLLM truncates (truncate_prompt_tokens)
SPLIT_UNSUPPORTED_PROMPT = "unsupported_prompt"
# the local vLLM refused the split's decode hop (or an earlier one's, in the last minute): its KV
# connector is not Kairos's split connector
SPLIT_NO_CONNECTOR = "no_split_connector"
SPLIT_DEGRADED = (SPLIT_PROMPT_MISMATCH, SPLIT_TOKENIZE_FAILED, SPLIT_UNSUPPORTED_PROMPT, SPLIT_NO_CONNECTOR)
HOP1_PATHS = (Route.KEEP, Route.SPLIT)  # the routes with a prefill hop


# A completion's judgement against its SLOs (kairos_sidecar_slo_requests_total's outcomes).
SLO_MET = "met"
SLO_MISSED = "missed"
SLO_UNOBSERVED = "unobserved"  # not streamed, an error before the first token, the client left
SLO_OUTCOMES = (SLO_MET, SLO_MISSED, SLO_UNOBSERVED)


# TTFT-scale buckets (seconds) around the 4 s TTFT SLO; hop 1 and TTFB share them.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)


class SidecarMetrics:
    """Prometheus metrics of one sidecar app, in their own registry (served on /kairos/metrics)."""

    def __init__(self, classes: Sequence[SloClass] = DEFAULT_CLASSES) -> None:
        self.registry = CollectorRegistry()
        self.hop1_seconds = Histogram(
            "kairos_sidecar_hop1_seconds",
            "Hop 1 duration: the prefill node's queueing and execution (of a split's first k tokens on the "
            "split path), as seen from the sidecar",
            ["path"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.ttfb_seconds = Histogram(
            "kairos_sidecar_ttfb_seconds",
            "Local vLLM hop sent to its first token (keep: KV transfer + decode queue); streamed responses only",
            ["path"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.ttft_seconds = Histogram(
            "kairos_sidecar_ttft_seconds",
            "Request arrival to its first token relayed (a stream's first event): the TTFT the sidecar "
            "accounts for; kairos_sidecar_ttft_unobserved_total counts the requests without one",
            ["path"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        # The live check of the latency models (the paper's section 7 concern): observed TTFT here
        # over the dispatcher's prediction for the path it chose; drifting away from 1 means
        # the profile needs re-fitting.
        self.ttft_vs_predicted = Histogram(
            "kairos_sidecar_ttft_observed_over_predicted",
            "Observed TTFT at the sidecar (streamed responses) divided by the dispatcher's predicted TTFT",
            ["path"],
            buckets=(0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0),
            registry=self.registry,
        )
        self.ttft_unobserved = Counter(
            "kairos_sidecar_ttft_unobserved",
            "Completion requests without a TTFT sample, by reason: not_streamed (one JSON body, sent after "
            "the last token: the first token is not visible here), error (an error status or event instead "
            "of a first token), aborted (the client left before it)",
            ["path", "reason"],
            registry=self.registry,
        )
        self.hop_errors = Counter(
            "kairos_sidecar_hop_errors",
            "Failed hops; hop 1 = prefill node, hop 2 = local vLLM (every path)",
            ["hop", "kind"],
            registry=self.registry,
        )
        self.local_prefills = Counter(
            "kairos_sidecar_local_prefills",
            "Keep- and split-path requests prefilled on the local vLLM because hop 1 failed (prefill node "
            "down, reset, 5xx or too slow)",
            registry=self.registry,
        )
        self.split_degraded = Counter(
            "kairos_sidecar_split_degraded",
            "Split-route requests served as a keep instead (the whole prompt through hop 1), by reason: "
            "prompt_mismatch (the local vLLM counts the prompt's tokens otherwise than the dispatcher), "
            "tokenize_failed (the local vLLM's /tokenize refused, failed or timed out), unsupported_prompt "
            "(no one text or token-id prompt, or one that vLLM truncates), no_split_connector (the local vLLM refused "
            "its decode hop, or an earlier split's in the last minute: it does not load Kairos's split connector)",
            ["reason"],
            registry=self.registry,
        )
        self.ttft_feedback = Counter(
            "kairos_sidecar_ttft_feedback",
            "TTFT samples for the dispatchers' feedback stream: sent (XADD done), error (XADD failed), "
            "dropped (queue full, or Redis failed less than a second ago)",
            ["outcome"],
            registry=self.registry,
        )
        # Series exist from the start, so rates work before the first request; each request's are
        # looked up here once, not per request (labels() takes a lock and hashes its labels).
        self.ttfb = {path: self.ttfb_seconds.labels(path) for path in PATHS}
        self.ttft = {path: self.ttft_seconds.labels(path) for path in PATHS}
        self.hop1 = {path: self.hop1_seconds.labels(path) for path in HOP1_PATHS}
        self.ttft_ratio = {path: self.ttft_vs_predicted.labels(path) for path in Route}  # every route predicts
        for reason in SPLIT_DEGRADED:
            self.split_degraded.labels(reason)
        self.unobserved = {
            (path, reason): self.ttft_unobserved.labels(path, reason) for path in PATHS for reason in UNOBSERVED
        }
        for outcome in ("sent", "error", "dropped"):
            self.ttft_feedback.labels(outcome)
        # Per SLO class, one series per configured class only (bounded: a request's class is
        # one of them, never a client's value), each created here.
        slo_requests = Counter(
            "kairos_sidecar_slo_requests",
            "Completion requests judged against their own SLOs (TTFT within its TTFT SLO, at most 5% of its "
            "stream's inter-token gaps over its TPOT SLO), by SLO class: met, missed (a stream that broke off "
            "or ended in an error event included), unobserved (not streamed, an error before the first token, "
            "the client left: nothing to judge)",
            ["class", "outcome"],
            registry=self.registry,
        )
        goodput = Counter(
            "kairos_sidecar_slo_goodput_tokens",
            "Output tokens of the completion requests that met their own SLOs, by SLO class (a stream's usage "
            "completion_tokens where it has one, else its token events)",
            ["class"],
            registry=self.registry,
        )
        names = [k.name for k in classes]
        self.slo_requests = {(n, o): slo_requests.labels(n, o) for n in names for o in SLO_OUTCOMES}
        self.slo_goodput_tokens = {n: goodput.labels(n) for n in names}
