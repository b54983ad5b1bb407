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

One prompt per request: batch prompts (several strings or token lists) are rejected, because
one routing decision places one prefill.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kairos.api.tokenizer import PromptTokenizer, json_type, text_part_key
from kairos.common import defaults
from kairos.common.errors import (  # NotFoundError: re-exported, callers know it from here
    ConfigError,
    InvalidRequestError,
    NotFoundError,
)

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
RequestKind = Literal["completion", "chat"]
_ROUTES: dict[str, RequestKind] = {COMPLETIONS_PATH: "completion", CHAT_COMPLETIONS_PATH: "chat"}


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

    max_body_bytes: int = defaults.MAX_REQUEST_BODY_BYTES  # larger bodies get 413 before JSON parsing
    max_model_len: int = defaults.MAX_MODEL_LEN  # prompt + output tokens, vLLM's --max-model-len
    default_max_tokens: int = 16  # completions without max_tokens (vLLM's default); chat uses the rest of the context

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
    # lookup hashes. None on the count-only path, which never builds them.
    prompt_token_ids: list[int] | None = None


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
    stream = _optional_bool(data, "stream", False)
    include_usage = _include_usage(data, stream)

    # Cheap field checks first: a bad max_tokens should not cost a tokenization.
    count_limit = limits.max_model_len if stop_over_context else None
    if kind == "completion":
        field, requested = _max_tokens_field(data, ("max_tokens",))
        if field is None and "max_tokens" not in data:
            requested = limits.default_max_tokens  # absent (not null): vLLM's default of 16
        prompt_tokens, ids = _completion_prompt_tokens(data, tokenizer, count_limit, token_ids)
        input_param = "prompt"
    else:
        field, requested = _max_tokens_field(data, ("max_completion_tokens", "max_tokens"))
        prompt_tokens, ids = _chat_prompt_tokens(data, tokenizer, count_limit, token_ids)
        input_param = "messages"
    if count_limit is not None and prompt_tokens > count_limit:
        raise RequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your request has more "
            f"than {count_limit} input tokens. Please reduce the length of the input.",
            input_param,
        )

    max_tokens = _resolve_max_tokens(prompt_tokens, requested, field or "max_tokens", input_param, limits)
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        body=data,
        prompt_token_ids=ids,
    )


# ---------------------------------------------------------------------------------------------
# Field helpers
# ---------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_bool(data: Mapping[str, Any], name: str, default: bool, where: str = "") -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where}{name} must be a boolean, got {json_type(value)}", f"{where}{name}")
    return value


def _include_usage(data: Mapping[str, Any], stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {json_type(options)}", "stream_options")
    if not stream:
        raise RequestError("stream_options can only be set when stream is true", "stream_options")
    return _optional_bool(options, "include_usage", False, "stream_options.")


def _max_tokens_field(data: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str | None, int | None]:
    """The first non-null of ``names`` (validated >= 1), or (None, None) when all are null or absent."""
    for name in names:
        value = data.get(name)
        if value is None:
            continue
        if not _is_int(value):
            raise RequestError(f"{name} must be an integer, got {json_type(value)}", name)
        if value < 1:
            raise RequestError(f"{name} must be at least 1, got {value}", name)
        return name, value
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
_PROMPT_FORMS = "a string, an array of token ids, or an array holding one string or one token-id array"


def _completion_prompt_tokens(
    data: Mapping[str, Any], tokenizer: PromptTokenizer, limit: int | None, want_ids: bool
) -> tuple[int, list[int] | None]:
    if data.get("prompt_embeds") is not None:
        raise RequestError("prompt_embeds is not supported by the gateway; send prompt", "prompt_embeds")
    if "prompt" not in data or data["prompt"] is None:
        raise RequestError("prompt is required", "prompt")
    prompt = data["prompt"]
    single: str | list[int]
    if isinstance(prompt, str):
        single = prompt
    elif isinstance(prompt, list):
        if all(_is_int(t) for t in prompt):  # one prompt as token ids ([] included)
            single = prompt
        elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            if len(prompt) > 1:
                raise RequestError(
                    f"prompt holds {len(prompt)} prompts; the gateway supports one prompt per request "
                    "(send each prompt as its own request)",
                    "prompt",
                )
            single = prompt[0]
            if isinstance(single, list) and not all(_is_int(t) for t in single):
                raise RequestError(f"prompt must be {_PROMPT_FORMS}", "prompt")
        else:
            raise RequestError(f"prompt must be {_PROMPT_FORMS}", "prompt")
    else:
        raise RequestError(f"prompt must be {_PROMPT_FORMS}, got {json_type(prompt)}", "prompt")

    if len(single) == 0:
        raise RequestError("prompt is empty", "prompt")
    if isinstance(single, list):
        bad = next((t for t in single if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"token id {bad} is out of vocabulary (valid ids are 0 to {tokenizer.vocab_size - 1})", "prompt"
            )
    if not want_ids:
        return tokenizer.count_completion_prompt(single, limit), None
    ids = tokenizer.completion_prompt_ids(single, limit)
    return len(ids), (None if limit is not None and len(ids) > limit else ids)


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
            flags[name] = _optional_bool(template_kwargs, name, flags[name], "chat_template_kwargs.")
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
