"""The emulated node (:class:`EmulatedNode`): its engine in wall time, and its completions, each
run in one of four ways (plain, deflected, prefill hop, decode hop) and answered as vLLM does."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web

from kairos.api import batch
from kairos.api.openai_request import ParsedRequest, RequestError, RequestLimits, parse_request
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.block_hash import block_keys
from kairos.common.contracts import Role
from kairos.common.contracts.split_refusal import (
    SPLIT_CONNECTOR,
    describe_connector,
    is_split_decode_hop,
    split_refusal,
)
from kairos.common.errors import NoHealthyNodeError
from kairos.common.http_errors import error_body
from kairos.core.calibration import StepCalibration, prior_from_mape
from kairos.core.latency import LatencyModels
from kairos.sim.emulated_vllm.config import PULL_KEEPALIVE_S, PULL_TIMEOUT_S, EmulatedNodeConfig
from kairos.sim.emulated_vllm.endpoints import VllmEndpoints
from kairos.sim.emulated_vllm.kv_transfer import HeldKV, KvTransfer, PendingPull
from kairos.sim.emulated_vllm.metrics import Metrics
from kairos.sim.emulated_vllm.reports import NodeReports
from kairos.sim.emulated_vllm.responses import (
    SSE_HEADERS,
    Output,
    dumps,
    one_token_words,
    single_token_ids,
    sse,
    token_events,
)
from kairos.sim.emulated_vllm.validation import (
    VllmValidationError,
    check_extra_args,
    check_pull_params,
    is_int,
    vllm_rejection,
    vllm_xargs,
)
from kairos.sim.engine import Engine, EngineConfig, model_step_time
from kairos.sim.engine import Sequence as EngineSeq
from kairos.sim.kv_event_publisher import KvEventPublisher
from kairos.sim.realtime import EngineStoppedError, RealtimeEngine, TokenEvent

log = logging.getLogger(__package__)

TOKENIZE_INLINE_BYTES = 16_384  # larger bodies are tokenized in a thread: the step loop keeps its timing


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one inference request runs on this node."""

    mode: Literal["plain", "deflect", "remote_decode", "remote_prefill"]  # remote_decode = prefill hop 1
    schedule: tuple[int, ...] = ()  # deflect, and a split's decode hop: the prompt's rest
    step_budget_s: float | None = None
    kv_params: dict[str, Any] | None = None
    pull_tokens: int = 0  # remote_prefill: the prompt's leading tokens pulled (fewer than all: a split)
    tpot_slo_s: float | None = None  # its TPOT SLO (vllm_xargs kairos_tpot_slo_ms; None: the cluster's)


class EmulatedNode(KvTransfer, VllmEndpoints, NodeReports):
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
        self.word_ids = single_token_ids(tokenizer, self.words)
        self.engine_id = f"{config.node_id}-{uuid.uuid4().hex[:12]}"  # vLLM's per-engine id, new per start
        self.metrics = Metrics.create(config.model)
        self.created = int(time.time())
        self.rt: RealtimeEngine | None = None
        self.http: aiohttp.ClientSession | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{config.node_id}-tokenize")
        self._held: dict[int, HeldKV] = {}  # by first block id (unique per node run)
        self._block_ids = itertools.count()
        self._transferring = 0  # decode node: pulls in their transfer wait (vLLM counts them as waiting)
        # decode node: each KV pull from its arrival until its transfer ends, FIFO (waiting for KV
        # room, for the link, or transferring): what its heartbeat reports
        self._pulls: list[PendingPull] = []
        self._pull_started: float | None = None  # decode node: when the transfer holding the link began (model time)
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
        except VllmValidationError as exc:
            log.debug("request %s: %s", rid, exc.message)
            return await vllm_rejection(request, parsed.stream and exc.in_engine, rid, exc)
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
        outs: list[Output] = []
        try:
            for i, (part, plan) in enumerate(zip(prompts, plans, strict=True)):
                outs.append(Output(part, rid, self.config.model, created, self.words))
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
        return web.json_response(answer, headers={c.H_REQUEST_ID: rid}, dumps=dumps)

    async def _start(self, out: Output, plan: _Plan, seq_id: str) -> None:
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
                    schedule=plan.schedule,
                    step_budget_s=plan.step_budget_s,
                    tpot_slo_s=plan.tpot_slo_s,
                    block_hashes=hashes,
                    token_ids=ids,
                )
                # With n > 1 each of vLLM's child requests reads the one prefill's blocks; the
                # prefill node frees them at the first read's notification (claimed once here).
                stream = await self._pull_kv(seq, plan.kv_params or {}, plan.pull_tokens, seq_id, claim=j == 0)
                # What vLLM counts cached here: its hit and the transfer; a split computes the rest.
                own = max(seq.cached_hit, plan.pull_tokens)
                self.metrics.add_prompt(parsed.prompt_tokens - own, seq.cached_hit, own - seq.cached_hit)
                # vLLM's decode side reports the prefill node's hit, which the prefill hop passed on.
                remote = (plan.kv_params or {}).get("remote_prefill_cached_tokens")
                cached = remote if is_int(remote) else own
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
        (:class:`VllmValidationError` where vLLM itself refuses it, as vLLM answers)."""
        body, role = parsed.body, self.config.role
        params = body.get(c.KV_TRANSFER_PARAMS)
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{c.KV_TRANSFER_PARAMS} must be an object", c.KV_TRANSFER_PARAMS)
        params = params or {}
        remote_decode, remote_prefill = params.get("do_remote_decode") is True, params.get("do_remote_prefill") is True
        xargs = vllm_xargs(body.get(c.VLLM_XARGS))
        check_extra_args(xargs, params)
        try:
            chunk_plan = c.parse_schedule_xargs(xargs)  # what the validator plugin runs in vLLM
            tpot_s = c.parse_tpot_xarg(xargs)
        except c.MalformedSchedule as exc:
            raise VllmValidationError(str(exc), in_engine=True) from None
        if not self.config.split_connector and is_split_decode_hop({**xargs, c.KV_TRANSFER_PARAMS: params}):
            # The validator plugin's refusal on a node whose vLLM runs stock NixlConnector.
            raise VllmValidationError(split_refusal(describe_connector(SPLIT_CONNECTOR, None)), in_engine=True)
        if remote_decode and (remote_prefill or chunk_plan is not None):
            raise RequestError(
                "a prefill hop (do_remote_decode) is neither a decode hop (do_remote_prefill) nor a deflected "
                f"prefill ({c.XARG_CHUNK_SCHEDULE})",
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
            pull = check_pull_params(params, parsed.prompt_tokens)
        if chunk_plan is not None and max(chunk_plan.sizes) > self.config.max_step_tokens:
            # As the scheduler plugin: vLLM's validator cannot see the engine's limit.
            log.warning("chunks over max_step_tokens=%d run capped at it", self.config.max_step_tokens)
        schedule, budget_s = (chunk_plan.sizes, chunk_plan.step_budget_s) if chunk_plan is not None else ((), None)
        if remote_prefill:
            # A split's decode hop carries the schedule of the prompt's rest, which this node
            # prefills after the pulled prefix; a whole prompt's pull has nothing to schedule.
            return _Plan("remote_prefill", schedule, budget_s, params, pull, tpot_slo_s=tpot_s)
        if chunk_plan is not None:
            return _Plan("deflect", schedule=schedule, step_budget_s=budget_s, tpot_slo_s=tpot_s)
        return _Plan("plain", tpot_slo_s=tpot_s)

    async def _drain(self, outs: list[Output], arrival: float) -> None:
        async for i, j, event in token_events(outs):
            self._observe(event, outs[i], j, arrival)

    async def _stream(self, request: web.Request, outs: list[Output], arrival: float) -> web.StreamResponse:
        first = outs[0]
        resp = web.StreamResponse(headers={**SSE_HEADERS, c.H_REQUEST_ID: first.rid})
        many = len(outs) > 1
        merge = batch.StreamMerge(len(outs), first.id, first.created, choices_per_part=first.parsed.n) if many else None

        async def send(prompt: int, chunk: dict[str, Any]) -> None:
            merged = chunk if merge is None else merge.chunk(prompt, chunk)
            if merged is not None:
                await resp.write(sse(merged))

        try:
            await resp.prepare(request)
            # A chat stream's role chunks (one per choice; chat has no batches) go with the first
            # token, as vLLM sends them with the engine's first output: a stream's first event is
            # its first token.
            role = first.chat
            async for i, j, event in token_events(outs):
                self._observe(event, outs[i], j, arrival)
                if role:
                    role = False
                    await resp.write(b"".join(sse(first.role_chunk(k)) for k in range(first.parsed.n)))
                await send(i, outs[i].token_chunk(event, j))
            if first.parsed.include_usage:
                for i, out in enumerate(outs):
                    await send(i, out.usage_chunk())
                if merge is not None and (usage := merge.usage_chunk()) is not None:
                    await resp.write(sse(usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except EngineStoppedError as exc:
            # Headers are gone: end the stream the way vLLM does, with an error event.
            log.warning("request %s: engine stopped mid-stream: %s", first.rid, exc)
            with contextlib.suppress(ConnectionError):
                err = NoHealthyNodeError(f"node {self.config.node_id}: {exc}")
                await resp.write(sse(error_body(err)) + b"data: [DONE]\n\n")
                await resp.write_eof()
        except ConnectionError:
            log.info(
                "request %s: client disconnected after %d of %d tokens",
                first.rid,
                sum(sum(out.tokens) for out in outs),
                sum(out.parsed.max_tokens * out.parsed.n for out in outs),
            )
        return resp

    def _observe(self, event: TokenEvent, out: Output, choice: int, arrival: float) -> None:
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
