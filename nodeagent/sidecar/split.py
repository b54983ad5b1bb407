"""The split route: the dispatcher's split headers read and checked, the prompt's token ids (from the
body, or the local vLLM's ``/tokenize``, so they are exactly what this node's vLLM will see), the
prefill hop of the prompt's first k tokens, and the decode hop that pulls their KV and prefills
the rest under the chunk schedule.

A prompt whose token count here differs from the dispatcher's (their tokenizers, or chat
templates, disagree), or that is no one prompt, is no split: the request degrades to a keep, its
whole prompt through hop 1, and is counted (``kairos_sidecar_split_degraded_total``); it never
fails for it. So does a split whose decode hop the local vLLM refuses because it does not load
Kairos's split connector (:func:`is_split_refused`: the validator plugin's 400, before any byte
of it reaches the client)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import hdrs
from multidict import CIMultiDict, CIMultiDictProxy

from kairos.common import contracts as c
from kairos.common.contracts._checks import is_int
from kairos.common.contracts.api import CHAT_COMPLETIONS_PATH, TOKENIZE_PATH
from kairos.common.contracts.split_refusal import is_split_refusal
from kairos.common.http_errors import UpstreamError
from kairos.nodeagent.http1 import Http1Error
from kairos.nodeagent.sidecar.hop1 import ERROR_SNIPPET, HOP1_KV_TRANSFER_PARAMS, bad_routing
from kairos.nodeagent.sidecar.hop2 import scheduled_body
from kairos.nodeagent.sidecar.hygiene import dumps, loads
from kairos.nodeagent.sidecar.metrics import SPLIT_PROMPT_MISMATCH, SPLIT_TOKENIZE_FAILED, SPLIT_UNSUPPORTED_PROMPT
from kairos.nodeagent.sidecar.state import State, count

log = logging.getLogger(__package__)

# The chat request's fields that shape its rendered prompt, which vLLM's /tokenize takes as its
# chat completion does (vLLM 0.32's TokenizeChatRequest): sent as the client sent them.
CHAT_TEMPLATE_FIELDS = (
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
# Fields with which vLLM runs another prompt than the one tokenized (it keeps the prompt's last
# N tokens): the prefill node's first k would not be the decode node's, so such a request is no split.
PROMPT_REWRITING_FIELDS = ("truncate_prompt_tokens",)
# The start of a stream's event: what a refused stream's one event follows.
_SSE_DATA = b"data:"
# The client's fields a split's hop 1 keeps: where it queues (priority), whose cache it may hit
# (cache_salt), and its own vllm_xargs (kairos_* already scrubbed), as a keep's hop 1 carries them.
HOP1_CLIENT_FIELDS = ("priority", "cache_salt", c.VLLM_XARGS)


@dataclass(frozen=True, slots=True)
class SplitRoute:
    """A split's headers: the prompt's first ``split_tokens`` on the prefill node, the rest here."""

    split_tokens: int  # k
    schedule: tuple[int, ...]  # the prompt's rest, per step (sums to prompt_tokens - k)
    step_budget_ms: float | None
    prompt_tokens: int  # the dispatcher's count, l


class SplitDegraded(Exception):
    """The request cannot be split here: it is served as a keep instead (``reason``: a
    ``kairos_sidecar_split_degraded_total`` label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def parse_split_route(headers: Mapping[str, str]) -> SplitRoute:
    """The split's headers, checked against each other: :class:`~kairos.common.contracts.MalformedSchedule`
    for a missing or malformed k or schedule, a malformed step budget or prompt count, k not
    below the prompt, or a schedule that does not cover the prompt's rest. Without
    ``x-kairos-prompt-tokens`` the dispatcher's count is k plus its schedule."""
    raw_k, raw_schedule = headers.get(c.H_SPLIT_TOKENS), headers.get(c.H_CHUNK_SCHEDULE)
    if raw_k is None or raw_schedule is None:
        missing = c.H_SPLIT_TOKENS if raw_k is None else c.H_CHUNK_SCHEDULE
        raise c.MalformedSchedule(f"{c.H_ROUTE}=split without {missing}")
    schedule = c.parse_chunk_schedule_header(raw_schedule)
    raw_budget = headers.get(c.H_STEP_BUDGET_MS)
    budget_ms = None if raw_budget is None else c.parse_step_budget_ms(raw_budget)
    raw_count = headers.get(c.H_PROMPT_TOKENS)
    if raw_count is None:
        k = c.parse_split_tokens(raw_k)
        return SplitRoute(k, schedule, budget_ms, k + sum(schedule))
    if not raw_count.isdecimal() or int(raw_count) < 2:
        raise c.MalformedSchedule(f"{c.H_PROMPT_TOKENS}={raw_count!r} is not a prompt a split can take")
    prompt_tokens = int(raw_count)
    k = c.parse_split_tokens(raw_k, prompt_tokens)
    if sum(schedule) != prompt_tokens - k:
        raise c.MalformedSchedule(
            f"{c.H_CHUNK_SCHEDULE} covers {sum(schedule)} tokens, not the {prompt_tokens - k} after the "
            f"split's {k} of {prompt_tokens}"
        )
    return SplitRoute(k, schedule, budget_ms, prompt_tokens)


def checked_split_route(state: State, headers: CIMultiDictProxy[str], rid: str) -> SplitRoute:
    """:func:`parse_split_route`, a malformed one a bad routing header (502, counted)."""
    try:
        return parse_split_route(headers)
    except c.MalformedSchedule as exc:
        count(state, "2", "bad_routing_headers")
        raise bad_routing(rid, str(exc)) from None


def body_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids (one list of ints, or a batch of one): its ids,
    which vLLM takes as they are; None when the prompt is text, or no one prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt
    return None


def tokenize_request(api_path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` body that gives the ids this request's prompt has on the node's vLLM:
    a chat's messages with its template fields, a completion's text prompt (a batch of one
    too) with its special tokens. :class:`SplitDegraded` for what is no one text prompt."""
    out: dict[str, Any] = {"model": body["model"]} if "model" in body else {}
    if api_path == CHAT_COMPLETIONS_PATH:
        out["messages"] = body.get("messages")
        out["add_generation_prompt"] = body.get("add_generation_prompt", True)
        out.update((name, body[name]) for name in CHAT_TEMPLATE_FIELDS if name in body)
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise SplitDegraded(SPLIT_UNSUPPORTED_PROMPT, "the prompt is neither token ids nor one text")
    out["prompt"] = prompt
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


def parse_tokenize_reply(raw: bytes) -> list[int]:
    """The ids of vLLM's ``/tokenize`` answer (``{"count", "max_model_len", "tokens", ...}``);
    ValueError for anything else."""
    try:
        reply = loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    tokens = reply.get("tokens") if isinstance(reply, dict) else None
    if not isinstance(tokens, list) or not all(is_int(t) and t >= 0 for t in tokens):
        raise ValueError("no list of token ids in it")
    if reply.get("count", len(tokens)) != len(tokens):
        raise ValueError(f"its count {reply.get('count')!r} is not its {len(tokens)} tokens")
    return tokens


def check_split_fits(route: SplitRoute, ids: Sequence[int]) -> None:
    """:class:`SplitDegraded` unless the node's count of the prompt is the dispatcher's (then k is
    below it, as the headers were checked)."""
    if len(ids) != route.prompt_tokens:
        raise SplitDegraded(
            SPLIT_PROMPT_MISMATCH,
            f"the local vLLM counts {len(ids)} prompt tokens where the dispatcher counted {route.prompt_tokens} "
            f"(split at {route.split_tokens})",
        )


async def prompt_token_ids(
    state: State, api_path: str, body: dict[str, Any], headers: CIMultiDict[str], route: SplitRoute
) -> list[int]:
    """The prompt's token ids as this node's vLLM sees them, checked against the split:
    :class:`SplitDegraded` when they cannot be had or do not fit it."""
    rewriting = [name for name in PROMPT_REWRITING_FIELDS if body.get(name) is not None]
    if rewriting:
        raise SplitDegraded(SPLIT_UNSUPPORTED_PROMPT, f"{rewriting[0]} makes vLLM run another prompt than its own")
    ids = body_token_ids(body) if api_path != CHAT_COMPLETIONS_PATH else None
    if ids is None:
        ids = await _tokenize(state, tokenize_request(api_path, body), headers)
    check_split_fits(route, ids)
    return ids


async def _tokenize(state: State, tokenize_body: dict[str, Any], headers: CIMultiDict[str]) -> list[int]:
    """The local vLLM's ``/tokenize``, bounded as a prefill hop is (hop1_timeout_s): a node whose
    API server cannot tokenize in that time is no node to split a prefill with."""
    cfg = state.config
    hop_headers = CIMultiDict(headers)  # the client's (its Authorization: vLLM's --api-key guards /tokenize)
    hop_headers[hdrs.CONTENT_TYPE] = "application/json"
    hop_headers[hdrs.ACCEPT_ENCODING] = "identity"  # we parse this reply
    try:
        async with asyncio.timeout(cfg.hop1_timeout_s):
            reply = await state.local.request(
                "POST", cfg.local_vllm, TOKENIZE_PATH, dumps(tokenize_body), hop_headers.items()
            )
    except TimeoutError:
        raise SplitDegraded(SPLIT_TOKENIZE_FAILED, f"/tokenize gave no answer within {cfg.hop1_timeout_s:g}s") from None
    except (Http1Error, OSError) as exc:
        raise SplitDegraded(SPLIT_TOKENIZE_FAILED, f"/tokenize failed: {exc!r}") from None
    if reply.status != 200:
        snippet = reply.body[:ERROR_SNIPPET].decode("utf-8", "replace")
        raise SplitDegraded(SPLIT_TOKENIZE_FAILED, f"/tokenize answered {reply.status}: {snippet}")
    try:
        return parse_tokenize_reply(reply.body)
    except ValueError as exc:
        raise SplitDegraded(SPLIT_TOKENIZE_FAILED, f"/tokenize's answer is malformed: {exc}") from None


def split_hop1_body(body: Mapping[str, Any], prefix: Sequence[int]) -> dict[str, Any]:
    """A split's hop 1 (a completions body whatever the client's endpoint: its prompt is token
    ids): the prefill of the prompt's first k tokens, its KV held for this node to pull."""
    out: dict[str, Any] = {"model": body["model"]} if "model" in body else {}
    out.update(prompt=list(prefix), max_tokens=1, stream=False)
    out.update((name, body[name]) for name in HOP1_CLIENT_FIELDS if name in body)
    out[c.KV_TRANSFER_PARAMS] = dict(HOP1_KV_TRANSFER_PARAMS)
    return out


def checked_split_params(state: State, params: dict[str, Any], route: SplitRoute, prefill_host: str) -> None:
    """The prefill node must say it computed the prompt's first k tokens (``remote_num_tokens``,
    as vLLM 0.32's connector does; fewer is its own back-off, which this node prefills too):
    otherwise this node cannot tell what to pull, an :class:`UpstreamError` (hop 1 failed)."""
    computed = params.get("remote_num_tokens")
    if not (is_int(computed) and 0 < computed <= route.split_tokens):
        count(state, "1", "split_tokens_mismatch")
        raise UpstreamError(
            f"prefill node {prefill_host} computed remote_num_tokens={computed!r} of the split's first "
            f"{route.split_tokens} tokens"
        )


def split_decode_body(body: dict[str, Any], params: dict[str, Any], route: SplitRoute) -> dict[str, Any]:
    """The split's hop 2: the client's body (its whole prompt), the prefill node's
    ``kv_transfer_params`` (its KV of the first k tokens) and the schedule of the rest."""
    return scheduled_body({**body, c.KV_TRANSFER_PARAMS: params}, route.schedule, route.step_budget_ms)


def is_split_refused(status: int, raw: bytes) -> bool:
    """Whether the local vLLM's answer to a split's decode hop (its status and its JSON body, or
    a stream's first event) is the validator plugin's refusal of a split on a node without
    Kairos's split connector: vLLM's 400, or, on a streamed request, its 200 whose one event is
    that error (vLLM validates a stream's request after its headers are out)."""
    if status == 200:
        event = raw.split(b"\n\n", 1)[0]
        if not event.startswith(_SSE_DATA):
            return False
        raw = event[len(_SSE_DATA) :]
    elif status != 400:
        return False
    try:
        reply = loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    error = reply.get("error") if isinstance(reply, dict) else None
    return isinstance(error, dict) and error.get("code") == 400 and is_split_refusal(error.get("message"))
