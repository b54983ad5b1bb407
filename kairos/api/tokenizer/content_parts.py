"""The OpenAI request's message content as vLLM reads it: which content parts carry text (and
under which key), their text, each message rewritten into a chat template's content format, and
how a JSON value's type reads in an error message. The request parser and the renderer share them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kairos.api.tokenizer.chat_template import ChatTemplateError, ContentFormat

# OpenAI content-part types that carry text, and the key holding it (vLLM's text-like parts).
TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def json_type(value: Any) -> str:
    """How a JSON value's type reads in an error message ("an array", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def text_part_key(part: Any, param: str) -> str:
    """The key that holds a content part's text ("text" for type "text", ...); raises for a part
    that is not an object or not a text part. The request parser and the renderer share it."""
    if not isinstance(part, Mapping):
        raise ChatTemplateError(f"{param} must be an object, got {json_type(part)}", param)
    kind = part.get("type")
    key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise ChatTemplateError(
            f"{param}.type {kind!r} is not supported: the gateway serves text-only models "
            f"(supported: {', '.join(sorted(TEXT_PART_KEYS))})",
            f"{param}.type",
        )
    return key


def _part_text(part: Any, index: int, j: int) -> str | None:
    """The text of one content part; None for a text part without text (vLLM skips those)."""
    param = f"messages[{index}].content[{j}]"
    if isinstance(part, str):
        return part
    key = text_part_key(part, param)
    text = part.get(key)
    if text is not None and not isinstance(text, str):
        raise ChatTemplateError(f"{param}.{key} must be a string", f"{param}.{key}")
    return text


def normalize_message(message: Mapping[str, Any], index: int, content_format: ContentFormat) -> dict[str, Any]:
    """vLLM's rewrite of one message's content into the template's content format."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{index}] must be an object", f"messages[{index}]")
    content = message.get("content")
    if content is None:
        texts: list[str] = []
    elif isinstance(content, str):
        texts = [content]
    elif isinstance(content, Sequence):
        texts = [t for j, part in enumerate(content) if (t := _part_text(part, index, j)) is not None]
    else:
        raise ChatTemplateError(
            f"messages[{index}].content must be a string or a list of content parts", f"messages[{index}].content"
        )
    out = dict(message)
    if content_format == "openai":
        out["content"] = [{"type": "text", "text": t} for t in texts]
    else:
        out["content"] = "\n".join(texts)
    return out
