"""An emulated vLLM node: vLLM's OpenAI-compatible HTTP API over the clock-free engine model.

Machines without GPUs run the whole gateway against these nodes; swapping in real vLLM changes
nothing else. What the node does:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: the prompt is counted with the model's
  tokenizer (exactly vLLM's ``usage.prompt_tokens``), the engine model runs it in wall time
  (:mod:`kairos.sim.realtime`) and exactly ``max_tokens`` dummy tokens come back (vLLM with
  ``ignore_eos``), as JSON or as vLLM's SSE chunks, each token written when its step ends.
- Prefix caching, on by default as in vLLM (``--no-enable-prefix-caching`` turns it off): the
  prompt's token ids are hashed per ``--block-size`` block exactly as vLLM hashes them
  (:mod:`kairos.common.block_hash`), the request starts from its longest cached prefix (the
  engine model's block cache), and ``--enable-prompt-tokens-details`` reports
  ``usage.prompt_tokens_details.cached_tokens`` as vLLM does. ``--kv-events-config`` publishes the
  cache's changes as vLLM does, on ZMQ with a replay socket (:mod:`kairos.sim.kv_event_publisher`).
- The P/D two-hop protocol of vLLM's NixlConnector (``toy_proxy_server.py``): a prefill node
  asked for ``kv_transfer_params.do_remote_decode`` prefills, holds the KV and answers with
  ``kv_transfer_params`` saying where it is; a decode node given ``do_remote_prefill`` reserves KV
  room, pulls from the prefill node (``POST /kairos/kv/pull``), waits the modelled transfer time
  and decodes. As vLLM's NixlConnector, the decode node first takes the prompt's prefix from its
  own cache and pulls only the blocks it lacks.
- Deflected prefills: ``vllm_xargs.kairos_chunk_schedule`` (and ``kairos_step_budget_ms``) make
  the engine prefill with exactly that chunk schedule, as the Kairos scheduler plugin does; a
  malformed one is refused by the plugin's own parser with vLLM's very answer (status, body).
- ``vllm_xargs.kairos_tpot_slo_ms`` (any request): its TPOT SLO. As the plugin, a deflected
  chunk's step budget is held to its running decodes' tightest TPOT (the engine's guard), and a
  decode node's ``/kairos/state`` reports the tightest TPOT among its requests (``tpot_slo_ms``).
- ``GET /v1/models``, ``/health``, ``/metrics`` (vLLM's metric names), ``/kairos/state`` (what the
  heartbeat publisher reads) and ``/kairos/steps?since=N`` (the step log).

    python -m kairos.sim.emulated_vllm --node-id d0 --role decode --port 8101 --model-dir DIR --time-scale 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kairos.api import batch
from kairos.api.openai_request import (
    NotFoundError,
    ParsedRequest,
    PayloadTooLargeError,
    RequestError,
    RequestLimits,
    parse_request,
)
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.block_hash import block_keys
from kairos.common.contracts import Role
from kairos.common.contracts.api import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, HEALTH_PATH, MODELS_PATH
from kairos.common.errors import ConfigError, InvalidRequestError, KairosError, NoHealthyNodeError
from kairos.common.http_errors import UpstreamError, UpstreamTimeoutError, error_body, error_json, error_status
from kairos.common.kv_events import KvEventsConfig
from kairos.common.runtime import Service, announce_listening, flag_overrides, serving
from kairos.core.calibration import StepCalibration, prior_from_mape
from kairos.core.latency import DEFAULT_PROFILE, LatencyModels, load_profile
from kairos.sim.engine import Engine, EngineConfig, model_step_time
from kairos.sim.engine import Sequence as EngineSeq
from kairos.sim.kv_event_publisher import KvEventPublisher
from kairos.sim.realtime import EngineStoppedError, RealtimeEngine, TokenEvent, TokenStream

log = logging.getLogger("kairos.sim.emulated_vllm")

NODE_KEY = web.AppKey("node", "EmulatedNode")  # the application's EmulatedNode (tests reach into it)
KV_PULL_PATH = "/kairos/kv/pull"
TOKENIZE_INLINE_BYTES = 16_384  # larger bodies are tokenized in a thread: the step loop keeps its timing
PULL_TIMEOUT_S = 10.0  # wall seconds for the pull call itself (validation only, no data moves)
PULL_KEEPALIVE_S = 1.0  # wall seconds a decode node reuses an idle pull connection (nodes close at 5)
# The request head vLLM's server reads (uvicorn's h11 limits as vLLM sets them by default:
# H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT, H11_MAX_HEADER_COUNT_DEFAULT); aiohttp's own defaults
# (8190 bytes a header, 128 headers) would refuse, with a text/plain 400, heads vLLM serves.
VLLM_MAX_HEAD_BYTES = 4 * 1024 * 1024
VLLM_MAX_HEADERS = 256
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
# One short word per output token: the text is noise, the token accounting is what matters. The
# node streams words the model's tokenizer holds as one token each (see ``one_token_words``), as
# vLLM streams one detokenized token per step; these are the fallback for a tokenizer with none.
_WORDS = (" lorem", " ipsum", " dolor", " sit", " amet", " sed", " do", " magna", " aliqua", " enim")
_WORD_COUNT = len(_WORDS)
# vllm:prompt_tokens_by_source's sources (vLLM's PromptTokenStats.ALL_SOURCES).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
# fmt: off
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
# fmt: on


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmulatedNodeConfig:
    """One emulated vLLM node. Durations are model seconds (divided by ``time_scale`` on the wall)."""

    node_id: str  # unique in the cluster, e.g. "d0"
    role: Role  # prefill: serves hop 1 and holds KV for pulls; decode: pulls KV, runs deflected prefills
    model_dir: str  # Hugging Face model directory with tokenizer.json (and a chat template)
    host: str = "127.0.0.1"  # bind address
    port: int = 0  # 0 = any free port (printed at start-up)
    model: str = ""  # served model id (vLLM's --served-model-name); empty = model_dir, as vLLM does
    profile: str = DEFAULT_PROFILE  # latency profile, packaged name or JSON path
    max_model_len: int = defaults.MAX_MODEL_LEN  # prompt + output tokens per request (vLLM's --max-model-len)
    max_step_tokens: int = 2048  # tokens per engine step (vLLM's --max-num-batched-tokens)
    kv_capacity_tokens: int = defaults.KV_CAPACITY_TOKENS  # KV cache size in tokens
    max_running: int = 256  # resident sequences (vLLM's --max-num-seqs)
    time_scale: float = 1.0  # 10 = ten times faster than real time
    # Prefill node: wall seconds it keeps KV nobody has pulled (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    # and its default). Wall, not model time, as in vLLM: at --time-scale 1000 a model-time hold
    # lasted 120 ms, less than a gateway's hops on a loaded host take to send the decode request.
    kv_hold_timeout_s: float = 480.0
    # Wall seconds the server keeps an idle kept-alive connection open (vLLM's
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE and its default): a client that reuses a connection after a
    # pause races this close, on a real node and so here. Over PULL_KEEPALIVE_S.
    keep_alive_timeout_s: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    step_log_size: int = 10_000  # engine steps kept for /kairos/steps
    prefix_caching: bool = True  # vLLM's --enable-prefix-caching (its default) / --no-enable-prefix-caching
    block_size: int = defaults.KV_BLOCK_TOKENS  # vLLM's --block-size: tokens per KV block (and per hash)
    enable_prompt_tokens_details: bool = False  # vLLM's flag: usage.prompt_tokens_details.cached_tokens
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON (KvEventsConfig)

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ConfigError("EmulatedNodeConfig.node_id must not be empty")
        if not self.model_dir:
            raise ConfigError("EmulatedNodeConfig.model_dir must not be empty")
        object.__setattr__(self, "role", Role(self.role))
        if not self.model:
            object.__setattr__(self, "model", self.model_dir)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ConfigError(f"time_scale must be a positive number, got {self.time_scale}")
        if not (self.kv_hold_timeout_s > 0 and math.isfinite(self.kv_hold_timeout_s)):
            raise ConfigError(f"kv_hold_timeout_s must be a positive number, got {self.kv_hold_timeout_s}")
        if not (self.keep_alive_timeout_s > PULL_KEEPALIVE_S and math.isfinite(self.keep_alive_timeout_s)):
            raise ConfigError(
                f"keep_alive_timeout_s must be a number over {PULL_KEEPALIVE_S:g} (the decode nodes reuse a KV pull "
                f"connection that long), got {self.keep_alive_timeout_s}"
            )
        for name in (
            "max_model_len",
            "max_step_tokens",
            "kv_capacity_tokens",
            "max_running",
            "max_body_bytes",
            "step_log_size",
            "block_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2 (one prompt and one output token), got {self.max_model_len}")
        # The engine admits a prompt only when it and its first token fit, and never preempts:
        # a request the context allows must always fit an empty cache.
        if self.kv_capacity_tokens < self.max_model_len:
            raise ConfigError(
                f"kv_capacity_tokens={self.kv_capacity_tokens} must be >= max_model_len={self.max_model_len}"
            )
        _ = self.kv_events  # refuse a malformed --kv-events-config at start-up, as vLLM does

    @property
    def kv_events(self) -> KvEventsConfig | None:
        """The parsed ``kv_events_config``; None when the node publishes no events."""
        if self.kv_events_config is None:
            return None
        try:
            parsed = KvEventsConfig.from_json(self.kv_events_config)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return parsed if parsed.publishes else None


# ---------------------------------------------------------------------------------------------
# Node state
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _HeldKV:
    """A prefill hop's KV, kept until the decode node pulls it or the hold times out."""

    seq: EngineSeq
    block_ids: list[int]
    expiry: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _Metrics:
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
    def create(cls, model: str) -> _Metrics:
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


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one inference request runs on this node."""

    mode: Literal["plain", "deflect", "remote_decode", "remote_prefill"]  # remote_decode = prefill hop 1
    schedule: tuple[int, ...] = ()
    step_budget_s: float | None = None
    kv_params: dict[str, Any] | None = None
    tpot_slo_s: float | None = None  # its TPOT SLO (vllm_xargs kairos_tpot_slo_ms; None: the cluster's)


class EmulatedNode:
    """The node's state and HTTP handlers; one per aiohttp application."""

    def __init__(self, config: EmulatedNodeConfig, tokenizer: PromptTokenizer, models: LatencyModels) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.models = models
        self.limits = RequestLimits(
            max_body_bytes=config.max_body_bytes,
            max_model_len=config.max_model_len,
            default_max_tokens=min(16, config.max_model_len - 1),
        )
        self.words = one_token_words(tokenizer)
        # The output's token ids, as the cache hashes them: vLLM caches a request's output blocks
        # too, so a conversation's next turn (prompt + this answer + ...) hits past this prompt.
        self.word_ids = _single_token_ids(tokenizer, self.words)
        self.engine_id = f"{config.node_id}-{uuid.uuid4().hex[:12]}"  # vLLM's per-engine id, new per start
        self.metrics = _Metrics.create(config.model)
        self.created = int(time.time())
        self.rt: RealtimeEngine | None = None
        self.http: aiohttp.ClientSession | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{config.node_id}-tokenize")
        self._held: dict[int, _HeldKV] = {}  # by first block id (unique per node run)
        self._block_ids = itertools.count()
        self._transferring = 0  # decode node: pulls in their transfer wait (vLLM counts them as waiting)
        # decode node: prompt tokens of each KV pull from its arrival until its transfer ends, FIFO
        # (waiting for KV room, for the link, or transferring): what its heartbeat reports
        self._pulls: list[int] = []
        # One inbound KV link per decode node, FIFO, as the simulator models it: concurrent pulls
        # queue on the link instead of overlapping.
        self._link = asyncio.Lock()
        events = config.kv_events
        self.kv_events = KvEventPublisher(events, config.host) if events is not None else None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        engine = Engine(
            EngineConfig(
                cfg.node_id,
                cfg.role,
                cfg.max_step_tokens,
                cfg.kv_capacity_tokens,
                cfg.max_running,
                block_tokens=cfg.block_size,
                prefix_caching=cfg.prefix_caching,
            ),
            model_step_time(self.models),
            guard=self.models,
            track_tokens=True,
            # A decode node measures its steps against its model and reports the calibration in
            # its engine state (the heartbeat's step_calibration), as the vLLM plugin does.
            calibration=StepCalibration(prior=prior_from_mape(self.models.mixed.mape))
            if cfg.role is Role.DECODE
            else None,
        )
        if self.kv_events is not None:
            self.kv_events.start()
        publish = self.kv_events.publish if self.kv_events is not None else None
        self.rt = RealtimeEngine(engine, cfg.time_scale, cfg.step_log_size, kv_events=publish)
        self.rt.start()
        # Kept-alive pull connections (NIXL keeps its connections to a prefill engine too), given
        # up well before the prefill node's own idle close: a claim is not safe to send twice, so
        # it must never go out on a connection that close could cross.
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=PULL_TIMEOUT_S),
            connector=aiohttp.TCPConnector(keepalive_timeout=PULL_KEEPALIVE_S),
        )
        log.info(
            "node %s (%s) up: model=%s profile=%s time_scale=%g max_step_tokens=%d kv_capacity=%d engine_id=%s",
            cfg.node_id,
            cfg.role.value,
            cfg.model,
            self.models.name,
            cfg.time_scale,
            cfg.max_step_tokens,
            cfg.kv_capacity_tokens,
            self.engine_id,
        )

    async def stop(self) -> None:
        for held in self._held.values():
            if held.expiry is not None:
                held.expiry.cancel()
        self._held.clear()
        if self.rt is not None:
            await self.rt.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.http is not None:
            await self.http.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        log.info("node %s stopped", self.config.node_id)

    @property
    def engine(self) -> RealtimeEngine:
        if self.rt is None or not self.rt.running:
            raise NoHealthyNodeError(f"the engine of node {self.config.node_id} is not running")
        return self.rt

    # -- inference ---------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions, in all four modes (see ``_plan``). As in
        vLLM, a batch runs as one engine request per prompt and ``n`` > 1 as n sequences (vLLM's
        child requests) per prompt, answered together (:mod:`kairos.api.batch`)."""
        rt = self.engine
        arrival = rt.now()
        body = await request.read()
        parsed = await self._parse(request.path, body)
        self._check_model(parsed.body)
        rid = request.headers.get(c.H_REQUEST_ID) or uuid.uuid4().hex
        prompts = parsed.parts or (parsed,)
        try:
            plans = [self._plan(p) for p in prompts]
        except _VllmValidationError as exc:
            log.debug("request %s: %s", rid, exc.message)
            return await _vllm_rejection(request, parsed.stream and exc.in_engine, rid, exc)
        log.debug(
            "request %s: %s %s prompt=%d max_tokens=%d prompts=%d n=%d",
            rid,
            parsed.kind,
            plans[0].mode,
            parsed.prompt_tokens,
            parsed.max_tokens,
            len(prompts),
            parsed.n,
        )

        created = int(time.time())
        outs: list[_Output] = []
        try:
            for i, (part, plan) in enumerate(zip(prompts, plans, strict=True)):
                outs.append(_Output(part, rid, self.config.model, created, self.words))
                # vLLM's engine request ids: "<id>-<prompt>" for a batch's prompts (one prompt keeps
                # the request's id here: the step logs name it), "<choice>_<id>" for n > 1.
                await self._start(outs[-1], plan, rid if len(prompts) == 1 else f"{rid}-{i}")
            if parsed.stream:
                return await self._stream(request, outs, arrival)
            await self._drain(outs, arrival)
        finally:
            for out in outs:
                for seq in out.seqs:
                    if seq.finished_at is None:
                        rt.abort(seq)  # the client went away (or the handler was cancelled)
        answers = [
            out.response(self._hold(out, request) if plan.mode == "remote_decode" else None)
            for out, plan in zip(outs, plans, strict=True)
        ]
        log.debug("request %s: done, %d tokens", rid, sum(sum(out.tokens) for out in outs))
        answer = answers[0] if len(answers) == 1 else batch.merge_responses(answers, outs[0].id, created)
        return web.json_response(answer, headers={c.H_REQUEST_ID: rid}, dumps=_dumps)

    async def _start(self, out: _Output, plan: _Plan, seq_id: str) -> None:
        """Put one prompt's ``n`` sequences on the engine (into ``out``, which the caller aborts
        should a later one fail)."""
        rt, parsed = self.engine, out.parsed
        ids = self._token_ids(parsed)
        hashes = await self._block_hashes(ids)
        block = self.config.block_size
        written = parsed.prompt_tokens // block * block  # the prompt's full blocks: what it caches
        seq_ids = [seq_id] if parsed.n == 1 else [f"{j}_{seq_id}" for j in range(parsed.n)]
        for j, child_id in enumerate(seq_ids):
            if plan.mode == "remote_prefill":
                seq = EngineSeq(
                    child_id,
                    parsed.prompt_tokens,
                    parsed.max_tokens,
                    tpot_slo_s=plan.tpot_slo_s,
                    block_hashes=hashes,
                    token_ids=ids,
                )
                # With n > 1 each of vLLM's child requests reads the one prefill's blocks; the
                # prefill node frees them at the first read's notification (claimed once here).
                stream = await self._pull_kv(seq, plan.kv_params or {}, seq_id, claim=j == 0)
                self.metrics.add_prompt(0, seq.cached_hit, parsed.prompt_tokens - seq.cached_hit)
                own = parsed.prompt_tokens  # what vLLM counts cached here: its hit and the transfer
                # vLLM's decode side reports the prefill node's hit, which the prefill hop passed on.
                remote = (plan.kv_params or {}).get("remote_prefill_cached_tokens")
                cached = remote if _is_int(remote) else own
            else:
                seq = EngineSeq(
                    child_id,
                    parsed.prompt_tokens,
                    parsed.max_tokens,
                    schedule=plan.schedule,
                    step_budget_s=plan.step_budget_s,
                    tpot_slo_s=plan.tpot_slo_s,
                    hold_kv=plan.mode == "remote_decode",
                    block_hashes=hashes,
                    token_ids=ids,
                )
                stream = rt.submit(seq)
                own = cached = seq.cached_hit
                self.metrics.add_prompt(parsed.prompt_tokens - cached, cached)
            # vLLM's created_cache_tokens: the prompt's full blocks this request wrote to the cache.
            created = max(0, written - own) if self.config.prefix_caching else 0
            out.add(seq, stream, cached, created)
        out.details = self.config.enable_prompt_tokens_details

    async def _parse(self, path: str, body: bytes) -> ParsedRequest:
        ids = self.config.prefix_caching  # the prefix cache hashes the prompt's token ids
        if len(body) <= TOKENIZE_INLINE_BYTES:
            return parse_request(path, body, self.tokenizer, self.limits, token_ids=ids)
        # Tokenizing a long prompt takes milliseconds: never stall the engine's step loop for it.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, functools.partial(parse_request, path, body, self.tokenizer, self.limits, token_ids=ids)
        )

    def _token_ids(self, parsed: ParsedRequest) -> Sequence[int]:
        """The request's prompt and output token ids (() with prefix caching off): the output is
        the words the node streams, so their ids are known before they are generated."""
        prompt = parsed.prompt_token_ids
        if not prompt:
            return ()
        if self.word_ids is None:
            return prompt
        n = len(self.word_ids)
        return [*prompt, *(self.word_ids[i % n] for i in range(parsed.max_tokens))]

    async def _block_hashes(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The request's full blocks as vLLM keys them (() with prefix caching off): a long
        request's sha256 chain is hashed in a thread, as its prompt was counted."""
        if not self.config.prefix_caching or len(token_ids) < self.config.block_size:
            return ()
        if len(token_ids) <= TOKENIZE_INLINE_BYTES // 4:  # about as many tokens as such a body holds
            return tuple(block_keys(token_ids, self.config.block_size))
        loop = asyncio.get_running_loop()
        return tuple(await loop.run_in_executor(self._pool, block_keys, token_ids, self.config.block_size))

    def _plan(self, parsed: ParsedRequest) -> _Plan:
        """Which of the four ways the request runs here; every malformed extension is a 400
        (:class:`_VllmValidationError` where vLLM itself refuses it, as vLLM answers)."""
        body, role = parsed.body, self.config.role
        params = body.get(c.KV_TRANSFER_PARAMS)
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{c.KV_TRANSFER_PARAMS} must be an object", c.KV_TRANSFER_PARAMS)
        params = params or {}
        remote_decode, remote_prefill = params.get("do_remote_decode") is True, params.get("do_remote_prefill") is True
        xargs = _vllm_xargs(body.get(c.VLLM_XARGS))
        _check_extra_args(xargs, params)
        try:
            chunk_plan = c.parse_schedule_xargs(xargs)  # what the validator plugin runs in vLLM
            tpot_s = c.parse_tpot_xarg(xargs)
        except c.MalformedSchedule as exc:
            raise _VllmValidationError(str(exc), in_engine=True) from None
        deflect = chunk_plan is not None
        if sum((remote_decode, remote_prefill, deflect)) > 1:
            raise RequestError(
                "a request is either a prefill hop (do_remote_decode), a decode hop (do_remote_prefill) or a "
                f"deflected prefill ({c.XARG_CHUNK_SCHEDULE}), not several",
                c.KV_TRANSFER_PARAMS,
            )
        if remote_decode:
            if role is not Role.PREFILL:
                raise RequestError(
                    f"node {self.config.node_id} is a {role.value} node: do_remote_decode needs a prefill node",
                    c.KV_TRANSFER_PARAMS,
                )
            if parsed.stream or parsed.max_tokens != 1:
                raise RequestError(
                    f"a prefill hop (do_remote_decode) must have max_tokens 1 and stream false, got "
                    f"max_tokens {parsed.max_tokens} and stream {str(parsed.stream).lower()}",
                    "max_tokens",
                )
            return _Plan("remote_decode")
        if remote_prefill:
            if role is not Role.DECODE:
                raise RequestError(
                    f"node {self.config.node_id} is a {role.value} node: do_remote_prefill needs a decode node",
                    c.KV_TRANSFER_PARAMS,
                )
            _check_pull_params(params, parsed.prompt_tokens)
            return _Plan("remote_prefill", kv_params=params, tpot_slo_s=tpot_s)
        if chunk_plan is not None:
            if max(chunk_plan.sizes) > self.config.max_step_tokens:
                # As the scheduler plugin: vLLM's validator cannot see the engine's limit.
                log.warning("chunks over max_step_tokens=%d run capped at it", self.config.max_step_tokens)
            budget_s = chunk_plan.step_budget_s
            return _Plan("deflect", schedule=chunk_plan.sizes, step_budget_s=budget_s, tpot_slo_s=tpot_s)
        return _Plan("plain", tpot_slo_s=tpot_s)

    async def _drain(self, outs: list[_Output], arrival: float) -> None:
        async for i, j, event in _token_events(outs):
            self._observe(event, outs[i], j, arrival)

    async def _stream(self, request: web.Request, outs: list[_Output], arrival: float) -> web.StreamResponse:
        first = outs[0]
        resp = web.StreamResponse(headers={**_SSE_HEADERS, c.H_REQUEST_ID: first.rid})
        many = len(outs) > 1
        merge = batch.StreamMerge(len(outs), first.id, first.created, choices_per_part=first.parsed.n) if many else None

        async def send(prompt: int, chunk: dict[str, Any]) -> None:
            merged = chunk if merge is None else merge.chunk(prompt, chunk)
            if merged is not None:
                await resp.write(_sse(merged))

        try:
            await resp.prepare(request)
            # A chat stream's role chunks (one per choice; chat has no batches) go with the first
            # token, as vLLM sends them with the engine's first output: a stream's first event is
            # its first token.
            role = first.chat
            async for i, j, event in _token_events(outs):
                self._observe(event, outs[i], j, arrival)
                if role:
                    role = False
                    await resp.write(b"".join(_sse(first.role_chunk(k)) for k in range(first.parsed.n)))
                await send(i, outs[i].token_chunk(event, j))
            if first.parsed.include_usage:
                for i, out in enumerate(outs):
                    await send(i, out.usage_chunk())
                if merge is not None and (usage := merge.usage_chunk()) is not None:
                    await resp.write(_sse(usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except EngineStoppedError as exc:
            # Headers are gone: end the stream the way vLLM does, with an error event.
            log.warning("request %s: engine stopped mid-stream: %s", first.rid, exc)
            with contextlib.suppress(ConnectionError):
                err = NoHealthyNodeError(f"node {self.config.node_id}: {exc}")
                await resp.write(_sse(error_body(err)) + b"data: [DONE]\n\n")
                await resp.write_eof()
        except ConnectionError:
            log.info(
                "request %s: client disconnected after %d of %d tokens",
                first.rid,
                sum(sum(out.tokens) for out in outs),
                sum(out.parsed.max_tokens * out.parsed.n for out in outs),
            )
        return resp

    def _observe(self, event: TokenEvent, out: _Output, choice: int, arrival: float) -> None:
        labels = self.metrics.labels
        if out.last_at[choice] is None:
            self.metrics.ttft.labels(**labels).observe(max(0.0, event.at - arrival))
            if out.first is None:
                out.first = choice
        else:
            self.metrics.itl.labels(**labels).observe(event.at - out.last_at[choice])
        self.metrics.generation_tokens.labels(**labels).inc()
        if event.last:
            self.metrics.request_success.labels(**labels, finished_reason="length").inc()
            out.finished.append(choice)
        out.tokens[choice] = event.index
        out.last_at[choice] = event.at

    # -- P/D: prefill side -------------------------------------------------------------------
    def _hold(self, out: _Output, request: web.Request) -> dict[str, Any]:
        """Keep a finished prefill hop's KV for the decode node and say where it is. With n > 1
        each of vLLM's child requests holds its own and the answer names the one that finished
        last: the others' KV waits, unread, for the hold to time out (vLLM's lease)."""
        held = {choice: self._hold_kv(seq, request) for choice, seq in enumerate(out.seqs)}
        return held[out.finished[-1] if out.finished else len(out.seqs) - 1]

    def _hold_kv(self, seq: EngineSeq, request: web.Request) -> dict[str, Any]:
        n_blocks = max(1, -(-seq.prompt_tokens // self.config.block_size))
        block_ids = [next(self._block_ids) for _ in range(n_blocks)]
        held = _HeldKV(seq, block_ids)
        held.expiry = asyncio.get_running_loop().call_later(self.config.kv_hold_timeout_s, self._expire, block_ids[0])
        self._held[block_ids[0]] = held
        # Where the decode side reaches us: the address this request came in on (right for
        # port 0 and for 0.0.0.0 binds alike).
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        host, port = (sock[0], sock[1]) if sock else (self.config.host, self.config.port)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": block_ids,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": seq.request_id,
            "tp_size": 1,
            "kairos_prompt_tokens": seq.prompt_tokens,
            # vLLM 0.32: the prefill side's hit, for the decode side's usage (prompt_tokens_details)
            "remote_prefill_cached_tokens": seq.cached_hit,
        }

    def _expire(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        log.warning(
            "node %s: KV of request %s (%d tokens) not pulled within %gs: released",
            self.config.node_id,
            held.seq.request_id,
            held.seq.prompt_tokens,
            self.config.kv_hold_timeout_s,
        )
        if self.rt is not None:
            self.rt.release(held.seq)

    async def kv_pull(self, request: web.Request) -> web.Response:
        """A decode node takes a held KV: validate, then free it when the modelled transfer ends."""
        rt = self.engine
        try:
            data = json.loads(await request.read())
        except ValueError:
            raise RequestError("the KV pull body is not valid JSON") from None
        if not isinstance(data, dict):
            raise RequestError("the KV pull body must be a JSON object")
        engine_id, block_ids, rid = data.get("remote_engine_id"), data.get("remote_block_ids"), data.get("request_id")
        held = None
        if engine_id == self.engine_id and isinstance(block_ids, list) and block_ids:
            candidate = self._held.get(block_ids[0]) if isinstance(block_ids[0], int) else None
            if candidate is not None and candidate.block_ids == block_ids and rid in (None, candidate.seq.request_id):
                held = candidate
        if held is None:
            reason = (
                f"this node's engine id is {self.engine_id}, not {engine_id}"
                if engine_id != self.engine_id
                else "no KV is held for these block ids (never prefilled here, already pulled, or expired)"
            )
            log.info("node %s: KV pull for request %s refused: %s", self.config.node_id, rid or "-", reason)
            raise NotFoundError(f"node {self.config.node_id}: unknown KV transfer: {reason}")
        tokens = held.seq.prompt_tokens
        read = data.get("read_tokens", tokens)  # the decode side reads only the blocks it lacks
        if not _is_int(read) or not 0 <= read <= tokens:
            raise RequestError(f"read_tokens must be an integer in 0..{tokens}", "read_tokens")
        del self._held[block_ids[0]]
        if held.expiry is not None:
            held.expiry.cancel()
        # The prefill node keeps the KV until the transfer has been read, as in the simulator.
        asyncio.get_running_loop().call_later(rt.wall_delay(self.models.kv_transfer_s(read)), rt.release, held.seq)
        log.debug(
            "node %s: KV of request %s (%d of %d tokens) pulled",
            self.config.node_id,
            held.seq.request_id,
            read,
            tokens,
        )
        return web.json_response({"prompt_tokens": tokens, "request_id": held.seq.request_id})

    # -- P/D: decode side --------------------------------------------------------------------
    async def _pull_kv(self, seq: EngineSeq, params: dict[str, Any], rid: str, claim: bool = True) -> TokenStream:
        """Reserve room, claim the KV from the prefill node, wait the transfer, join the batch.
        The prompt's prefix this node caches is taken from its cache (vLLM's NixlConnector asks
        the connector only for the tokens past the local hit): only the rest crosses the link.
        ``claim`` False: read KV another sequence of the request claimed (n > 1)."""
        rt = self.engine
        tokens = seq.prompt_tokens
        host = params["remote_host"]
        prefill = f"[{host}]:{params['remote_port']}" if ":" in host else f"{host}:{params['remote_port']}"
        wait_s = self.config.kv_hold_timeout_s  # as long as the prefill node holds the KV for us
        self._pulls.append(tokens)
        try:
            try:
                missing = await asyncio.wait_for(rt.reserve_transfer(seq), wait_s)
            except TimeoutError:
                raise NoHealthyNodeError(
                    f"node {self.config.node_id}: no KV room for {tokens} tokens within "
                    f"{self.config.kv_hold_timeout_s:g}s"
                ) from None
            self._transferring += 1
            try:
                async with self._link:
                    if claim:
                        await self._claim(prefill, params, tokens, missing, rid)
                    await asyncio.sleep(rt.wall_delay(self.models.kv_transfer_s(missing)))
            except BaseException:
                rt.unreserve_transfer(seq, missing)
                raise
            finally:
                self._transferring -= 1
        finally:
            self._pulls.remove(tokens)  # one of equal values: the list is only read as a multiset and order
        return rt.accept_transferred(seq, missing)

    async def _claim(self, prefill: str, params: dict[str, Any], tokens: int, read: int, rid: str) -> None:
        """Claim the held KV of ``tokens`` prompt tokens, of which this node reads the last ``read``."""
        assert self.http is not None
        payload = {
            "remote_engine_id": params["remote_engine_id"],
            "remote_block_ids": params["remote_block_ids"],
            "request_id": params.get("remote_request_id"),
            "read_tokens": read,
        }
        url = f"http://{prefill}{KV_PULL_PATH}"
        try:
            async with self.http.post(url, json=payload, headers={c.H_REQUEST_ID: rid}) as resp:
                status, raw = resp.status, await resp.read()
        except TimeoutError:
            raise UpstreamTimeoutError(f"prefill node {prefill} did not answer the KV pull in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            reason = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else repr(exc)
            log.warning("request %s: KV pull from prefill node %s failed: %s", rid, prefill, reason)
            raise UpstreamError(f"cannot pull KV from prefill node {prefill}: {type(exc).__name__}") from None
        if status == 404:
            detail = _error_message(raw)
            log.info("request %s: prefill node %s does not hold the KV: %s", rid, prefill, detail)
            raise RequestError(
                f"{c.KV_TRANSFER_PARAMS} refer to KV that prefill node {prefill} does not hold ({detail})",
                c.KV_TRANSFER_PARAMS,
            )
        if status != 200:
            raise UpstreamError(f"prefill node {prefill} answered the KV pull with {status}: {_error_message(raw)}")
        try:
            pulled = json.loads(raw)["prompt_tokens"]
        except (ValueError, KeyError, TypeError):
            raise UpstreamError(f"prefill node {prefill} sent a malformed KV pull reply") from None
        if pulled != tokens:
            # The KV is claimed and will be freed on the prefill side; this request cannot use it.
            raise RequestError(
                f"the transferred KV holds {pulled} prompt tokens but this request's prompt has {tokens}",
                c.KV_TRANSFER_PARAMS,
            )

    # -- other endpoints ---------------------------------------------------------------------
    async def models_list(self, request: web.Request) -> web.Response:
        cfg = self.config
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "vllm",
                        "root": cfg.model_dir,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{uuid.uuid4().hex}",
                                "object": "model_permission",
                                "created": self.created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        _ = self.engine  # 503 when the step loop is not running
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        """GET /version: vLLM's ``{"version": ...}``, of the vLLM release this node emulates."""
        return web.json_response({"version": EMULATED_VLLM_VERSION})

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize as vLLM 0.32 answers it (``serve/tokenize``): a ``prompt`` is encoded
        with special tokens unless ``add_special_tokens`` is false; ``messages`` are rendered
        with the chat template and encoded without them unless it is true."""
        body = _json_object(await request.read())
        self._check_model(body)
        add_special = body.get("add_special_tokens")
        if add_special is not None and not isinstance(add_special, bool):
            raise RequestError("add_special_tokens must be a boolean", "add_special_tokens")
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise RequestError("messages must be an array", "messages")
            text = self.tokenizer.render_chat(
                messages,
                body.get("add_generation_prompt", True) is not False,
                continue_final_message=body.get("continue_final_message") is True,
                tools=body.get("tools"),
                template_kwargs=body.get("chat_template_kwargs") or {},
            )
            tokens = self.tokenizer.encode(text, add_special_tokens=add_special is True)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError("prompt must be a string", "prompt")
            tokens = self.tokenizer.encode(prompt, add_special_tokens=add_special is not False)
        strs = None
        if body.get("return_token_strs") is True:
            strs = [self.tokenizer.raw_tokenizer.id_to_token(t) for t in tokens]
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize: ``{"prompt": text}`` for ``tokens`` (special tokens kept, as vLLM)."""
        body = _json_object(await request.read())
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_is_int(t) and t >= 0 for t in tokens):
            raise RequestError("tokens must be an array of non-negative integers", "tokens")
        bad = next((t for t in tokens if t >= self.tokenizer.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is out of vocabulary", "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model and model != self.config.model:  # vLLM serves an empty name as its own model
            raise NotFoundError(f"The model `{model}` does not exist.")

    async def metrics_text(self, request: web.Request) -> web.Response:
        rt = self.engine
        e, labels = rt.engine, self.metrics.labels
        self.metrics.running.labels(**labels).set(len(e.prefilling) + len(e.decoding) + len(e.joining))
        self.metrics.waiting.labels(**labels).set(len(e.waiting) + rt.pending_transfers + self._transferring)
        self.metrics.kv_usage.labels(**labels).set(e.kv_used / e.config.kv_capacity_tokens)
        self.metrics.step_budget_overruns.inc(rt.step_budget_overruns - self.metrics.overruns_exported)
        self.metrics.overruns_exported = rt.step_budget_overruns
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def state(self, request: web.Request) -> web.Response:
        snap = self.engine.engine.snapshot()
        state = c.EngineState(
            decode_tokens=snap.decode_tokens,
            kv_tokens=snap.kv_tokens,
            kv_capacity_tokens=snap.kv_capacity_tokens,
            queued_prefill_tokens=snap.queued_prefill_tokens,
            scheduled_prefill_tokens=snap.scheduled_prefill_tokens,
            max_step_tokens=snap.max_step_tokens,
            model=self.config.model,
            step_calibration=snap.step_calibration,
            pending_kv_pull_tokens=tuple(self._pulls) if self.config.role is Role.DECODE else None,
            scheduled_prefill_computed_tokens=snap.scheduled_prefill_computed_tokens,
            tpot_slo_ms=None if snap.tpot_slo_s is None else snap.tpot_slo_s * 1e3,
            queued_prefill_computed_tokens=snap.queued_prefill_computed_tokens,
        )
        return web.Response(text=c.encode_engine_state(state), content_type="application/json")

    async def steps(self, request: web.Request) -> web.Response:
        try:
            since = c.parse_steps_since(request.query.get(c.STEPS_SINCE, "0"))
        except ValueError as exc:
            raise RequestError(str(exc), c.STEPS_SINCE) from None
        rt = self.engine
        page = c.encode_steps_page(self.config.node_id, rt.engine.step_index, rt.steps_since(since))
        return web.Response(text=page, content_type="application/json")


# ---------------------------------------------------------------------------------------------
# Response bodies (vLLM's shapes)
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Output:
    """One prompt's answer: its ``n`` sequences (vLLM's child requests), by choice index."""

    parsed: ParsedRequest
    rid: str
    model: str
    created: int
    words: tuple[str, ...]  # the text of output token i is words[(i - 1) % len(words)]
    seqs: list[EngineSeq] = field(default_factory=list)
    streams: list[TokenStream] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # output tokens produced so far
    last_at: list[float | None] = field(default_factory=list)  # model time of the latest token
    cached: list[int] = field(default_factory=list)  # prompt tokens found cached (or transferred)
    created_cache: list[int] = field(default_factory=list)  # prompt tokens written to the cache
    details: bool = False  # --enable-prompt-tokens-details: usage says what was cached
    first: int | None = None  # the sequence whose first token came first
    finished: list[int] = field(default_factory=list)  # the sequences in the order they finished

    def add(self, seq: EngineSeq, stream: TokenStream, cached: int, created_cache: int) -> None:
        self.seqs.append(seq)
        self.streams.append(stream)
        self.tokens.append(0)
        self.last_at.append(None)
        self.cached.append(cached)
        self.created_cache.append(created_cache)

    @property
    def chat(self) -> bool:
        return self.parsed.kind == "chat"

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.rid}"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, streamed: bool = False) -> dict[str, Any]:
        p, generated = self.parsed.prompt_tokens, sum(self.tokens)  # the prompt once, every choice's tokens
        return {
            "prompt_tokens": p,
            "total_tokens": p + generated,
            "completion_tokens": generated,
            "prompt_tokens_details": self._details(streamed),
        }

    def _details(self, streamed: bool) -> dict[str, Any] | None:
        """vLLM 0.32's ``PromptTokenUsageInfo`` as its handlers fill and dump it: chat sets the
        cached and the created tokens, completions only the cached ones; a response is dumped
        whole, a stream's chunk with its unset fields left out. With n > 1 they are one child
        request's: a stream's first output's, a response's last to finish (its final output)."""
        if not self.details or not self.seqs:
            return None
        if streamed:
            reporter = 0 if self.first is None else self.first
        else:
            reporter = self.finished[-1] if self.finished else len(self.seqs) - 1
        cached = self.cached[reporter]
        if self.chat:
            return {"cached_tokens": cached, "created_cache_tokens": self.created_cache[reporter],
                    "multimodal_tokens": None}  # fmt: skip
        if streamed:
            return {"cached_tokens": cached}
        return {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}

    def word(self, index: int) -> str:
        return self.words[(index - 1) % len(self.words)]

    def _finish(self, choice: int) -> str:
        return "length" if self.tokens[choice] >= self.parsed.max_tokens else "abort"

    def response(self, kv_params: dict[str, Any] | None) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for j, tokens in enumerate(self.tokens):
            text = "".join(self.word(i) for i in range(1, tokens + 1))
            if self.chat:
                message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": []}
                choices.append(
                    {
                        "index": j,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": self._finish(j),
                        "stop_reason": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": j,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": self._finish(j),
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                )
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": self.usage(),
            "prompt_logprobs": None,
            c.KV_TRANSFER_PARAMS: kv_params,
        }

    def role_chunk(self, choice: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": choice, "delta": delta, "logprobs": None, "finish_reason": None}],
        }

    def token_chunk(self, event: TokenEvent, choice: int) -> dict[str, Any]:
        finish = "length" if event.last else None
        if self.chat:
            delta: dict[str, Any] = {
                "index": choice,
                "delta": {"content": self.word(event.index)},
                "logprobs": None,
                "finish_reason": finish,
            }
            if finish:
                delta["stop_reason"] = None
            return {**self._head("chat.completion.chunk"), "choices": [delta]}
        text = {
            "index": choice,
            "text": self.word(event.index),
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
        # No "usage" key: vLLM writes a chunk with exclude_unset, and sets usage only on the
        # usage chunk (or with continuous_usage_stats, which the emulated node does not serve).
        return {**self._head("text_completion"), "choices": [text]}

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(streamed=True)}


async def _token_events(outs: Sequence[_Output]) -> AsyncIterator[tuple[int, int, TokenEvent]]:
    """Every sequence's tokens as the engine produces them: (prompt, choice, event). One
    sequence (no batch, n 1) is read directly; several through one queue, in the order they come."""
    streams = [(i, j, stream) for i, out in enumerate(outs) for j, stream in enumerate(out.streams)]
    if len(streams) == 1:
        i, j, stream = streams[0]
        async for event in stream:
            yield i, j, event
        return
    queue: asyncio.Queue[tuple[int, int, TokenEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, j: int, stream: TokenStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((i, j, event))
        except Exception as exc:  # EngineStoppedError: the reader raises it
            queue.put_nowait((i, j, exc))
        else:
            queue.put_nowait((i, j, None))

    pumps = [asyncio.create_task(pump(i, j, stream)) for i, j, stream in streams]
    try:
        for _ in range(len(streams)):
            while True:
                i, j, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield i, j, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def one_token_words(tokenizer: PromptTokenizer) -> tuple[str, ...]:
    """Up to ``_WORD_COUNT`` words (a leading space and letters) that ``tokenizer`` encodes as one
    token each, lowest token id first; ``_WORDS`` when it holds none. Clients that count output
    tokens by re-tokenizing each streamed chunk (inference-perf's ITL does) then count one token
    per chunk, as against vLLM."""
    raw = tokenizer.raw_tokenizer
    words: list[str] = []
    for token_id in range(tokenizer.vocab_size):
        text = raw.decode([token_id])
        word = len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
        if word and raw.encode(text, add_special_tokens=False).ids == [token_id]:
            words.append(text)
            if len(words) == _WORD_COUNT:
                break
    return tuple(words) or _WORDS


def _single_token_ids(tokenizer: PromptTokenizer, words: Sequence[str]) -> tuple[int, ...] | None:
    """Each word's one token id, or None when some word is not one token (the fallback words):
    then only the prompt's blocks are cached."""
    raw = tokenizer.raw_tokenizer
    encoded = [raw.encode(w, add_special_tokens=False).ids for w in words]
    return tuple(e[0] for e in encoded) if all(len(e) == 1 for e in encoded) else None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"))  # strict UTF-8: surrogate bytes are not text
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------------
# Request extensions
# ---------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _vllm_xargs(value: Any) -> dict[str, Any]:
    """``vllm_xargs`` as vLLM's request schema hands them to its plugins: ``dict[str, str | int |
    float | list[str | int | float]]`` in pydantic's lax mode, which turns a boolean into an int
    (``[true]`` is the schedule ``[1]``). vLLM refuses any other value before a plugin sees it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{c.VLLM_XARGS} must be an object", c.VLLM_XARGS)
    return {key: _xarg_value(key, v) for key, v in value.items()}


def _xarg_value(key: str, value: Any) -> Any:
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(x, str | int | float) for x in items):
        param = f"{c.VLLM_XARGS}.{key}"
        raise RequestError(f"{param} must be a string, a number or an array of them, got {_dumps(value)}", param)
    coerced = [int(x) if isinstance(x, bool) else x for x in items]
    return coerced if isinstance(value, list) else coerced[0]


# vLLM's SamplingParams._verify_extra_args: its engine transport (MessagePack) carries 64-bit
# integers only. The " (parameter=extra_args)" is how VLLMValidationError renders its parameter.
_EXTRA_ARGS_RANGE = "extra_args integers must be between -2**63 and 2**64 - 1. (parameter=extra_args)"


class _VllmValidationError(Exception):
    """A request vLLM refuses with its own ``VLLMValidationError`` (answered by :func:`_vllm_rejection`)."""

    def __init__(self, message: str, param: str | None = None, *, in_engine: bool = False) -> None:
        super().__init__(message)
        self.message, self.param = message, param
        self.in_engine = in_engine  # raised as the engine takes the request: a stream's 200 is out


def _check_extra_args(*values: Any) -> None:
    """vLLM's range check over the request's extra_args (its vllm_xargs and kv_transfer_params)."""
    pending = list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise _VllmValidationError(_EXTRA_ARGS_RANGE, "extra_args")
        if isinstance(value, dict):
            pending.extend((*value.keys(), *value.values()))
        elif isinstance(value, list):
            pending.extend(value)


async def _vllm_rejection(
    request: web.Request, as_event: bool, rid: str, exc: _VllmValidationError
) -> web.StreamResponse:
    """vLLM 0.32's answer to a ``VLLMValidationError`` (``create_error_response``; a logits
    processor's ValueError in ``validate_params`` becomes one): a 400 with its error body, compact
    JSON as its JSONResponse writes it; a streamed request refused by the engine has had its 200 and
    headers sent, so it gets that body as its one event (``json.dumps``' default spacing)."""
    body = {"error": {"message": exc.message, "type": "BadRequestError", "param": exc.param, "code": 400}}
    if not as_event:
        return web.Response(status=400, body=_dumps(body).encode(), content_type="application/json")
    resp = web.StreamResponse(headers={**_SSE_HEADERS, c.H_REQUEST_ID: rid})
    await resp.prepare(request)
    await resp.write(f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode())
    await resp.write_eof()
    return resp


def _check_pull_params(params: dict[str, Any], prompt_tokens: int) -> None:
    """A decode hop's kv_transfer_params must say where the KV is, for this very prompt."""

    def bad(name: str, what: str) -> RequestError:
        return RequestError(f"{c.KV_TRANSFER_PARAMS}.{name} {what}", f"{c.KV_TRANSFER_PARAMS}.{name}")

    if not isinstance(params.get("remote_engine_id"), str) or not params["remote_engine_id"]:
        raise bad("remote_engine_id", "must be a non-empty string")
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(x) for x in ids):
        raise bad("remote_block_ids", "must be a non-empty array of integers")
    if not isinstance(params.get("remote_host"), str) or not params["remote_host"]:
        raise bad("remote_host", "must be a non-empty string")
    port = params.get("remote_port")
    if not _is_int(port) or not 0 < port < 65536:
        raise bad("remote_port", "must be a port number")
    rid = params.get("remote_request_id")
    if rid is not None and not isinstance(rid, str):
        raise bad("remote_request_id", "must be a string")
    claimed = params.get("kairos_prompt_tokens")
    if claimed is not None and claimed != prompt_tokens:
        raise bad(
            "kairos_prompt_tokens",
            f"is {claimed} but this request's prompt has {prompt_tokens} tokens: the prefill ran another prompt",
        )


# ---------------------------------------------------------------------------------------------
# Application
# ---------------------------------------------------------------------------------------------
def _http_error(request: web.Request, exc: web.HTTPException) -> KairosError:
    if exc.status == 404:
        return NotFoundError(f"no such endpoint: {request.method} {request.path}")
    if exc.status == 413:
        return PayloadTooLargeError(f"request body is over the limit: {exc.text or exc.reason}")
    return InvalidRequestError(exc.text or exc.reason)


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error is answered with the OpenAI error JSON of kairos.common.http_errors."""
    try:
        try:
            return await handler(request)
        except EngineStoppedError as exc:
            raise NoHealthyNodeError(str(exc)) from None
    except KairosError as exc:
        status = error_status(exc)
        level = logging.WARNING if status >= 500 else logging.DEBUG
        log.log(level, "%s %s -> %d %s: %s", request.method, request.path, status, exc.code, exc.message)
        return web.Response(status=status, body=error_json(exc), content_type="application/json")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if isinstance(exc, web.HTTPMethodNotAllowed):
            # No error code maps to 405: keep the status, give the body OpenAI's shape.
            body = error_body(InvalidRequestError(f"method {request.method} is not allowed on {request.path}"))
            return web.json_response(body, status=405, headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
        err = _http_error(request, exc)
        return web.Response(status=error_status(err), body=error_json(err), content_type="application/json")
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        log.exception("%s %s: internal error", request.method, request.path)
        return web.Response(status=500, body=error_json(exc), content_type="application/json")


def build_app(config: EmulatedNodeConfig) -> web.Application:
    """The node's aiohttp application. Loads the tokenizer and profile now; the engine loop
    starts with the application (it needs the running event loop)."""
    node = EmulatedNode(config, PromptTokenizer.from_dir(config.model_dir), load_profile(config.profile))
    # aiohttp itself refuses larger bodies with 413 before reading them.
    app = web.Application(middlewares=[_errors], client_max_size=config.max_body_bytes)
    app[NODE_KEY] = node

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        await node.start()
        yield
        await node.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post(COMPLETIONS_PATH, node.completions)
    app.router.add_post(CHAT_COMPLETIONS_PATH, node.completions)
    app.router.add_get(MODELS_PATH, node.models_list)
    app.router.add_get(HEALTH_PATH, node.health)
    app.router.add_get("/version", node.version)
    app.router.add_post("/tokenize", node.tokenize)
    app.router.add_post("/detokenize", node.detokenize)
    app.router.add_get("/metrics", node.metrics_text)
    app.router.add_get(c.STATE_PATH, node.state)
    app.router.add_get(c.STEPS_PATH, node.steps)
    app.router.add_post(KV_PULL_PATH, node.kv_pull)
    return app


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
ENV_PREFIX = "KAIROS_EMU_"
EMULATED_VLLM_VERSION = "0.32.0"  # the vLLM release whose wire behaviour this node follows


def build_parser() -> argparse.ArgumentParser:
    p = SERVICE.parser()
    p.add_argument("--node-id", dest="node_id")
    p.add_argument("--role", choices=[r.value for r in Role])
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--model-dir", dest="model_dir", help="model directory holding tokenizer.json")
    p.add_argument("--model", "--served-model-name", dest="model", help="served model id (default: --model-dir)")
    p.add_argument("--profile", help=f"latency profile name or JSON path (default {DEFAULT_PROFILE})")
    p.add_argument("--max-model-len", dest="max_model_len", type=int)
    p.add_argument("--max-step-tokens", "--max-num-batched-tokens", dest="max_step_tokens", type=int)
    p.add_argument("--kv-capacity-tokens", dest="kv_capacity_tokens", type=int)
    p.add_argument("--max-running", "--max-num-seqs", dest="max_running", type=int)
    p.add_argument("--time-scale", dest="time_scale", type=float, help="10 = ten times faster than real time")
    p.add_argument("--kv-hold-timeout-s", dest="kv_hold_timeout_s", type=float, help="wall seconds (vLLM: 480)")
    p.add_argument(
        "--keep-alive-timeout-s",
        dest="keep_alive_timeout_s",
        type=float,
        help="wall seconds an idle kept-alive connection stays open (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5)",
    )
    p.add_argument("--max-body-bytes", dest="max_body_bytes", type=int)
    p.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's prefix caching (default on; --no-enable-prefix-caching turns it off)",
    )
    p.add_argument("--block-size", dest="block_size", type=int, help="tokens per KV block (default 16)")
    p.add_argument(
        "--enable-prompt-tokens-details",
        dest="enable_prompt_tokens_details",
        action="store_true",
        default=None,
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    p.add_argument("--kv-events-config", dest="kv_events_config", help="vLLM's KVEventsConfig as JSON")
    return p


def app_runner(config: EmulatedNodeConfig) -> web.AppRunner:
    """The node's application, served as vLLM serves: idle connections closed after
    ``keep_alive_timeout_s``, a request whose client leaves aborted (vLLM's
    ``with_cancellation``: a non-streaming one too, which has no byte to fail on before its end),
    and request heads read up to vLLM's limits."""
    return web.AppRunner(
        build_app(config),
        access_log=None,
        keepalive_timeout=config.keep_alive_timeout_s,
        handler_cancellation=True,
        max_line_size=VLLM_MAX_HEAD_BYTES,  # one header may take the whole head
        max_field_size=VLLM_MAX_HEAD_BYTES,
        max_headers=VLLM_MAX_HEADERS,
    )


async def serve(config: EmulatedNodeConfig, stop: asyncio.Event) -> None:
    async with serving(app_runner(config), config.host, config.port) as (host, port):
        announce_listening(host, port)
        await stop.wait()
        log.info("node %s: signal received, shutting down", config.node_id)


SERVICE = Service(
    "emulated-node",
    "An emulated vLLM node: vLLM's OpenAI API over the Kairos engine model, in wall time.",
    EmulatedNodeConfig,
    None,
    ENV_PREFIX,
    serve,
)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return SERVICE.run(args, flag_overrides(args))


if __name__ == "__main__":
    sys.exit(main())
