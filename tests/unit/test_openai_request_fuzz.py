"""Property-based fuzz of the OpenAI request parser (hypothesis, derandomized: the same examples
every run). Whatever the bytes, ``parse_request`` either accepts the request, with a prompt that
fits the context and a body every later hop can encode again, or raises a KairosError that maps
to a 4xx with an OpenAI error body. Nothing else: no other exception, no 5xx."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kairos.api.openai_request import ParsedRequest, RequestLimits, parse_request
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.common.errors import KairosError
from kairos.common.http_errors import error_body, error_json, error_status
from kairos.launcher.tinymodel import build_tiny_model

LIMITS = RequestLimits(max_body_bytes=64 * 1024, max_model_len=2048)
FUZZ = settings(
    max_examples=200, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    model_dir: Path = build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")
    return PromptTokenizer.from_dir(model_dir)


_text = st.text(st.characters(codec="utf-8"), max_size=30)  # any code point UTF-8 can carry
_text_any = st.text(max_size=30)  # lone surrogates too: json.dumps escapes them as \udXXX
_scalar = st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats() | _text | _text_any
_json = st.recursive(
    _scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3), max_leaves=10
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | _json},
    optional={
        "content": _text | _json | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=2)
    },
)
_body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("m") | _json,
        "prompt": _text | st.lists(st.integers(-3, 5000), max_size=6) | st.lists(_text, max_size=2) | _json,
        "messages": st.lists(_message, max_size=3) | _json,
        "max_tokens": st.integers(-2, 3000) | _json,
        "max_completion_tokens": st.integers(-2, 3000) | _json,
        "stream": _json,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _json}) | _json,
        "add_generation_prompt": _json,
        "continue_final_message": _json,
        "add_special_tokens": _json,
        "chat_template_kwargs": _json,
        "tools": _json,
        "chat_template": st.none() | _text,
        "prompt_embeds": st.none() | _text,
        "user": _text | _text_any,
        c.VLLM_XARGS: _json,
    },
)
# Byte-level damage after encoding: raw surrogates, invalid UTF-8, NULs, broken escapes.
_JUNK = (
    st.sampled_from([b"\xed\xa0\x80", b"\xed\xbf\xbf"])
    | st.sampled_from([b"\xff", b"\xc0\xaf", b"\x00", b"\\u", b"\\ud800", b'"', b"}", b"[" * 40])
    | st.binary(max_size=8)
)
# Requests that are valid before the damage, so that the damage is what the parser must catch.
_valid = st.fixed_dictionaries(
    {"prompt": _text.filter(bool), "max_tokens": st.integers(1, 16)}, optional={"user": _text, "model": _text}
) | st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": _text}), min_size=1, max_size=2
        ),
        "max_tokens": st.integers(1, 16),
    },
    optional={"user": _text},
)


def _check(path: str, raw: bytes, tok: PromptTokenizer) -> ParsedRequest | None:
    try:
        parsed = parse_request(path, raw, tok, LIMITS)
    except KairosError as exc:
        status = error_status(exc)
        assert 400 <= status < 500, (exc.code, exc.message)
        assert json.loads(error_json(exc)) == error_body(exc)
        assert isinstance(error_body(exc)["error"]["message"], str) and error_body(exc)["error"]["message"]
        return None
    assert parsed.prompt_tokens >= 1 and parsed.prompt_tokens + parsed.max_tokens <= LIMITS.max_model_len
    # The sidecar and the nodes encode the body again: an accepted one must be encodable text.
    json.dumps(parsed.body, ensure_ascii=False).encode("utf-8")
    return parsed


@FUZZ
@given(path=st.sampled_from(c.INFERENCE_PATHS), body=_body)
def test_any_json_body_is_accepted_or_a_4xx(tok: PromptTokenizer, path: str, body: dict[str, Any]) -> None:
    _check(path, json.dumps(body).encode(), tok)


@FUZZ
@given(
    path=st.sampled_from(c.INFERENCE_PATHS),
    body=_valid | _body,
    at=st.integers(0, 10_000),
    junk=_JUNK,
    how=st.sampled_from(["cut", "insert", "into_string"]),
)
def test_damaged_bytes_are_accepted_or_a_4xx(
    tok: PromptTokenizer, path: str, body: dict[str, Any], at: int, junk: bytes, how: str
) -> None:
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    at %= len(raw) + 1
    if how == "into_string" and b'": "' in raw:  # the JSON around the junk stays valid
        at = raw.index(b'": "') + 4
    _check(path, raw[:at] if how == "cut" else raw[:at] + junk + raw[at:], tok)


@FUZZ
@given(
    prompt=_text.filter(bool),
    junk=st.sampled_from([b"\xed\xa0\x80", b"\xed\xb0\x80", b"\xed\xbf\xbf"]),
    field=st.sampled_from(["prompt", "user", "model"]),
)
def test_raw_surrogate_bytes_anywhere_are_a_400(tok: PromptTokenizer, prompt: str, junk: bytes, field: str) -> None:
    raw = json.dumps({"prompt": prompt, "max_tokens": 1, "user": "u", "model": "m"}, ensure_ascii=False).encode()
    marker = json.dumps({"prompt": prompt, "user": "u", "model": "m"}[field], ensure_ascii=False).encode()
    at = raw.index(marker) + 1  # inside the field's string
    with pytest.raises(KairosError) as info:
        parse_request(c.INFERENCE_PATHS[0], raw[:at] + junk + raw[at:], tok, LIMITS)
    assert error_status(info.value) == 400


# ---------------------------------------------------------------------------------------------
# Counting with a limit: exact up to it, "more than" past it
# ---------------------------------------------------------------------------------------------
_pieces = st.sampled_from(
    [
        "the ",
        "quick",
        " ",
        "  ",
        "\n",
        "\t ",
        "é",
        "日本語",
        "!",
        "42 ",
        "<s>",
        "</s>",
        "a.b",
        "don't ",
        "\U0001f600",
        "x" * 40,
    ]
)


@FUZZ
@given(parts=st.lists(_pieces, max_size=3000), limit=st.integers(0, 3000), chat=st.booleans())
def test_a_count_with_a_limit_is_exact_up_to_it(tok: PromptTokenizer, parts: list[str], limit: int, chat: bool) -> None:
    text = "".join(parts)
    if chat:
        messages = [{"role": "user", "content": text}]
        exact, bounded = tok.count_chat_prompt(messages), tok.count_chat_prompt(messages, limit=limit)
    else:
        exact, bounded = tok.count_completion_prompt(text), tok.count_completion_prompt(text, limit)
    assert bounded == exact if exact <= limit else bounded > limit


@pytest.mark.parametrize("path", c.INFERENCE_PATHS)
def test_a_prompt_far_over_the_context_is_refused_without_counting_it_all(tok: PromptTokenizer, path: str) -> None:
    """A 7 MB prompt (about 3 million tokens of the tiny model) against a 2048-token context:
    the gateway stops counting past the context, so it cannot tell the exact count (vLLM's
    message, which the emulated node keeps, has it)."""
    text = "the quick brown fox jumps over a lazy dog " * (7 * 1024 * 1024 // 42)
    payload = {"prompt": text} if path == c.INFERENCE_PATHS[0] else {"messages": [{"role": "user", "content": text}]}
    raw = json.dumps({**payload, "max_tokens": 1}).encode()
    limits = RequestLimits(max_model_len=2048)
    with pytest.raises(KairosError) as bounded:
        parse_request(path, raw, tok, limits, stop_over_context=True)
    assert error_status(bounded.value) == 400
    assert "more than 2048 input tokens" in bounded.value.message
    with pytest.raises(KairosError) as exact:
        parse_request(path, raw, tok, limits)
    assert "more than" not in exact.value.message and "you requested" in exact.value.message  # vLLM's exact one
