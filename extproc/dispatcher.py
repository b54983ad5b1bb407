"""The dispatcher's request handling, independent of the transport (Envoy ext_proc).

``Dispatcher.route(head, body)`` parses the OpenAI request, counts its prompt
tokens, runs the routing policy on the live cluster view, reserves a decode node for a
deflection, and returns a :class:`Routed` (upstream + header mutations) or a :class:`Rejected`
(an HTTP error to answer directly). The gRPC server in :mod:`kairos.extproc.server` only translates.

Prefix caches: with a :class:`PrefixSource` (the nodes' KV events, :mod:`kairos.extproc.kv_events`)
that indexes at least one node, and a prefix-aware policy (``kairos``, ``pd``; not with
``prefix=off``), the prompt is parsed to its token ids instead of only counted, and each node's
cached prefix of it (0 for a node without events, or whose index is stale or out of step) goes
to the decision: each path prefills only the node's uncached tokens. Otherwise the count-only
path runs, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from kairos.api.openai_request import (
    ParsedRequest,
    PayloadTooLargeError,
    RequestLimits,
    check_body_size,
    parse_request,
)
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.config import part, setting
from kairos.common.errors import (
    ConfigError,
    KairosError,
    MethodNotAllowedError,
    NoHealthyNodeError,
    NotFoundError,
    RequestHeadersTooLargeError,
    UnsupportedContentEncodingError,
)
from kairos.common.http_errors import error_json, error_status
from kairos.core.algorithm import cached_prefix
from kairos.core.decision import Decision, Route
from kairos.core.policies import NoPrefillPoolPolicy, Policy
from kairos.core.slo import RequestSLO, SloClass, classes_setting, classify, request_slo
from kairos.core.state import ClusterView
from kairos.extproc.admission import AdmissionGate
from kairos.extproc.metrics import DispatcherMetrics
from kairos.extproc.reservations import Reservation

log = logging.getLogger(__name__)

OPENAI_POST_PATHS = c.INFERENCE_PATHS


class NodeAddressLike(Protocol):
    role: str
    url: str
    sidecar: str


class ClusterSource(Protocol):
    """What the dispatcher needs from the live cluster view (``kairos.extproc.cluster``)."""

    @property
    def degraded(self) -> bool: ...

    def now(self) -> float:
        """The clock every ``reported_at`` in the view is on: the one time base of a decision."""
        ...

    def view(self) -> ClusterView: ...

    def record(self, decision: Decision, now: float) -> object: ...

    def cancel(self, handle: object) -> None: ...

    def addresses(self) -> Mapping[str, NodeAddressLike]: ...

    def decode_sidecars(self) -> tuple[str, ...]:
        """The decode nodes' sidecars, sorted and distinct."""
        ...

    async def try_reserve(self, node_id: str, owner: str, tokens: int) -> Reservation: ...


class PrefixSource(Protocol):
    """The nodes' prefix caches as the dispatcher reads them (``KvEventConsumer``), on the
    cluster view's clock."""

    def indexing(self) -> bool:
        """Some node's prefix cache is indexed (a prompt's token ids are worth computing)."""
        ...

    def hits(self, token_ids: list[int]) -> Mapping[str, int]:
        """Per indexed node, the prompt's leading tokens it has cached (0 when stale)."""
        ...


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the dispatcher reads of a request's head. The server builds it from Envoy's headers
    message (:meth:`of`), or, on Envoy's one-message route, from the attributes that come with
    the body (``kairos.common.contracts.HEAD_ATTRIBUTES``), where the route has already matched
    an inference path, POST, a declared length, no Content-Encoding and no routing header."""

    method: str
    path: str  # with its query string
    request_id: str = ""  # x-request-id; "" for none (the dispatcher makes one)
    content_encoding: str = ""
    content_length: str = ""  # as declared; "" for none
    # Sizes as Envoy's header limits count them: names and values, the pseudo-headers included.
    header_count: int = 0
    header_bytes: int = 0
    spoofed: tuple[str, ...] = ()  # the client's x-kairos-* headers, to remove
    # The client's own SLO headers (contracts.SLO_HEADERS), as sent; None: absent. A request with
    # one takes Envoy's headers route, so the one-message route has neither.
    slo_ttft_ms: str | None = None
    slo_tpot_ms: str | None = None

    @classmethod
    def of(cls, method: str, path: str, headers: Mapping[str, str]) -> RequestHead:
        """From a request's whole header map (names lower-case, pseudo-headers included)."""
        return cls(
            method=method,
            path=path,
            request_id=headers.get(c.H_REQUEST_ID, ""),
            content_encoding=headers.get("content-encoding", ""),
            content_length=headers.get("content-length", ""),
            header_count=len(headers),
            header_bytes=sum(len(name) + len(value) for name, value in headers.items()),
            spoofed=tuple(name for name in headers if name.lower().startswith(c.HEADER_PREFIX)),
            slo_ttft_ms=headers.get(c.H_SLO_TTFT_MS),
            slo_tpot_ms=headers.get(c.H_SLO_TPOT_MS),
        )


@dataclass(frozen=True, slots=True)
class Routed:
    """Send the request on, to ``destinations[0]`` (later ones are Envoy's fallbacks)."""

    destinations: tuple[str, ...]  # host:port of decode-node sidecars
    set_headers: tuple[tuple[str, str], ...]
    remove_headers: tuple[str, ...]
    decision: Decision | None  # None for pass-through paths (/v1/models, /health, ...) and fan-outs


@dataclass(frozen=True, slots=True)
class Rejected:
    """Answer the client directly."""

    status: int
    body: bytes  # OpenAI-style error JSON
    code: str
    retry_after_s: int | None = None  # a Retry-After header (an overloaded gateway's 429)


@dataclass(frozen=True, slots=True)
class Policies:
    """The routing policies, built on one latency profile. A profile reload replaces the whole
    object in one assignment (:attr:`Dispatcher.policies`), so a decision never mixes profiles."""

    policy: Policy
    keep_policy: Policy  # the P/D path, when every deflection target is taken
    # While no prefill node is registered: a decode node prefills rather than the request
    # failing with 503 (None: the 503 stands).
    no_prefill: NoPrefillPoolPolicy | None = None


@dataclass(frozen=True)
class DispatchSettings:
    """Request-level knobs of the dispatcher."""

    limits: RequestLimits = part(RequestLimits, help="what the gateway accepts")
    tokenize_inline_bytes: int = setting(
        16_384, help="bodies up to this size are parsed on the event loop, larger ones in a worker thread"
    )
    # The tokenizer's exact counter counts ASCII in Python holding the GIL: a pool thread would
    # count no faster and start only after the interpreter's switch interval (5 ms), so the hop
    # only adds latency (about 100 KB a 2 ms count).
    count_inline_bytes: int = setting(
        262_144, help="ASCII bodies up to this size are counted on the event loop when the exact counter applies"
    )
    # Answered 413 (too long to count in time) before Envoy's ext_proc message timeout (2 s)
    # answers a bare 504; the exact counter stops past the context, so only tokenizers counted by
    # a whole Rust encode get near it.
    parse_timeout_s: float = setting(1.5, help="a prompt whose parse takes longer is answered 413")
    reservation_attempts: int = setting(2, help="decode nodes tried for a deflection before keeping")
    dispatcher_id: str = setting("", help="this replica's name in reservations and metrics; a random id when empty")
    # kairos_dispatcher_class_decisions' class label and the x-kairos-slo-class header: a request's
    # class is read off its SLO pair. The sidecars' setting of the same name counts by them too.
    slo_classes: tuple[SloClass, ...] = classes_setting()

    def __post_init__(self) -> None:
        if self.reservation_attempts < 1:
            raise ConfigError(f"reservation_attempts must be >= 1, got {self.reservation_attempts}")
        if self.tokenize_inline_bytes < 0:
            raise ConfigError(f"tokenize_inline_bytes must be >= 0, got {self.tokenize_inline_bytes}")
        if self.count_inline_bytes < 0:
            raise ConfigError(f"count_inline_bytes must be >= 0, got {self.count_inline_bytes}")
        if not self.parse_timeout_s > 0:
            raise ConfigError(f"parse_timeout_s must be > 0, got {self.parse_timeout_s}")


class Dispatcher:
    def __init__(
        self,
        tokenizer: PromptTokenizer,
        policy: Policy,
        keep_policy: Policy,
        cluster: ClusterSource,
        metrics: DispatcherMetrics,
        settings: DispatchSettings = DispatchSettings(),
        no_prefill_policy: NoPrefillPoolPolicy | None = None,
        prefixes: PrefixSource | None = None,
        admission: AdmissionGate | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.admission = admission  # None: every request is decided (no in-flight budget)
        self.prefixes = prefixes
        # Read once per decision: assigning a new Policies swaps the models for the next one.
        self.policies = Policies(policy, keep_policy, no_prefill_policy)
        self._prefill_pool_gone = False
        self.cluster = cluster
        self.metrics = metrics
        self.settings = settings
        self.owner = settings.dispatcher_id or f"dispatcher-{uuid.uuid4().hex[:8]}"
        self._clock = cluster.now  # one clock: the view's, so ages and dispatch times agree
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kairos-tokenize")
        self._python_counts = tokenizer.counter_refusal is None  # see DispatchSettings.count_inline_bytes
        self._rr = itertools.count()

    @property
    def policy(self) -> Policy:
        return self.policies.policy

    @property
    def keep_policy(self) -> Policy:
        return self.policies.keep_policy

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.admission is not None:
            self.admission.close()

    # -- entry point -----------------------------------------------------------------------
    async def route(self, head: RequestHead, body: bytes | None) -> Routed | Rejected:
        """The answer to a whole request (``body`` None: one without a body)."""
        started = time.perf_counter()
        try:
            bare_path = head.path.split("?", 1)[0]
            _check_public(head, bare_path)
            if bare_path in OPENAI_POST_PATHS:
                _check_head_room(head)
                return await self._route_inference(head, body or b"", started)
            return self._pass_through(head.spoofed)
        except KairosError as exc:
            return self._rejected(exc, exc.code)
        except Exception as exc:  # a bug, not the client's fault: a clean 500, and the traceback in the log
            log.exception("internal error routing %s %s", head.method, head.path)
            return self._rejected(exc, "internal_error")

    def check_headers(self, head: RequestHead) -> Rejected | None:
        """The answer to a request whose body is still to come, when its headers alone refuse it
        (a path or method not served, a compressed body, a Content-Length over the body limit, an
        inference request's head with no room left for the routing headers):
        the client hears at once rather than after sending its body, or never, for a body that
        does not end (a CONNECT tunnel's). None: wait for the body and :meth:`route` it."""
        try:
            bare_path = head.path.split("?", 1)[0]
            _check_public(head, bare_path)
            if bare_path in OPENAI_POST_PATHS:
                declared = head.content_length
                if declared.isascii() and declared.isdigit():  # Envoy refuses a malformed one before us
                    check_body_size(int(declared), self.settings.limits)
                _check_head_room(head)
                self._request_slo(head)  # a bad SLO header is a 400 before the body is sent
        except KairosError as exc:
            return self._rejected(exc, exc.code)
        return None

    def _request_slo(self, head: RequestHead | None, priority: int = 0) -> RequestSLO:
        """The request's own SLOs, from its headers (the cluster's where absent, or for no head:
        the routing policy's configured SLOs); :class:`InvalidRequestError` (400) for a bad value."""
        config = getattr(self.policies.policy, "config", None)
        return request_slo(
            None if head is None else head.slo_ttft_ms,
            None if head is None else head.slo_tpot_ms,
            priority,
            defaults.TTFT_SLO_S if config is None else config.ttft_slo_s,
            defaults.TBT_SLO_S if config is None else config.tbt_slo_s,
        )

    def _rejected(self, exc: Exception, code: str) -> Rejected:
        self.metrics.rejections.labels(code=code).inc()
        return Rejected(error_status(exc), error_json(exc), code, getattr(exc, "retry_after_s", None))

    # -- inference requests ----------------------------------------------------------------
    async def _route_inference(self, head: RequestHead, body: bytes, started: float) -> Routed:
        policies = self.policies
        lookup = self.prefixes if prefix_aware(policies.policy) and self.prefixes is not None else None
        if lookup is not None and not lookup.indexing():
            lookup = None  # no node publishes events: the count-only path
        request = await self._parse(head.path, body, token_ids=lookup is not None)
        if request.parts or request.n > 1:
            return self._fan_out(head, request)
        found = None if lookup is None or request.prompt_token_ids is None else lookup.hits(request.prompt_token_ids)
        hits = found if found is not None and any(found.values()) else None  # no hit: the blind decision
        slo = self._request_slo(head, request.priority)
        gate = self.admission
        async with gate.slot(request.prompt_tokens, slo) if gate is not None else contextlib.nullcontext():
            decision = await self._decide(request.prompt_tokens, policies, hits, slo)
        # The SLOs the decision used: the request's own with an SLO-aware policy, else the
        # cluster's; the sidecar tells the decode node the TPOT. The class is the request's own.
        used = slo if slo_aware(policies.policy) else self._request_slo(None, request.priority)
        slo_class = classify(slo.ttft_s, slo.tpot_s, self.settings.slo_classes)
        addresses = self.cluster.addresses()
        request_id = head.request_id or uuid.uuid4().hex
        set_headers: list[tuple[str, str]] = [
            (c.H_REQUEST_ID, request_id),
            (c.H_ROUTE, decision.route.value),
            (c.H_REASON, decision.reason.value),
            (c.H_DECODE_NODE, decision.decode_node),
            (c.H_PROMPT_TOKENS, str(request.prompt_tokens)),
            (c.H_DECIDED_TTFT_SLO_MS, f"{used.ttft_s * 1e3:g}"),
            (c.H_DECIDED_TPOT_SLO_MS, f"{used.tpot_s * 1e3:g}"),
            (c.H_SLO_CLASS, slo_class),
        ]
        if decision.cached_tokens:
            set_headers.append((c.H_CACHED_TOKENS, str(decision.cached_tokens)))
        if decision.predicted_ttft_prefill_s is not None:
            set_headers.append((c.H_PRED_TTFT_PREFILL_MS, f"{decision.predicted_ttft_prefill_s * 1e3:.1f}"))
        if decision.predicted_ttft_decode_s is not None:
            set_headers.append((c.H_PRED_TTFT_DECODE_MS, f"{decision.predicted_ttft_decode_s * 1e3:.1f}"))
        if decision.prefill_node is not None:  # keep and split
            set_headers.append((c.H_PREFILL_HOST, addresses[decision.prefill_node].url))
        if decision.chunk_sizes:  # deflect, and a split's rest
            set_headers.append((c.H_CHUNK_SCHEDULE, c.encode_chunk_schedule(decision.chunk_sizes)))
        if decision.split_tokens:
            set_headers.append((c.H_SPLIT_TOKENS, c.encode_split_tokens(decision.split_tokens)))
        if decision.step_budget_s is not None:  # a keep's: for a local prefill should its prefill node fail
            set_headers.append((c.H_STEP_BUDGET_MS, c.encode_step_budget_ms(decision.step_budget_s * 1e3)))
        primary = addresses[decision.decode_node].sidecar
        destinations = (primary, *_fallback(primary, self.cluster.decode_sidecars()))
        overwritten = {name for name, _ in set_headers}
        elapsed = time.perf_counter() - started
        self.metrics.observe_decision(decision, elapsed, slo_class)
        if found is not None:
            decode_hit = cached_prefix(found, decision.decode_node, decision.prompt_tokens)
            self.metrics.observe_prefix_hits(decision, decode_hit)
        if log.isEnabledFor(logging.DEBUG):  # its arguments cost a few µs to format, on every request
            log.debug(
                "request %s: %s (%s) prompt=%d cached=%d decode=%s prefill=%s chunks=%s ttft_pf=%s ttft_dec=%s"
                " in %.2f ms",
                request_id,
                decision.route.value,
                decision.reason.value,
                request.prompt_tokens,
                decision.cached_tokens,
                decision.decode_node,
                decision.prefill_node or "-",
                c.encode_chunk_schedule(decision.chunk_sizes) or "-",
                _ms(decision.predicted_ttft_prefill_s),
                _ms(decision.predicted_ttft_decode_s),
                elapsed * 1e3,
            )
        return Routed(
            destinations=destinations,
            set_headers=tuple(set_headers),
            remove_headers=tuple(h for h in head.spoofed if h.lower() not in overwritten),
            decision=decision,
        )

    async def _parse(self, path: str, body: bytes, token_ids: bool = False) -> ParsedRequest:
        limits = self.settings.limits
        parse = functools.partial(
            parse_request, path, body, self.tokenizer, limits, stop_over_context=True, token_ids=token_ids
        )
        if self._parse_inline(body):
            return parse()
        # Tokenizing a long prompt takes milliseconds: keep the event loop serving others.
        loop = asyncio.get_running_loop()
        timeout_s = self.settings.parse_timeout_s
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, parse), timeout_s)
        except TimeoutError:
            # The pool thread finishes the count on its own; the client hears now, not from Envoy.
            raise PayloadTooLargeError(
                f"the prompt ({len(body)} bytes) could not be read and counted within {timeout_s:g} s; "
                "send a shorter prompt"
            ) from None

    def _parse_inline(self, body: bytes) -> bool:
        """Parse on the event loop (True) or in the tokenize pool, where Rust releases the GIL."""
        if len(body) <= self.settings.tokenize_inline_bytes:
            return True
        # JSON's \u escapes carry non-ASCII text in an ASCII body: that text reaches Rust.
        return (
            self._python_counts
            and len(body) <= self.settings.count_inline_bytes
            and body.isascii()
            and b"\\u" not in body
        )

    async def _decide(
        self,
        prompt_tokens: int,
        policies: Policies,
        cached: Mapping[str, int] | None = None,
        slo: RequestSLO | None = None,
    ) -> Decision:
        """Run the policy; a deflection must have its promise taken on its decode node
        (``kairos.extproc.reservations``), so that no dispatcher replica plans a node's step
        budget without the others' deflections there. Refused because the others promised more
        than the view counted, the policy runs again on the view with them; refused because
        Redis did not answer, the node is taken out. The policies are read once, by the caller:
        a profile reload while a promise is in flight takes effect at the next request.
        ``cached``: each node's cached prefix of the prompt, for the prefix-aware policies; ``slo``:
        the request's own SLOs, for the SLO-aware ones."""
        full_view = view = self.cluster.view()
        if policies.no_prefill is not None and self._prefill_pool_gone_from(view, policies.no_prefill):
            t0 = time.perf_counter()
            try:
                decision = self._without_prefill_pool(policies.no_prefill, prompt_tokens, view, slo)
            except NoHealthyNodeError:
                if not view.prefill:
                    raise
                # No decode node can take it within bounds, but prefill nodes are known, only late:
                # on a starved host their beats lag (a CI run got this 503 from a live p0). P/D to
                # the last one seen serves it; were it dead, the sidecar's hop 1 fails over to
                # prefilling locally. A 503 would lose a request that could be served.
                decision = _run(policies.keep_policy, prompt_tokens, view, self._clock(), cached, slo)
                self.cluster.record(decision, self._clock())
            self.metrics.policy_seconds.observe(time.perf_counter() - t0)
            return decision
        if self._prefill_pool_gone:
            self._prefill_pool_gone = False
            log.warning("a prefill node is fresh again: routing normally")
        excluded: set[str] = set()  # nodes whose promise Redis could not take
        decision: Decision | None = None
        compute_s = 0.0  # the policy's own time, apart from the promises' round trips
        for _ in range(self.settings.reservation_attempts):
            if excluded:
                view = dataclasses.replace(view, decode=tuple(n for n in view.decode if n.node_id not in excluded))
                if not view.decode:
                    break
            t0 = time.perf_counter()
            decision = _run(policies.policy, prompt_tokens, view, self._clock(), cached, slo)
            compute_s += time.perf_counter() - t0
            if decision.route is Route.KEEP:
                break
            node_id = decision.decode_node
            # In the view before the promise's round trip: a request of this dispatcher deciding
            # meanwhile schedules behind it (or, under a pending limit, leaves the node alone).
            handle = self.cluster.record(decision, self._clock())
            # The tokens the node will prefill: its cached prefix is not work (the view's overlay
            # counts the same).
            reservation = await self.cluster.try_reserve(node_id, self.owner, sum(decision.chunk_sizes))
            if reservation.granted:
                self.metrics.policy_seconds.observe(compute_s)
                return decision
            self.cluster.cancel(handle)
            self.metrics.reservation_conflicts.inc()
            if not reservation.foreign:
                excluded.add(node_id)
            view = self.cluster.view()  # with the other dispatchers' promises, if any came back
        assert decision is not None  # the loop runs at least once
        if decision.route is not Route.KEEP:
            # No deflection target took the promise: the P/D path, where any decode node
            # (promised ones included) can take the request after its prefill.
            t0 = time.perf_counter()
            decision = _run(policies.keep_policy, prompt_tokens, full_view, self._clock(), cached, slo)
            compute_s += time.perf_counter() - t0
        self.metrics.policy_seconds.observe(compute_s)
        self.cluster.record(decision, self._clock())
        return decision

    def _prefill_pool_gone_from(self, view: ClusterView, policy: NoPrefillPoolPolicy) -> bool:
        """No fresh prefill node, and a fresh decode node to prefill instead. While Redis is
        unreachable every heartbeat ages alike, and a prefill node looks stale before a decode
        node only because its last beat came a little earlier: then the pool counts as gone only
        when the view holds no prefill node at all (the degraded mode routes P/D)."""
        if self.cluster.degraded and view.prefill:
            return False
        return policy.applies(view, self._clock())

    def _without_prefill_pool(
        self, policy: Policy, prompt_tokens: int, view: ClusterView, slo: RequestSLO | None = None
    ) -> Decision:
        if not self._prefill_pool_gone:
            self._prefill_pool_gone = True
            log.warning(
                "no fresh prefill node: decode nodes prefill requests themselves until one is back (reason %s)",
                "deflect_no_prefill_node",
            )
        if slo is not None and slo_aware(policy):
            decision = policy.decide(prompt_tokens, view, self._clock(), slo=slo)  # type: ignore[call-arg]
        else:
            decision = policy.decide(prompt_tokens, view, self._clock())
        self.cluster.record(decision, self._clock())
        return decision

    def _fan_out(self, head: RequestHead, request: ParsedRequest) -> Routed:
        """A batch or n > 1, valid: to a decode sidecar (in turn, as pass-through), which sends
        each prompt's each choice back through the gateway, where each is decided on its own (vLLM
        runs each as its own engine request too), and merges their answers
        (``kairos.nodeagent.fanout``). Nothing is recorded or reserved for the request itself:
        each part is, when it comes back."""
        sidecars = self.cluster.decode_sidecars()
        if not sidecars:
            raise NoHealthyNodeError("no decode node is available")
        primary = sidecars[next(self._rr) % len(sidecars)]
        set_headers = (
            (c.H_REQUEST_ID, head.request_id or uuid.uuid4().hex),
            (c.H_ROUTE, c.ROUTE_FANOUT),
            (c.H_PROMPT_TOKENS, str(request.prompt_tokens)),
        )
        self.metrics.fanouts.inc()
        self.metrics.fanout_parts.inc(max(1, len(request.parts)) * request.n)
        overwritten = {name for name, _ in set_headers}
        return Routed(
            destinations=(primary, *_fallback(primary, sidecars)),
            set_headers=set_headers,
            remove_headers=tuple(h for h in head.spoofed if h.lower() not in overwritten),
            decision=None,
        )

    # -- everything else -------------------------------------------------------------------
    def _pass_through(self, spoofed: tuple[str, ...]) -> Routed:
        """GET /v1/models, /health, /metrics, ...: any live decode sidecar proxies them to its
        vLLM unchanged."""
        sidecars = self.cluster.decode_sidecars()
        if not sidecars:
            raise NoHealthyNodeError("no decode node is available")
        i = next(self._rr) % len(sidecars)
        ordered = (*sidecars[i:], *sidecars[:i])
        return Routed(destinations=ordered[:2], set_headers=(), remove_headers=spoofed, decision=None)


def _fallback(primary: str, sidecars: tuple[str, ...]) -> tuple[str, ...]:
    """Where Envoy retries a request ``primary`` could not take: the first other decode sidecar
    in sorted order (none when there is no other)."""
    for sidecar in sidecars[:2]:
        if sidecar != primary:
            return (sidecar,)
    return ()


# Room a request's head must leave for the routing headers _route_inference sets: at most ten, a
# few hundred bytes but for a deflection's chunk schedule, which this allows about 1,400 steps
# (a plan within the TTFT SLO has under a hundred).
HEAD_ROOM_HEADERS = 10
HEAD_ROOM_BYTES = 8 * 1024


def _check_head_room(head: RequestHead) -> None:
    """431 for an inference request's head that would pass the gateway's header limits once the
    routing headers are in: Envoy would fail that mutation with a 503 (a relayed GET gets none)."""
    max_count = defaults.GATEWAY_MAX_REQUEST_HEADERS - HEAD_ROOM_HEADERS
    max_size = defaults.GATEWAY_MAX_REQUEST_HEADERS_KB * 1024 - HEAD_ROOM_BYTES
    if head.header_count > max_count or head.header_bytes > max_size:
        raise RequestHeadersTooLargeError(
            f"the request's head ({head.header_count} headers, {head.header_bytes} bytes) leaves no room for "
            f"the gateway's routing headers: send at most {max_count} headers and {max_size} bytes"
        )


def _check_public(head: RequestHead, path: str) -> None:
    """The public API only (Envoy routes nothing else here; this holds behind any proxy), with
    bodies as sent: a compressed body would reach a node that cannot read it (vLLM does not
    decode request bodies), so it is a 415 rather than a 400 or 500 further on. ``path``:
    without its query."""
    method = head.method
    methods = c.PUBLIC_ENDPOINTS.get(path)
    if methods is None:
        what = path or f"{method} without a path"  # CONNECT's authority-form target has no :path
        raise NotFoundError(
            f"{what} is not served by this gateway; it serves "
            + ", ".join(f"{'/'.join(m)} {p}" for p, m in c.PUBLIC_ENDPOINTS.items())
        )
    if method not in methods:
        raise MethodNotAllowedError(f"{method} is not allowed on {path}; use {' or '.join(methods)}")
    encoding = head.content_encoding.strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedContentEncodingError(
            f"Content-Encoding {encoding!r} is not supported: send the request body uncompressed"
        )


def prefix_aware(policy: Policy) -> bool:
    """The policy reads the nodes' cached prefixes (``kairos``, ``pd``, unless ``prefix=off``)."""
    return bool(getattr(policy, "prefix_aware", False))


def slo_aware(policy: Policy) -> bool:
    """The policy decides each request by its own SLOs (``kairos``, unless ``slo=off``)."""
    return bool(getattr(policy, "slo_aware", False))


def _run(
    policy: Policy,
    prompt_tokens: int,
    view: ClusterView,
    now: float,
    cached: Mapping[str, int] | None,
    slo: RequestSLO | None = None,
) -> Decision:
    extra: dict[str, object] = {}
    if cached is not None and prefix_aware(policy):
        extra["cached"] = cached
    if slo is not None and slo_aware(policy):
        extra["slo"] = slo
    return policy.decide(prompt_tokens, view, now, **extra)  # type: ignore[arg-type]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}ms"
