"""What one sidecar app holds (its settings, metrics, clients and feedback publisher), under the app's keys."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from aiohttp import web

from kairos.core.slo import DEFAULT_CLASSES, SloClass
from kairos.nodeagent.http1 import Http1Client
from kairos.nodeagent.sidecar.config import SidecarConfig
from kairos.nodeagent.sidecar.feedback import TtftFeedbackPublisher
from kairos.nodeagent.sidecar.metrics import SidecarMetrics


@dataclass
class State:
    config: SidecarConfig
    allowlist: Callable[[], Collection[str]] | None
    metrics: SidecarMetrics
    # The lean HTTP/1.1 clients, created on app startup: hop 1's to the prefill nodes (one JSON
    # reply per request), and the local vLLM's (hop 2, pass-through, health), replies streamed.
    hop1_client: Http1Client | None = None
    local_client: Http1Client | None = None
    logged_unrouted: bool = False
    logged_split_refused: bool = False  # the local vLLM refused a split's decode hop (logged once)
    # Until then (time.monotonic()), splits are served as keeps without trying: the local vLLM
    # refused the last one (app.SPLIT_REFUSED_RETRY_S).
    splits_refused_until: float = 0.0
    feedback: TtftFeedbackPublisher | None = None  # only with a redis_url
    classes: tuple[SloClass, ...] = DEFAULT_CLASSES  # the SLO classes requests are counted by

    @property
    def local(self) -> Http1Client:
        assert self.local_client is not None, "the client is created on app startup"
        return self.local_client


STATE: web.AppKey[State] = web.AppKey("kairos_sidecar_state", State)
METRICS: web.AppKey[SidecarMetrics] = web.AppKey("kairos_sidecar_metrics", SidecarMetrics)


def count(state: State, hop: str, kind: str) -> None:
    state.metrics.hop_errors.labels(hop, kind).inc()
