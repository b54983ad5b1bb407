"""The node's Prometheus metrics in vLLM's names, buckets and labels (:class:`Metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kairos.common import contracts as c

# vllm:prompt_tokens_by_source's sources (vLLM's PromptTokenStats.ALL_SOURCES).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
# fmt: off
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
# fmt: on


@dataclass(slots=True)
class Metrics:
    registry: CollectorRegistry
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    ttft: Histogram
    itl: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    prompt_by_source: Counter
    step_budget_overruns: Counter  # Kairos's own, beside vLLM's: the engine's count, synced at scrape
    request_success: Counter
    labels: dict[str, str] = field(default_factory=dict)
    overruns_exported: int = 0

    @classmethod
    def create(cls, model: str) -> Metrics:
        reg = CollectorRegistry(auto_describe=True)
        names = ("model_name", "engine")
        m = cls(
            registry=reg,
            running=Gauge("vllm:num_requests_running", "Requests in model execution batches.", names, registry=reg),
            waiting=Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", names, registry=reg),
            kv_usage=Gauge(
                "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", names, registry=reg
            ),
            ttft=Histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                names,
                buckets=_TTFT_BUCKETS,
                registry=reg,
            ),
            itl=Histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                names,
                buckets=_ITL_BUCKETS,
                registry=reg,
            ),
            prompt_tokens=Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=reg),
            generation_tokens=Counter(
                "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=reg
            ),
            prompt_by_source=Counter(
                "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", (*names, "source"), registry=reg
            ),
            step_budget_overruns=Counter(c.STEP_BUDGET_OVERRUNS_METRIC, c.STEP_BUDGET_OVERRUNS_HELP, registry=reg),
            # vLLM counts a request here when the engine finishes it; every emulated request runs
            # to max_tokens (ignore_eos), so its reason is always "length".
            request_success=Counter(
                "vllm:request_success",
                "Count of successfully processed requests.",
                (*names, "finished_reason"),
                registry=reg,
            ),
        )
        m.labels = {"model_name": model, "engine": "0"}
        # Every source exists from the start, so a scrape shows zeros rather than nothing.
        for source in PROMPT_SOURCES:
            m.prompt_by_source.labels(**m.labels, source=source)
        m.request_success.labels(**m.labels, finished_reason="length")
        for metric in (m.running, m.waiting, m.kv_usage, m.ttft, m.itl, m.prompt_tokens, m.generation_tokens):
            metric.labels(**m.labels)
        return m

    def add_prompt(self, computed: int, local_cache_hit: int = 0, external_kv_transfer: int = 0) -> None:
        """One prompt's tokens by where their KV came from (vLLM's PromptTokenStats)."""
        self.prompt_tokens.labels(**self.labels).inc(computed + local_cache_hit + external_kv_transfer)
        for source, tokens in zip(PROMPT_SOURCES, (computed, local_cache_hit, external_kv_transfer), strict=True):
            self.prompt_by_source.labels(**self.labels, source=source).inc(tokens)
