"""The dispatcher's live check of its TTFT predictions, from the decode sidecars' measurements.

The dispatcher never sees responses (Envoy skips response processing on purpose: it would cost an
ext_proc round trip per response). The sidecars do: after a streamed request's first token a
sidecar given a Redis URL XADDs (request id, path, node, predicted ms, observed ms) to the capped stream
:data:`~kairos.common.contracts.REDIS_TTFT_FEEDBACK_STREAM`. The cluster view's poller
(:class:`kairos.extproc.cluster.RedisClusterView`) XREADs the new entries and hands them to
:class:`TtftFeedback`, which exports per path (keep, deflect):

- ``kairos_dispatcher_ttft_observed_over_predicted{path}``: a histogram of observed / predicted;
- ``kairos_dispatcher_ttft_prediction_mape{path}``: mean |predicted - observed| / observed over
  the last ``window`` samples (the same definition as the simulator's ``ttft_prediction_mape``).

A MAPE that drifts up means the latency profile no longer matches the cluster: re-profile, and
the dispatcher picks the new file up without a restart (:mod:`kairos.extproc.profile_watch`).

Only first-token times count: a non-streamed request has no sample (its first token is not
visible outside the node; :mod:`kairos.nodeagent.sidecar` counts those requests), and an entry
that does not say it timed a first token (``measured``) is refused like any malformed one: older
sidecars also sent non-streamed responses' first byte, which comes after the whole generation.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from kairos.common.contracts import (
    REDIS_TTFT_FEEDBACK_STREAM,
    TTFT_FEEDBACK_FIRST_TOKEN,
    TTFT_FEEDBACK_MAX_ID_CHARS,
    TTFT_FEEDBACK_MAX_MS,
    TTFT_FEEDBACK_MAX_RATIO,
    TtftFeedbackField,
)
from kairos.common.redis_client import REDIS_ERRORS, Outage, describe
from kairos.extproc.metrics import FEEDBACK_PATHS, DispatcherMetrics

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 200  # samples per path in the rolling MAPE
FEEDBACK_BATCH = 1000  # stream entries per XREAD: 20,000 samples/s at 50 ms polls

# One XREAD entry as redis-py returns it: (id, {field: value}), bytes unless decode_responses.
StreamEntry = tuple[bytes | str, Mapping[bytes | str, bytes | str]]


class MalformedFeedback(ValueError):
    """A stream entry that does not follow :class:`~kairos.common.contracts.TtftFeedbackField`."""


@dataclass(frozen=True, slots=True)
class TtftSample:
    request_id: str
    path: str  # "keep" or "deflect"
    node: str
    predicted_s: float
    observed_s: float

    @property
    def ratio(self) -> float:
        return self.observed_s / self.predicted_s

    @property
    def abs_pct_error(self) -> float:
        return abs(self.predicted_s - self.observed_s) / self.observed_s


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def parse_entry(fields: Mapping[bytes | str, bytes | str], decode_nodes: Collection[str] | None = None) -> TtftSample:
    """One stream entry's fields as a sample; raises :class:`MalformedFeedback` for an entry that
    breaks the contract or its bounds, or (``decode_nodes`` given) names no decode node the
    dispatcher knows. Anyone who may XADD can write junk: it must never reach the MAPE."""
    f = TtftFeedbackField
    if not isinstance(fields, Mapping):
        raise MalformedFeedback(f"expected a field map, got {type(fields).__name__}")
    data = {_text(k): _text(v) for k, v in fields.items()}
    missing = [name for name in f.ALL if name not in data]
    if missing:
        hint = " (a sidecar older than the first-token contract: upgrade it)" if missing == [f.MEASURED] else ""
        raise MalformedFeedback(f"missing fields {missing}{hint}")
    if data[f.MEASURED] != TTFT_FEEDBACK_FIRST_TOKEN:
        raise MalformedFeedback(f"{f.MEASURED} must be {TTFT_FEEDBACK_FIRST_TOKEN!r}, got {data[f.MEASURED][:40]!r}")
    path = data[f.PATH]
    if path not in FEEDBACK_PATHS:
        raise MalformedFeedback(f"path must be one of {list(FEEDBACK_PATHS)}, got {path[:40]!r}")
    for name in (f.REQUEST_ID, f.NODE):
        if not 0 < len(data[name]) <= TTFT_FEEDBACK_MAX_ID_CHARS:
            raise MalformedFeedback(f"{name} must be 1 to {TTFT_FEEDBACK_MAX_ID_CHARS} characters")
    if decode_nodes is not None and data[f.NODE] not in decode_nodes:
        raise MalformedFeedback(f"node {data[f.NODE][:40]!r} is not a decode node in the view")
    try:
        predicted_ms, observed_ms = float(data[f.PREDICTED_MS]), float(data[f.OBSERVED_MS])
    except ValueError:
        raise MalformedFeedback(
            f"predicted_ms={data[f.PREDICTED_MS][:40]!r} and observed_ms={data[f.OBSERVED_MS][:40]!r} must be numbers"
        ) from None
    # Both must be > 0: the ratio divides by the prediction, the MAPE by the observation.
    if not (0 < predicted_ms < math.inf and 0 < observed_ms < math.inf):
        raise MalformedFeedback(f"predicted_ms={predicted_ms} and observed_ms={observed_ms} must be finite and > 0")
    if max(predicted_ms, observed_ms) > TTFT_FEEDBACK_MAX_MS:
        raise MalformedFeedback(
            f"predicted_ms={predicted_ms} and observed_ms={observed_ms} must be <= {TTFT_FEEDBACK_MAX_MS:g}"
        )
    ratio = observed_ms / predicted_ms
    if not 1 / TTFT_FEEDBACK_MAX_RATIO <= ratio <= TTFT_FEEDBACK_MAX_RATIO:
        raise MalformedFeedback(f"observed/predicted = {ratio:g} is beyond {TTFT_FEEDBACK_MAX_RATIO:g}x either way")
    return TtftSample(data[f.REQUEST_ID], path, data[f.NODE], predicted_ms / 1e3, observed_ms / 1e3)


class TtftFeedback:
    """Turns TTFT samples into the dispatcher's model-error metrics (one instance per process)."""

    def __init__(self, metrics: DispatcherMetrics, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._metrics = metrics
        self._errors: dict[str, deque[float]] = {p: deque(maxlen=window) for p in FEEDBACK_PATHS}
        self._malformed_logged = False
        self.samples = 0  # accepted since start

    def observe(self, sample: TtftSample) -> None:
        self._metrics.ttft_observed_over_predicted.labels(path=sample.path).observe(sample.ratio)
        self._errors[sample.path].append(sample.abs_pct_error)
        self.samples += 1

    def add_entries(self, entries: Iterable[StreamEntry], decode_nodes: Collection[str] | None = None) -> int:
        """Parse and observe a batch of stream entries; returns how many were accepted. Malformed
        entries, and with ``decode_nodes`` those naming another node, are counted and skipped
        (the first one is logged, with its id)."""
        touched: set[str] = set()
        accepted = 0
        for entry_id, fields in entries:
            try:
                sample = parse_entry(fields, decode_nodes)
            except MalformedFeedback as exc:
                self._metrics.ttft_feedback_malformed.inc()
                if not self._malformed_logged:
                    self._malformed_logged = True
                    log.warning(
                        "ignoring malformed TTFT feedback entry %s: %s (logged once; "
                        "kairos_dispatcher_ttft_feedback_malformed_total counts them)",
                        _text(entry_id),
                        exc,
                    )
                continue
            self.observe(sample)
            touched.add(sample.path)
            accepted += 1
        for path in touched:  # one gauge update per batch, not per sample
            self._metrics.ttft_prediction_mape.labels(path=path).set(self.mape(path) or 0.0)
        return accepted

    def mape(self, path: str) -> float | None:
        """Mean absolute percentage error (a fraction) of the last ``window`` samples of ``path``,
        None before its first sample."""
        errors = self._errors[path]
        return math.fsum(errors) / len(errors) if errors else None


class FeedbackReader:
    """Reads the stream's new entries into a :class:`TtftFeedback`, one non-blocking XREAD per
    call from the last id read (the cluster view's poller calls it after each good poll).

    XREAD without BLOCK: a poll must not wait. "$" means nothing to a non-blocking XREAD (it would
    always answer empty), so the first read finds the stream's last id with XREVRANGE and
    continues from there: entries written before the dispatcher started are not replayed. A
    failed read only pauses the feedback; it never marks the view degraded.
    """

    def __init__(
        self,
        feedback: TtftFeedback,
        on_error: Callable[[], None],
        source: str,
        decode_nodes: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.feedback = feedback
        self._decode_nodes = decode_nodes  # the decode nodes in the view: samples must name one
        self._on_error = on_error  # counts a failed round trip
        self._last_id: bytes | str | None = None  # None: find the stream's end first
        self._outage = Outage(log)
        self._source = source  # the (redacted) Redis URL, for log lines

    async def read(self, client: aioredis.Redis) -> None:
        stream = REDIS_TTFT_FEEDBACK_STREAM
        try:
            if self._last_id is None:
                last = await client.xrevrange(stream, count=1)
                self._last_id = last[0][0] if last else b"0-0"
            reply = await client.xread({stream: self._last_id}, count=FEEDBACK_BATCH)
        except REDIS_ERRORS as exc:
            self._on_error()
            self._outage.fail(
                "cannot read the TTFT feedback stream %s at %s: %s; the model-error metrics pause until it "
                "reads again (routing is not affected)",
                stream,
                self._source,
                describe(exc),
            )
            return
        self._outage.ok("reading the TTFT feedback stream %(stream)s again", stream=stream)
        # RESP2 answers [[stream, entries]], a RESP3 connection may answer {stream: entries}.
        for _stream, entries in reply.items() if isinstance(reply, dict) else reply or ():
            if entries:
                self._last_id = entries[-1][0]
                self.feedback.add_entries(entries, self._decode_nodes() if self._decode_nodes else None)
