"""Parse and validate OpenAI ``/v1/completions`` and ``/v1/chat/completions`` bodies at the gateway.

The dispatcher needs the prompt's token count and the output cap before it routes, and a
request vLLM would reject must be rejected here with vLLM's reason, not routed to a node (a
routed request reserves capacity in the cluster view). Semantics follow vLLM's OpenAI server:

- completions: ``max_tokens`` absent means ``default_max_tokens`` (16); ``null`` means "up to the
  context length"; a string prompt counts its BOS.
- chat: ``max_completion_tokens`` wins over ``max_tokens``; neither means
  ``max_model_len - prompt_tokens``; ``add_generation_prompt``, ``continue_final_message``,
  ``add_special_tokens``, ``chat_template_kwargs`` and ``tools`` shape the rendered prompt.
- ``prompt_tokens + max_tokens`` must fit in ``max_model_len``.
- ``n`` (choices per prompt) is an integer from 1 to vLLM's ``VLLM_MAX_N_SEQUENCES``, and 1
  under greedy sampling (``temperature`` 0).

A batch (a completions ``prompt`` holding several strings or token-id lists) is parsed as one
request per prompt (:attr:`ParsedRequest.parts`), each checked as vLLM checks it, in order: one
routing decision places one prefill, so the gateway fans a batch out (:mod:`kairos.api.batch`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kairos.api import batch
from kairos.api.tokenizer import PromptTokenizer, json_type, text_part_key
from kairos.common import defaults
from kairos.common.config import setting
from kairos.common.contracts.api import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH
from kairos.common.errors import (  # NotFoundError: re-exported, callers know it from here
    ConfigError,
    InvalidRequestError,
    NotFoundError,
)

RequestKind = Literal["completion", "chat"]
_ROUTES: dict[str, RequestKind] = {COMPLETIONS_PATH: "completion", CHAT_COMPLETIONS_PATH: "chat"}
# vLLM's bounds (its VLLM_MAX_COMPLETION_PROMPTS and VLLM_MAX_N_SEQUENCES defaults), and the
# temperature under which it samples greedily (its _SAMPLING_EPS).
MAX_BATCH_PROMPTS = 1024
MAX_N = 16384
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default: logprobs per token a request may ask for
GREEDY_TEMPERATURE = 1e-5


class RequestError(InvalidRequestError):
    """A 400 that names the offending body field in ``param`` (OpenAI's error shape has one)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PayloadTooLargeError(RequestError):
    """The body exceeds ``RequestLimits.max_body_bytes`` (413); checked before parsing any JSON."""

    code = "payload_too_large"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the gateway accepts; ``max_model_len`` must equal the served model's."""

    max_body_bytes: int = setting(
        defaults.MAX_REQUEST_BODY_BYTES, help="larger request bodies are answered 413 before they are parsed"
    )
    max_model_len: int = setting(
        defaults.MAX_MODEL_LEN, help="prompt + output tokens per request: the served model's (vLLM's --max-model-len)"
    )
    # vLLM's default; a chat request uses the rest of the context.
    default_max_tokens: int = setting(16, help="output tokens of a completion that sets no max_tokens")

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_model_len", "default_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"RequestLimits.{name} must be a positive integer, got {value!r}")
        if self.default_max_tokens >= self.max_model_len:
            raise ConfigError(
                f"RequestLimits.default_max_tokens ({self.default_max_tokens}) must be below "
                f"max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request: what the dispatcher decides on, and the body to forward or rewrite."""

    kind: RequestKind
    model: str | None  # the body's "model", if any
    prompt_tokens: int  # exactly what vLLM will count (BOS and chat template included)
    max_tokens: int  # resolved output cap: prompt_tokens + max_tokens <= max_model_len
    stream: bool
    include_usage: bool  # stream_options.include_usage (only meaningful when streaming)
    body: dict[str, Any]  # the parsed JSON object, unchanged
    # The prompt's token ids, when asked for (parse_request's token_ids): what a prefix-cache
    # lookup hashes. None on the count-only path, which never builds them (and for a batch).
    prompt_token_ids: list[int] | None = None
    n: int = 1  # choices per prompt (the body's n, as vLLM reads it)
    # A batch's prompts, each parsed as its own request (its body the batch's with that one
    # prompt), in order; empty for one prompt. A batch's prompt_tokens and max_tokens are the
    # sums of its parts' (vLLM's usage.prompt_tokens of the batch, its output cap).
    parts: tuple[ParsedRequest, ...] = ()
    # vLLM's ``priority`` (an integer, 0 when absent; lower is served first by a node that runs
    # vLLM's priority scheduling): forwarded in the body as sent, and the request's place in the
    # dispatcher's admission line among requests of the same TTFT SLO.
    priority: int = 0


# A UTF-8-encoded surrogate (U+D800..U+DFFF: 0xED then 0xA0..0xBF) is not valid UTF-8, but
# Python's json.loads decodes bytes with "surrogatepass" and lets it through as a lone surrogate.
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _reject_lone_surrogates(data: object) -> None:
    """A string with an unpaired UTF-16 surrogate is valid JSON but not text: no tokenizer (nor
    vLLM) can take it. Say so with a 400 rather than failing inside the tokenizer."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"request body has an unpaired UTF-16 surrogate escape ({exc.object[exc.start : exc.end]!r}): "
            "strings must be valid Unicode text"
        ) from None


def check_body_size(size: int, limits: RequestLimits) -> None:
    """Raise the 413 for a body of ``size`` bytes over ``limits.max_body_bytes``: the one check
    (and message) for a body in hand and for one a Content-Length announces."""
    if size > limits.max_body_bytes:
        raise PayloadTooLargeError(
            f"request body is {size} bytes, over the gateway's limit of {limits.max_body_bytes} bytes"
        )


def parse_request(
    path: str,
    body: bytes,
    tokenizer: PromptTokenizer,
    limits: RequestLimits,
    *,
    stop_over_context: bool = False,
    token_ids: bool = False,
) -> ParsedRequest:
    """Validate one OpenAI request and count its prompt; raise a ``KairosError`` with a code otherwise.

    ``path`` may carry a query string. Long prompts make this take milliseconds: call it from a
    thread pool on an event loop (see ``kairos.api.tokenizer``). ``stop_over_context``: stop
    counting once the prompt is known to exceed ``max_model_len`` (the gateway: a multi-MB
    prompt is refused after its first ~100 KB are counted, not after seconds), so the error
    says "more than" instead of the exact count vLLM would give (the emulated node keeps it).
    ``token_ids``: encode the prompt into its token ids (``prompt_token_ids``), for a
    prefix-cache lookup; the count is their number, and a prompt past the context stops as early.
    """
    route = path.split("?", 1)[0]
    kind = _ROUTES.get(route)
    if kind is None:
        raise NotFoundError(
            f"no such endpoint {route!r}: the gateway serves {COMPLETIONS_PATH} and {CHAT_COMPLETIONS_PATH}"
        )
    check_body_size(len(body), limits)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(f"request body must be a JSON object, got {json_type(data)}")
    if b"\xed" in body and _RAW_SURROGATE.search(body):
        raise RequestError("request body is not valid UTF-8: it holds an encoded UTF-16 surrogate (0xED 0xA0-0xBF)")
    if b"\\ud" in body.lower():  # only a \uD800-\uDFFF escape can produce a lone surrogate
        _reject_lone_surrogates(data)

    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, got {json_type(model)}", "model")
    stream = request_streams(data)
    include_usage = _include_usage(data, stream)

    # Cheap field checks first: a bad max_tokens should not cost a tokenization.
    count_limit = limits.max_model_len if stop_over_context else None
    prompts: list[str | list[int]] = []
    if kind == "completion":
        field, requested = _max_tokens_field(data, ("max_tokens",))
        if field is None and "max_tokens" not in data:
            requested = limits.default_max_tokens  # absent (not null): vLLM's default of 16
        prompts = completion_prompts(data)
        input_param = "prompt"
    else:
        field, requested = _max_tokens_field(data, ("max_completion_tokens", "max_tokens"))
        input_param = "messages"

    def count(prompt: str | list[int] | None) -> tuple[int, int, list[int] | None]:
        """One prompt's tokens, output cap and ids (the chat's messages when ``prompt`` is None)."""
        if prompt is None:
            tokens, ids = _chat_prompt_tokens(data, tokenizer, count_limit, token_ids)
        else:
            tokens, ids = _count_completion_prompt(prompt, len(prompts) > 1, tokenizer, count_limit, token_ids)
        if count_limit is not None and tokens > count_limit:
            raise RequestError(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, your request has "
                f"more than {count_limit} input tokens. Please reduce the length of the input.",
                input_param,
            )
        return tokens, _resolve_max_tokens(tokens, requested, field or "max_tokens", input_param, limits), ids

    priority = request_priority(data)
    counted = [count(p) for p in prompts] if prompts else [count(None)]  # in order: vLLM's first refusal
    n = choices_per_prompt(data)
    check_sampling_params(data, kind, [cap for _, cap, _ in counted], tokenizer.vocab_size)

    def parsed(body: dict[str, Any], tokens: int, cap: int, ids: list[int] | None) -> ParsedRequest:
        return ParsedRequest(kind, model, tokens, cap, stream, include_usage, body, ids, n, priority=priority)

    if len(counted) == 1:
        return parsed(data, *counted[0])
    parts = tuple(parsed(body, *each) for body, each in zip(batch.split(data, prompts), counted, strict=True))
    whole = parsed(data, sum(p.prompt_tokens for p in parts), sum(p.max_tokens for p in parts), None)
    return dataclasses.replace(whole, parts=parts)


# ---------------------------------------------------------------------------------------------
# Field helpers
# ---------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The strings pydantic's lax mode reads as a boolean (vLLM's request schema), in any case.
_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})


def _lax_bool(value: Any) -> bool | None:
    """``value`` as pydantic's lax mode reads a boolean field: a boolean, 0 or 1 (an integer or a
    float), or one of its true/false strings; None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE_STRINGS:
            return True
        if text in _FALSE_STRINGS:
            return False
    return None


def _optional_bool(data: Mapping[str, Any], name: str, default: bool, where: str = "", strict: bool = False) -> bool:
    """A boolean field as vLLM's schema reads it (laxly); ``strict``: a JSON boolean only, for
    values no schema reads (chat_template_kwargs go to the template as sent)."""
    value = data.get(name)
    if value is None:
        return default
    flag = value if isinstance(value, bool) else None if strict else _lax_bool(value)
    if flag is None:
        raise RequestError(f"{where}{name} must be a boolean, got {json_type(value)}", f"{where}{name}")
    return flag


def request_streams(data: Mapping[str, Any]) -> bool:
    """Whether the request asks for a stream, as vLLM reads its ``stream`` field (a 400 if it
    cannot be read as a boolean)."""
    return _optional_bool(data, "stream", False)


def _include_usage(data: Mapping[str, Any], stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {json_type(options)}", "stream_options")
    if not stream:
        raise RequestError("stream_options can only be set when stream is true", "stream_options")
    return _optional_bool(options, "include_usage", False, "stream_options.")


# A string pydantic's lax mode reads as an integer: a sign, ASCII digits (single underscores
# between them) and a fraction of zeros ("5", "+5", "1_000", "5.00"; not "5.", "5.5", "1e3").
_INT_STRING = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0+)?")


def _lax_int(value: Any) -> int | None:
    """``value`` as pydantic's lax mode reads an integer field (vLLM's request schema): an
    integer, a boolean, a float with no fraction, or a string of one; None for anything else."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        text = value.strip()
        return int(text.partition(".")[0].replace("_", "")) if _INT_STRING.fullmatch(text) else None
    return None


def request_priority(data: Mapping[str, Any]) -> int:
    """The request's ``priority`` as vLLM's request schema reads it (``priority: int = 0``, in
    pydantic's lax mode): absent is 0; null or a non-integer is a 400."""
    if "priority" not in data:
        return 0
    priority = _lax_int(data["priority"])
    if priority is None:
        raise RequestError(f"priority must be an integer, got {json_type(data['priority'])}", "priority")
    return priority


def choices_per_prompt(data: Mapping[str, Any]) -> int:
    """The request's ``n``, checked as vLLM checks it (its SamplingParams, after the prompt)."""
    if "n" not in data:
        return 1
    n = _lax_int(data["n"])
    if n is None:
        raise RequestError(f"n must be an integer, got {json_type(data['n'])}", "n")
    if n < 1:
        raise RequestError(f"n must be at least 1, got {n}.", "n")
    if n > MAX_N:
        raise RequestError(f"n must be at most {MAX_N}, got {n}.", "n")
    temperature = _lax_float(data.get("temperature"))  # as vLLM reads it: "0" is greedy too
    if n > 1 and temperature is not None and temperature < GREEDY_TEMPERATURE:
        raise RequestError(f"n must be 1 when using greedy sampling, got {n}.", "n")
    return n


def _max_tokens_field(data: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str | None, int | None]:
    """The first non-null of ``names`` (validated >= 1), or (None, None) when all are null or absent."""
    for name in names:
        value = data.get(name)
        if value is None:
            continue
        tokens = _lax_int(value)
        if tokens is None:
            raise RequestError(f"{name} must be an integer, got {json_type(value)}", name)
        if tokens < 1:
            raise RequestError(f"{name} must be at least 1, got {tokens}", name)
        return name, tokens
    return None, None


def _resolve_max_tokens(
    prompt_tokens: int, requested: int | None, field: str, input_param: str, limits: RequestLimits
) -> int:
    context = limits.max_model_len
    if requested is None:
        if prompt_tokens >= context:
            raise RequestError(
                f"This model's maximum context length is {context} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input.",
                input_param,
            )
        return context - prompt_tokens
    if prompt_tokens + requested > context:
        raise RequestError(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the {input_param}, {requested} in the "
            f"completion). Please reduce the length of the {input_param} or completion.",
            input_param if prompt_tokens >= context else field,
        )
    return requested


# ---------------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------------
_PROMPT_FORMS = "a string, an array of token ids, an array of strings or an array of token-id arrays"


def completion_prompts(data: Mapping[str, Any]) -> list[str | list[int]]:
    """The body's prompts, in order: one, or a batch's several (each form checked, not counted)."""
    if data.get("prompt_embeds") is not None:
        raise RequestError("prompt_embeds is not supported by the gateway; send prompt", "prompt_embeds")
    if "prompt" not in data or data["prompt"] is None:
        raise RequestError("prompt is required", "prompt")
    prompt = data["prompt"]
    if isinstance(prompt, str):
        if not prompt:  # vLLM's schema refuses an empty string prompt, not an empty one in a list
            raise RequestError("prompt is empty", "prompt")
        return [prompt]
    if not isinstance(prompt, list):
        raise RequestError(f"prompt must be {_PROMPT_FORMS}, got {json_type(prompt)}", "prompt")
    if all(_is_int(t) for t in prompt):  # one prompt as token ids ([] included)
        return [prompt]
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise RequestError(f"prompt must be {_PROMPT_FORMS}", "prompt")
    if any(isinstance(p, list) and not all(_is_int(t) for t in p) for p in prompt):
        raise RequestError(f"prompt must be {_PROMPT_FORMS}", "prompt")
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise RequestError(
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_BATCH_PROMPTS}", "prompt"
        )
    return list(prompt)


def _count_completion_prompt(
    prompt: str | list[int], in_list: bool, tokenizer: PromptTokenizer, limit: int | None, want_ids: bool
) -> tuple[int, list[int] | None]:
    """One prompt's token count (and ids, when wanted). ``in_list``: it came in an array, where
    an empty string is a prompt of its special tokens alone (vLLM serves it if it has any)."""
    if isinstance(prompt, list):
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        bad = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"token id {bad} is out of vocabulary (valid ids are 0 to {tokenizer.vocab_size - 1})", "prompt"
            )
    elif not prompt and not in_list:
        raise RequestError("prompt is empty", "prompt")
    if not want_ids:
        count, ids = tokenizer.count_completion_prompt(prompt, limit), None
    else:
        ids = tokenizer.completion_prompt_ids(prompt, limit)
        count, ids = len(ids), (None if limit is not None and len(ids) > limit else ids)
    if count == 0:
        raise RequestError("prompt is empty", "prompt")
    return count, ids


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------------------------
def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise RequestError("messages is required", "messages")
    if not isinstance(messages, list):
        raise RequestError(f"messages must be an array, got {json_type(messages)}", "messages")
    if not messages:
        raise RequestError("messages is empty", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {json_type(message)}", where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"{where}.role is required and must be a non-empty string", f"{where}.role")
        content = message.get("content")
        if content is None:
            # OpenAI: only an assistant message that calls tools may omit its content.
            if role == "assistant" and (message.get("tool_calls") or message.get("function_call")):
                continue
            raise RequestError(f"{where}.content is required", f"{where}.content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(
                f"{where}.content must be a string or an array of content parts, got {json_type(content)}",
                f"{where}.content",
            )
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            key = text_part_key(part, at)
            if not isinstance(part.get(key), str):  # stricter than rendering: a request must carry text
                raise RequestError(f"{at}.{key} must be a string", f"{at}.{key}")
    return messages


def _chat_prompt_tokens(
    data: Mapping[str, Any], tokenizer: PromptTokenizer, limit: int | None, want_ids: bool
) -> tuple[int, list[int] | None]:
    messages = _validate_messages(data.get("messages"))
    extra = data.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise RequestError(f"chat_template_kwargs must be an object, got {json_type(extra)}", "chat_template_kwargs")
    # vLLM refuses request-supplied templates, at either place, unless started with
    # --trust-request-chat-template.
    for where, holder in (("chat_template", data), ("chat_template_kwargs.chat_template", extra or {})):
        if holder.get("chat_template") is not None:
            raise RequestError(f"a {where} in the request is not supported; the model's template is used", where)
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"tools must be an array, got {json_type(tools)}", "tools")
    # As in vLLM, chat_template_kwargs may override the two flags that shape the prompt's end.
    flags = {
        "add_generation_prompt": _optional_bool(data, "add_generation_prompt", True),
        "continue_final_message": _optional_bool(data, "continue_final_message", False),
    }
    template_kwargs = dict(extra or {})
    for name in flags:
        if name in template_kwargs:
            flags[name] = _optional_bool(template_kwargs, name, flags[name], "chat_template_kwargs.", strict=True)
            del template_kwargs[name]
    text = tokenizer.render_chat(
        messages,
        flags["add_generation_prompt"],
        continue_final_message=flags["continue_final_message"],
        tools=tools,
        template_kwargs=template_kwargs,
    )
    add_special_tokens = _optional_bool(data, "add_special_tokens", False)
    if not want_ids:
        return tokenizer.count_tokens(text, add_special_tokens=add_special_tokens, limit=limit), None
    ids = tokenizer.prompt_ids(text, add_special_tokens=add_special_tokens, limit=limit)
    return len(ids), (None if limit is not None and len(ids) > limit else ids)


# ---------------------------------------------------------------------------------------------
# Sampling parameters
# ---------------------------------------------------------------------------------------------
# vLLM's request schemas' ``float | None`` sampling fields, in the order SamplingParams checks them.
_SAMPLING_FLOATS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")


def _lax_float(value: Any) -> float | None:
    """``value`` as pydantic's lax mode reads a float field: a number, a boolean or a string of one."""
    if isinstance(value, int):  # a bool too; past a float's range an infinity, where float() raises
        if abs(value) >= 2**1000:
            return math.inf if value > 0 else -math.inf
        return float(value)
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def check_sampling_params(data: Mapping[str, Any], kind: RequestKind, caps: list[int], vocab_size: int) -> None:
    """Refuse what vLLM's request schema and ``SamplingParams._verify_args`` refuse, with vLLM's
    messages: a node would answer it with a 400 only after the request was routed (and, on the
    keep path, after a prefill hop). ``caps``: each prompt's resolved ``max_tokens``."""
    num: dict[str, float] = {}
    for name in _SAMPLING_FLOATS:
        if data.get(name) is not None:
            value = _lax_float(data[name])
            if value is None:
                raise RequestError(f"{name} must be a number, got {json_type(data[name])}", name)
            num[name] = value
    ints: dict[str, int] = {}
    logprob_fields = ("prompt_logprobs", "logprobs" if kind == "completion" else "top_logprobs")
    for name in logprob_fields:
        # vLLM checks these on the raw body, before its schema's lax reading: only a number passes.
        raw = data.get(name)
        if raw is not None and not isinstance(raw, int | float):
            raise RequestError(f"`{name}` must be an integer.", name)
    for name in ("top_k", "min_tokens", *logprob_fields):
        if name in data and (data[name] is not None or name == "min_tokens"):  # min_tokens: int = 0
            value = _lax_int(data[name])
            if value is None:
                raise RequestError(f"{name} must be an integer, got {json_type(data[name])}", name)
            ints[name] = value
    stop = data.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise RequestError(f"stop must be a string or an array of strings, got {json_type(stop)}", "stop")

    # The chat schema's own logprobs rules; its top_logprobs is the engine's logprobs.
    logprobs = ints.get("logprobs")
    if kind == "chat" and (top := ints.get("top_logprobs")) is not None:
        if top < 0 and top != -1:
            raise RequestError("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        asked = _optional_bool(data, "logprobs", False)
        if (top == -1 or top > 0) and not asked:
            raise RequestError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        logprobs = top if asked else None

    for name in ("presence_penalty", "frequency_penalty"):
        if name in num and not -2.0 <= num[name] <= 2.0:
            raise RequestError(f"{name} must be in [-2, 2], got {num[name]}.", name)
    if (rep := num.get("repetition_penalty")) is not None:
        if not math.isfinite(rep):
            raise RequestError(f"repetition_penalty must be a finite number, got {rep}.", "repetition_penalty")
        if rep <= 0.0:
            raise RequestError(f"repetition_penalty must be greater than zero, got {rep}.", "repetition_penalty")
    if (temperature := num.get("temperature")) is not None:
        if not math.isfinite(temperature):
            raise RequestError(f"temperature must be a finite number, got {temperature}.", "temperature")
        if temperature < 0.0:
            raise RequestError(f"temperature must be non-negative, got {temperature}.", "temperature")
        if temperature > 2.0:
            raise RequestError(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    if (top_p := num.get("top_p")) is not None and not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    if (top_k := ints.get("top_k")) is not None and top_k < -1:
        raise RequestError(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "top_k")
    if (min_p := num.get("min_p")) is not None and not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.", "min_p")
    if (min_tokens := ints.get("min_tokens")) is not None:
        if min_tokens < 0:
            raise RequestError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens")
        for cap in caps:
            if min_tokens > cap:
                raise RequestError(
                    f"min_tokens must be less than or equal to max_tokens={cap}, got {min_tokens}.", "min_tokens"
                )
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", ints.get("prompt_logprobs"))):
        if value is not None and value < 0 and value != -1:
            raise RequestError(f"{name} must be non-negative or -1, got {value}.", name)
    if stops is not None and any(not s for s in stops):
        raise RequestError("stop cannot contain an empty string.", "stop")
    # SamplingParams._validate_logprobs, against the engine's max_logprobs (-1: the vocabulary).
    param = "logprobs" if kind == "completion" else "top_logprobs"
    for what, name, value in (("sample", param, logprobs), ("prompt", "prompt_logprobs", ints.get("prompt_logprobs"))):
        asked_for = vocab_size if value == -1 else value
        if asked_for and asked_for > MAX_LOGPROBS:
            raise RequestError(
                f"Requested {what} logprobs of {asked_for}, which is greater than max allowed: {MAX_LOGPROBS}", name
            )
