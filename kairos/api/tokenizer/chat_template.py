"""Chat templates as Hugging Face transformers renders them for ``apply_chat_template``
(``tokenize=False``), which is what vLLM encodes for ``/v1/chat/completions``: the sandboxed Jinja
environment with transformers' filters, globals and ``{% generation %}`` tag; the content format
vLLM's "auto" detects from a template ("openai" part lists or "string"); the cut that
``continue_final_message`` makes; and the errors a template raises on a request (400s)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from kairos.common.errors import InvalidRequestError

ContentFormat = Literal["string", "openai"]


class ChatTemplateError(InvalidRequestError):
    """The chat template could not render these messages (a 400, as vLLM answers)."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template, so chat requests cannot be rendered (vLLM also gives 400)."""


# ---------------------------------------------------------------------------------------------
# Jinja environment, as transformers builds it for apply_chat_template
# ---------------------------------------------------------------------------------------------
def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # transformers overrides Jinja's tojson: no HTML escaping, non-ASCII kept, keys unsorted.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' assistant-mask marker; renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    return _environment().from_string(template)


# ---------------------------------------------------------------------------------------------
# Content-format detection (the rule vLLM's "auto" applies)
# ---------------------------------------------------------------------------------------------
def _accesses(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Is ``node`` one of ``names`` (or ``name[key]`` / ``name.key``), possibly sliced, filtered or tested?"""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) or (
        isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
    ):
        if node.node is None:
            return False
        node = node.node
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        return _accesses(node.node, names) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _accesses(node.node, names) and node.attr == key
    return False


def detect_content_format(template: str) -> ContentFormat:
    """Return "openai" if the template loops over a message's content (``for part in message['content']``).

    Messages are the loop variables of ``for m in messages`` loops, ``messages`` including names
    assigned from it (``{% set loop_messages = messages[1:] %}``).
    """
    try:
        root = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    aliases = {"messages"}
    changed = True
    while changed:
        changed = False
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in aliases and _accesses(assign.node, aliases):
                aliases.add(target.name)
                changed = True
    loops = list(root.find_all(jinja2.nodes.For))
    message_vars = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name) and _accesses(loop.iter, aliases)
    }
    if any(_accesses(loop.iter, message_vars, "content") for loop in loops):
        return "openai"
    return "string"


# transformers (4.57 and later) marks the final message with this tag, renders, and cuts at the tag.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final_message(conversation: list[dict[str, Any]]) -> str:
    """Append the tag to the final message's (last text part's) content; return that text, untagged."""
    if not conversation:
        raise ChatTemplateError("continue_final_message needs at least one message", "continue_final_message")
    final = conversation[-1]
    content = final.get("content")
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError(
            "continue_final_message is set but the final message has no text to continue", "continue_final_message"
        )
    text = content if isinstance(content, str) else ""
    final["content"] = text + _CONTINUE_TAG
    return text


def cut_at_tag(rendered: str, final_text: str) -> str:
    """The rendered chat up to the final message's end, as transformers cuts it."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the rendered chat",
            "continue_final_message",
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:  # the template kept the message's spacing
        return rendered[:at]
    return rendered[:at].rstrip()
