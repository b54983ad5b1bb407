"""parse_request: OpenAI completions/chat bodies validated and counted the way vLLM would."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from kairos.api.openai_request import (
    NotFoundError,
    ParsedRequest,
    PayloadTooLargeError,
    RequestLimits,
    parse_request,
    request_streams,
)
from kairos.api.tokenizer import PromptTokenizer
from kairos.common.config import load_config
from kairos.common.errors import ConfigError, InvalidRequestError, KairosError
from kairos.common.http_errors import error_body, error_status
from kairos.launcher.tinymodel import build_tiny_model

LIMITS = RequestLimits()
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "The gateway routes each request to a prefill node."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"}]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def raw(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def parse(tok: PromptTokenizer, path: str, payload: bytes | dict, limits: RequestLimits = LIMITS) -> ParsedRequest:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return parse_request(path, data, tok, limits)


# -- completions -------------------------------------------------------------------------------
def test_string_prompt_counts_bos_and_defaults_to_16_tokens(tok: PromptTokenizer, raw: Tokenizer) -> None:
    payload = {"model": "tiny", "prompt": PROMPT}
    parsed = parse(tok, COMPLETIONS, payload)
    assert parsed == ParsedRequest(
        kind="completion",
        model="tiny",
        prompt_tokens=len(raw.encode(PROMPT, add_special_tokens=True).ids),
        max_tokens=16,
        stream=False,
        include_usage=False,
        body=payload,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.max_tokens = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ([5, 6, 7], 3),
        ([[5, 6, 7, 8]], 4),
        ([0, 4095], 2),
    ],
)
def test_token_id_prompts_count_as_given(tok: PromptTokenizer, prompt: list, tokens: int) -> None:
    assert parse(tok, COMPLETIONS, {"prompt": prompt}).prompt_tokens == tokens


def test_single_string_list_and_query_string(tok: PromptTokenizer) -> None:
    plain = parse(tok, COMPLETIONS, {"prompt": PROMPT})
    listed = parse(tok, COMPLETIONS + "?api-version=1", {"prompt": [PROMPT]})
    assert listed.prompt_tokens == plain.prompt_tokens
    assert listed.model is None


def test_completion_max_tokens_explicit_null_and_exact_fit(tok: PromptTokenizer) -> None:
    p = parse(tok, COMPLETIONS, {"prompt": PROMPT}).prompt_tokens
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 100}).max_tokens == 100
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT, "max_tokens": None}).max_tokens == LIMITS.max_model_len - p
    tight = RequestLimits(max_model_len=p + 5, default_max_tokens=5)
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT}, tight).max_tokens == 5
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 5}, tight).max_tokens == 5


@pytest.mark.parametrize(
    "prompts",
    [
        pytest.param(["the quick brown fox", "a lazy dog sleeps", "x"], id="strings"),
        pytest.param([[5, 6, 7], [8, 9, 10, 11]], id="token-id lists"),
    ],
)
def test_a_batch_is_one_request_per_prompt_in_order(tok: PromptTokenizer, prompts: list) -> None:
    payload = {"model": "tiny", "prompt": prompts, "max_tokens": 3, "stream": True, "n": 2, "temperature": 0.7}
    batch = parse(tok, COMPLETIONS, payload)
    singles = [parse(tok, COMPLETIONS, {**payload, "prompt": p}) for p in prompts]
    assert batch.parts == tuple(singles)  # each part is exactly the request of its prompt alone
    assert [p.body["prompt"] for p in batch.parts] == prompts
    assert batch.body == payload and batch.prompt_token_ids is None
    assert batch.prompt_tokens == sum(s.prompt_tokens for s in singles)  # vLLM's usage.prompt_tokens
    assert (batch.max_tokens, batch.n, batch.stream) == (3 * len(prompts), 2, True)
    assert parse(tok, COMPLETIONS, {"prompt": prompts[:1]}).parts == ()  # one prompt in a list is no batch


def test_a_batch_takes_an_empty_string_with_tokens_and_checks_prompts_in_order(tok: PromptTokenizer) -> None:
    # vLLM serves "" inside a batch (its BOS is a prompt) though it refuses a bare "" prompt.
    batch = parse(tok, COMPLETIONS, {"prompt": ["ab", ""]})
    assert [p.prompt_tokens for p in batch.parts] == [tok.count_completion_prompt("ab"), 1]
    short = RequestLimits(max_model_len=20, default_max_tokens=4)
    with pytest.raises(InvalidRequestError, match="you requested 25 tokens") as info:  # the first too long
        parse(tok, COMPLETIONS, {"prompt": [[5] * 3, [6] * 21, [7] * 30], "max_tokens": 4}, short)
    assert info.value.param == "prompt"
    # max_tokens null: each prompt's own rest of the context
    batch = parse(tok, COMPLETIONS, {"prompt": [[5] * 3, [6] * 10], "max_tokens": None}, short)
    assert [p.max_tokens for p in batch.parts] == [17, 10]


@pytest.mark.parametrize(("n", "value"), [(2, 2), ("3", 3), (2.0, 2), (True, 1), (" 4 ", 4)])
def test_n_is_read_as_vllm_reads_it(tok: PromptTokenizer, n: Any, value: int) -> None:
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT, "n": n}).n == value
    assert parse(tok, CHAT, {"messages": MESSAGES, "n": n, "temperature": 1}).n == value
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT}).n == 1
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT, "n": 1, "temperature": 0}).n == 1  # greedy takes n 1


# What vLLM 0.32's request schema (pydantic, lax mode) reads from each value, checked against it
# (CompletionRequest / ChatCompletionRequest.model_validate_json): a value vLLM serves must not be
# refused here, and one it refuses must not be routed.
@pytest.mark.parametrize(
    ("value", "tokens"),
    [("5", 5), (5.0, 5), (True, 1), (" +5 ", 5), ("5.00", 5), ("1_0", 10), ("05", 5), ("\t5\n", 5)],
)
def test_max_tokens_is_read_as_vllm_reads_it(tok: PromptTokenizer, value: Any, tokens: int) -> None:
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT, "max_tokens": value}).max_tokens == tokens
    assert parse(tok, CHAT, {"messages": MESSAGES, "max_completion_tokens": value}).max_tokens == tokens


@pytest.mark.parametrize("value", ["5.5", "5.", "1e3", "0x5", "5 5", "", "١٢", 5.5, [5], {"n": 5}])
def test_max_tokens_vllm_cannot_read_is_a_400(tok: PromptTokenizer, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"^max_tokens must be an integer") as refused:
        parse(tok, COMPLETIONS, {"prompt": PROMPT, "max_tokens": value})
    assert refused.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("value", "streams"),
    [
        *[(v, True) for v in (True, "true", "True", "yes", "on", "1", "t", "y", 1, 1.0)],
        *[(v, False) for v in (False, "false", "no", "off", "0", "f", "n", 0, 0.0, None)],
    ],
)
def test_stream_is_read_as_vllm_reads_it(tok: PromptTokenizer, value: Any, streams: bool) -> None:
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT, "stream": value}).stream is streams
    assert request_streams({"stream": value}) is streams


@pytest.mark.parametrize("value", ["2", "", "maybe", 2, 0.5, [True]])
def test_a_stream_flag_vllm_cannot_read_is_a_400(tok: PromptTokenizer, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"^stream must be a boolean"):
        parse(tok, COMPLETIONS, {"prompt": PROMPT, "stream": value})


def test_a_greedy_temperature_given_as_a_string_still_takes_n_1(tok: PromptTokenizer) -> None:
    with pytest.raises(InvalidRequestError, match=r"^n must be 1 when using greedy sampling, got 2\.$"):
        parse(tok, COMPLETIONS, {"prompt": PROMPT, "n": 2, "temperature": "0"})


def test_stream_and_usage(tok: PromptTokenizer) -> None:
    streamed = parse(tok, COMPLETIONS, {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}})
    assert (streamed.stream, streamed.include_usage) == (True, True)
    plain = parse(tok, COMPLETIONS, {"prompt": PROMPT, "stream": True, "stream_options": {}})
    assert (plain.stream, plain.include_usage) == (True, False)


# -- chat --------------------------------------------------------------------------------------
def test_chat_counts_the_rendered_template(tok: PromptTokenizer, raw: Tokenizer) -> None:
    parsed = parse(tok, CHAT, {"model": "tiny", "messages": MESSAGES})
    rendered = tok.render_chat(MESSAGES)
    expected = len(raw.encode(rendered, add_special_tokens=False).ids)
    assert parsed.kind == "chat"
    assert parsed.prompt_tokens == expected == tok.count_chat_prompt(MESSAGES)
    assert parsed.max_tokens == LIMITS.max_model_len - expected  # vLLM's chat default: the rest of the context


LONG_TEXTS = {
    "ascii": " ".join(f"Word{i % 97} costs {i}, doesn't it? (line {i})" for i in range(2500)),
    "sparse unicode": " ".join(f"\u201cquote {i}\u201d na\u00efve caf\u00e9 x{i}" for i in range(2500)),
    "dense unicode": "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002 \U0001f642 " * 2000,
    "special strings": "<s> text </s> more <unk> <s " * 2000,
}


@pytest.mark.parametrize("kind", list(LONG_TEXTS))
def test_long_prompts_count_exactly(tok: PromptTokenizer, raw: Tokenizer, kind: str) -> None:
    """Long prompts take the exact counter's chunked path: the counts stay the encoding's."""
    text = LONG_TEXTS[kind]
    assert len(text.encode()) > 40_000
    limits = RequestLimits(max_model_len=1_000_000)
    completion = parse(tok, COMPLETIONS, {"prompt": text, "max_tokens": 1}, limits)
    assert completion.prompt_tokens == len(raw.encode(text, add_special_tokens=True).ids)
    messages = [{"role": "system", "content": text[:5000]}, {"role": "user", "content": text}]
    chat = parse(tok, CHAT, {"messages": messages, "max_tokens": 1}, limits)
    assert chat.prompt_tokens == len(raw.encode(tok.render_chat(messages), add_special_tokens=False).ids)


def test_chat_max_completion_tokens_wins(tok: PromptTokenizer) -> None:
    assert parse(tok, CHAT, {"messages": MESSAGES, "max_tokens": 7}).max_tokens == 7
    assert parse(tok, CHAT, {"messages": MESSAGES, "max_tokens": 7, "max_completion_tokens": 9}).max_tokens == 9
    assert parse(tok, CHAT, {"messages": MESSAGES, "max_completion_tokens": None, "max_tokens": 7}).max_tokens == 7


def test_chat_prompt_shaping_fields(tok: PromptTokenizer) -> None:
    def count(**extra: Any) -> int:
        return parse(tok, CHAT, {"messages": MESSAGES, **extra}).prompt_tokens

    with_prompt = tok.count_chat_prompt(MESSAGES, add_generation_prompt=True)
    without = tok.count_chat_prompt(MESSAGES, add_generation_prompt=False)
    assert with_prompt > without
    assert count() == with_prompt
    assert count(add_generation_prompt=False) == without
    assert count(chat_template_kwargs={"add_generation_prompt": False}) == without
    assert count(add_special_tokens=True) == with_prompt + 1
    assert count(tools=[{"type": "function", "function": {"name": "f"}}]) == with_prompt  # this template ignores tools
    partial = [*MESSAGES, {"role": "assistant", "content": "A token is"}]
    assert parse(
        tok, CHAT, {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    ).prompt_tokens == tok.count_chat_prompt(partial, add_generation_prompt=False, continue_final_message=True)


def test_chat_accepts_parts_and_tool_call_turns(tok: PromptTokenizer) -> None:
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "a token?"}]},
    ]
    assert parse(tok, CHAT, {"messages": parts}).prompt_tokens == parse(tok, CHAT, {"messages": MESSAGES}).prompt_tokens
    tool_turn = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert parse(tok, CHAT, {"messages": tool_turn}).prompt_tokens == tok.count_chat_prompt(tool_turn)


# -- errors (table) ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    payload: bytes | dict
    exc: type[KairosError]
    status: int
    param: str | None
    fragment: str
    limits: RequestLimits = LIMITS


TINY_BODY = RequestLimits(max_body_bytes=64)
SHORT = RequestLimits(max_model_len=20, default_max_tokens=4)
C, M = COMPLETIONS, CHAT
BAD = [
    Bad("unknown path", "/v1/embeddings", {"input": "x"}, NotFoundError, 404, None, "no such endpoint"),
    Bad("trailing slash", "/v1/completions/", {"prompt": "x"}, NotFoundError, 404, None, "/v1/completions/"),
    Bad(
        "too large",
        C,
        {"prompt": "x" * 100},
        PayloadTooLargeError,
        413,
        None,
        "over the gateway's limit of 64 bytes",
        TINY_BODY,
    ),
    Bad("malformed json", C, b'{"prompt": ', InvalidRequestError, 400, None, "not valid JSON"),
    Bad("not utf-8", C, b"\xff\xfe", InvalidRequestError, 400, None, "not valid JSON"),
    Bad("too deep", C, b"[" * 100_000, InvalidRequestError, 400, None, "not valid JSON"),
    Bad("lone surrogate", C, b'{"prompt": "a \\ud800 b"}', InvalidRequestError, 400, None, "unpaired UTF-16 surrogate"),
    Bad(
        "lone low surrogate in chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x \\uDFFF"}]}',
        InvalidRequestError,
        400,
        None,
        "unpaired UTF-16 surrogate",
    ),
    # Raw UTF-8-encoded surrogates (not the \u escape): json.loads lets them through as text.
    Bad(
        "raw surrogate bytes in prompt",
        C,
        b'{"prompt": "a \xed\xa0\x80 b"}',
        InvalidRequestError,
        400,
        None,
        "not valid UTF-8",
    ),
    Bad(
        "raw surrogate bytes in chat",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xed\xbf\xbf"}]}',
        InvalidRequestError,
        400,
        None,
        "not valid UTF-8",
    ),
    Bad(
        "raw surrogate bytes in another field",
        C,
        b'{"prompt": "hi", "user": "\xed\xb0\x80"}',
        InvalidRequestError,
        400,
        None,
        "not valid UTF-8",
    ),
    Bad("not an object", C, b"[1, 2]", InvalidRequestError, 400, None, "must be a JSON object, got an array"),
    Bad(
        "model not a string",
        C,
        {"prompt": "x", "model": 3},
        InvalidRequestError,
        400,
        "model",
        "model must be a string",
    ),
    Bad("missing prompt", C, {"model": "m"}, InvalidRequestError, 400, "prompt", "prompt is required"),
    Bad("null prompt", C, {"prompt": None}, InvalidRequestError, 400, "prompt", "prompt is required"),
    Bad("number prompt", C, {"prompt": 42}, InvalidRequestError, 400, "prompt", "got a number"),
    Bad("object prompt", C, {"prompt": {"a": 1}}, InvalidRequestError, 400, "prompt", "prompt must be"),
    Bad("empty string", C, {"prompt": ""}, InvalidRequestError, 400, "prompt", "prompt is empty"),
    Bad("empty list", C, {"prompt": []}, InvalidRequestError, 400, "prompt", "prompt is empty"),
    Bad("list of empty string", C, {"prompt": [""]}, InvalidRequestError, 400, "prompt", "prompt is empty"),
    Bad("list of empty ids", C, {"prompt": [[]]}, InvalidRequestError, 400, "prompt", "prompt is empty"),
    Bad(
        "batch over vLLM's count",
        C,
        {"prompt": [[1]] * 1025},
        InvalidRequestError,
        400,
        "prompt",
        "prompt list length 1025 exceeds the maximum allowed count of 1024",
    ),
    Bad("batch with an empty part", C, {"prompt": [[1], []]}, InvalidRequestError, 400, "prompt", "prompt is empty"),
    Bad("batch with a bad id", C, {"prompt": [[1], [9999]]}, InvalidRequestError, 400, "prompt", "token id 9999"),
    Bad("batch mixing forms", C, {"prompt": ["a", [1]]}, InvalidRequestError, 400, "prompt", "prompt must be"),
    Bad("n 0", C, {"prompt": "x", "n": 0}, InvalidRequestError, 400, "n", "n must be at least 1, got 0."),
    Bad("n false", C, {"prompt": "x", "n": False}, InvalidRequestError, 400, "n", "n must be at least 1, got 0."),
    Bad("n null", C, {"prompt": "x", "n": None}, InvalidRequestError, 400, "n", "n must be an integer, got null"),
    Bad("n fraction", C, {"prompt": "x", "n": 1.5}, InvalidRequestError, 400, "n", "n must be an integer"),
    Bad("n word", C, {"prompt": "x", "n": "two"}, InvalidRequestError, 400, "n", "n must be an integer"),
    Bad("n past vLLM's", C, {"prompt": "x", "n": 16385}, InvalidRequestError, 400, "n", "at most 16384, got 16385."),
    Bad(
        "n greedy",
        C,
        {"prompt": "x", "n": 2, "temperature": 0},
        InvalidRequestError,
        400,
        "n",
        "n must be 1 when using greedy sampling, got 2.",
    ),
    Bad(
        "chat n greedy",
        M,
        {"messages": MESSAGES, "n": 3, "temperature": 0.0},
        InvalidRequestError,
        400,
        "n",
        "n must be 1 when using greedy sampling, got 3.",
    ),
    Bad("mixed list", C, {"prompt": ["a", 1]}, InvalidRequestError, 400, "prompt", "prompt must be"),
    Bad("bad inner ids", C, {"prompt": [[1, "a"]]}, InvalidRequestError, 400, "prompt", "prompt must be"),
    Bad("booleans", C, {"prompt": [True]}, InvalidRequestError, 400, "prompt", "prompt must be"),
    Bad("id past vocab", C, {"prompt": [1, 4096]}, InvalidRequestError, 400, "prompt", "token id 4096 is out of vocab"),
    Bad("negative id", C, {"prompt": [-1]}, InvalidRequestError, 400, "prompt", "token id -1 is out of vocab"),
    Bad("prompt_embeds", C, {"prompt_embeds": "AAAA"}, InvalidRequestError, 400, "prompt_embeds", "not supported"),
    Bad(
        "max_tokens 0", C, {"prompt": "x", "max_tokens": 0}, InvalidRequestError, 400, "max_tokens", "at least 1, got 0"
    ),
    Bad("max_tokens str", C, {"prompt": "x", "max_tokens": "9.5"}, InvalidRequestError, 400, "max_tokens", "integer"),
    Bad("max_tokens float", C, {"prompt": "x", "max_tokens": 1.5}, InvalidRequestError, 400, "max_tokens", "integer"),
    Bad("max_tokens list", C, {"prompt": "x", "max_tokens": [9]}, InvalidRequestError, 400, "max_tokens", "integer"),
    Bad("stream not bool", C, {"prompt": "x", "stream": "maybe"}, InvalidRequestError, 400, "stream", "boolean"),
    Bad(
        "stream_options without stream",
        C,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        InvalidRequestError,
        400,
        "stream_options",
        "only be set when stream is true",
    ),
    Bad(
        "stream_options not object",
        C,
        {"prompt": "x", "stream": True, "stream_options": 1},
        InvalidRequestError,
        400,
        "stream_options",
        "must be an object",
    ),
    Bad(
        "include_usage not bool",
        C,
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": "sometimes"}},
        InvalidRequestError,
        400,
        "stream_options.include_usage",
        "boolean",
    ),
    Bad("chat missing messages", M, {"model": "m"}, InvalidRequestError, 400, "messages", "messages is required"),
    Bad("messages a string", M, {"messages": "hi"}, InvalidRequestError, 400, "messages", "must be an array"),
    Bad("messages empty", M, {"messages": []}, InvalidRequestError, 400, "messages", "messages is empty"),
    Bad("message a string", M, {"messages": ["hi"]}, InvalidRequestError, 400, "messages[0]", "must be an object"),
    Bad(
        "message without role",
        M,
        {"messages": [{"content": "hi"}]},
        InvalidRequestError,
        400,
        "messages[0].role",
        "role is required",
    ),
    Bad(
        "message without content",
        M,
        {"messages": [{"role": "user"}]},
        InvalidRequestError,
        400,
        "messages[0].content",
        "content is required",
    ),
    Bad(
        "assistant null content, no tools",
        M,
        {"messages": [{"role": "assistant", "content": None}]},
        InvalidRequestError,
        400,
        "messages[0].content",
        "content is required",
    ),
    Bad(
        "content a number",
        M,
        {"messages": [{"role": "user", "content": 5}]},
        InvalidRequestError,
        400,
        "messages[0].content",
        "string or an array of content parts",
    ),
    Bad(
        "part not object",
        M,
        {"messages": [{"role": "user", "content": ["hi"]}]},
        InvalidRequestError,
        400,
        "messages[0].content[0]",
        "must be an object",
    ),
    Bad(
        "unknown part type",
        M,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        InvalidRequestError,
        400,
        "messages[0].content[0].type",
        "'image_url' is not supported",
    ),
    Bad(
        "part without text",
        M,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        InvalidRequestError,
        400,
        "messages[0].content[0].text",
        "must be a string",
    ),
    Bad(
        "generation prompt not bool",
        M,
        {"messages": MESSAGES, "add_generation_prompt": "nope"},
        InvalidRequestError,
        400,
        "add_generation_prompt",
        "boolean",
    ),
    Bad(
        "both prompt-end flags",
        M,
        {"messages": MESSAGES, "continue_final_message": True},
        InvalidRequestError,
        400,
        "continue_final_message",
        "cannot both be true",
    ),
    Bad(
        "request template",
        M,
        {"messages": MESSAGES, "chat_template": "{{ 1 }}"},
        InvalidRequestError,
        400,
        "chat_template",
        "not supported",
    ),
    Bad(
        "request template in the template kwargs",
        M,
        {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        InvalidRequestError,
        400,
        "chat_template_kwargs.chat_template",
        "not supported",
    ),
    Bad(
        "template kwargs list",
        M,
        {"messages": MESSAGES, "chat_template_kwargs": []},
        InvalidRequestError,
        400,
        "chat_template_kwargs",
        "must be an object",
    ),
    Bad(
        "template kwargs flag",
        M,
        {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": 0}},
        InvalidRequestError,
        400,
        "chat_template_kwargs.add_generation_prompt",
        "boolean",
    ),
    Bad(
        "tools not list", M, {"messages": MESSAGES, "tools": {}}, InvalidRequestError, 400, "tools", "must be an array"
    ),
    Bad(
        "max_completion_tokens 0",
        M,
        {"messages": MESSAGES, "max_completion_tokens": 0},
        InvalidRequestError,
        400,
        "max_completion_tokens",
        "at least 1",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c.name for c in BAD])
def test_rejections(tok: PromptTokenizer, case: Bad) -> None:
    with pytest.raises(case.exc) as info:
        parse(tok, case.path, case.payload, case.limits)
    assert case.fragment in info.value.message
    assert getattr(info.value, "param", None) == case.param
    assert error_status(info.value) == case.status
    assert error_body(info.value)["error"]["param"] == case.param


def test_completion_over_context_names_both_numbers(tok: PromptTokenizer) -> None:
    prompt = "one two three four five six seven eight nine ten"
    p = tok.count_completion_prompt(prompt)
    assert 4 < p < 20
    with pytest.raises(InvalidRequestError) as info:
        parse(tok, COMPLETIONS, {"prompt": prompt, "max_tokens": 20 - p + 1}, SHORT)
    assert info.value.message == (
        f"This model's maximum context length is 20 tokens. However, you requested 21 tokens ({p} in the prompt, "
        f"{21 - p} in the completion). Please reduce the length of the prompt or completion."
    )
    assert info.value.param == "max_tokens"
    # the default output cap counts too: p + 4 does not fit in p + 3
    with pytest.raises(InvalidRequestError, match=f"you requested {p + 4} tokens") as info:
        parse(tok, COMPLETIONS, {"prompt": prompt}, RequestLimits(max_model_len=p + 3, default_max_tokens=4))
    assert info.value.param == "max_tokens"


def test_chat_prompt_filling_the_context_is_rejected(tok: PromptTokenizer) -> None:
    p = tok.count_chat_prompt(MESSAGES)
    exact = RequestLimits(max_model_len=p, default_max_tokens=1)
    with pytest.raises(InvalidRequestError) as info:
        parse(tok, CHAT, {"messages": MESSAGES}, exact)
    assert f"maximum context length is {p} tokens" in info.value.message
    assert f"has {p} input tokens" in info.value.message
    assert info.value.param == "messages"
    roomy = RequestLimits(max_model_len=p + 1, default_max_tokens=1)
    assert parse(tok, CHAT, {"messages": MESSAGES}, roomy).max_tokens == 1
    with pytest.raises(InvalidRequestError, match=f"you requested {p + 2} tokens") as info:
        parse(tok, CHAT, {"messages": MESSAGES, "max_tokens": 2}, roomy)
    assert info.value.param == "max_tokens"


# -- limits ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [{"max_body_bytes": 0}, {"max_model_len": True}, {"default_max_tokens": -1}, {"max_model_len": 16}],
)
def test_limits_are_checked(fields: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="RequestLimits"):
        RequestLimits(**fields)


def test_limits_load_from_the_environment() -> None:
    limits = load_config(RequestLimits, env_prefix="KAIROS_GATEWAY_", environ={"KAIROS_GATEWAY_MAX_MODEL_LEN": "4096"})
    assert limits == RequestLimits(max_model_len=4096)


def test_a_surrogate_pair_escape_is_ordinary_text(tok: PromptTokenizer) -> None:
    """Only unpaired surrogates are refused: an escaped pair is one character (here an emoji)."""
    escaped = parse(tok, C, b'{"prompt": "emoji \\ud83d\\ude00 ok"}')
    literal = parse(tok, C, {"prompt": "emoji \U0001f600 ok"})
    assert escaped.prompt_tokens == literal.prompt_tokens > 0


# -- the prompt's token ids, for a prefix-cache lookup (parse_request's token_ids) ----------------
def test_token_ids_only_when_asked(tok: PromptTokenizer) -> None:
    assert parse(tok, COMPLETIONS, {"prompt": "Hello there"}).prompt_token_ids is None
    got = parse_request(COMPLETIONS, body(prompt="Hello there"), tok, LIMITS, token_ids=True)
    assert got.prompt_token_ids == tok.encode("Hello there") and got.prompt_tokens == len(got.prompt_token_ids)
    assert got.prompt_token_ids[0] == tok.bos_token_id  # vLLM hashes the BOS too


def test_token_ids_of_a_token_id_prompt_and_of_chat(tok: PromptTokenizer) -> None:
    ids = parse_request(COMPLETIONS, body(prompt=[[5, 6, 7]]), tok, LIMITS, token_ids=True).prompt_token_ids
    assert ids == [5, 6, 7]
    chat = parse_request(CHAT, body(messages=MESSAGES), tok, LIMITS, token_ids=True)
    assert chat.prompt_token_ids == tok.encode(tok.render_chat(MESSAGES), add_special_tokens=False)
    assert chat.prompt_tokens == tok.count_chat_prompt(MESSAGES) == len(chat.prompt_token_ids)


def test_token_ids_past_the_context_refused_from_the_count(tok: PromptTokenizer) -> None:
    small = RequestLimits(max_model_len=8, default_max_tokens=1)
    with pytest.raises(InvalidRequestError, match="more than 8 input tokens"):
        parse_request(COMPLETIONS, body(prompt="word " * 50), tok, small, stop_over_context=True, token_ids=True)


# -- sampling parameters: what vLLM's SamplingParams refuses is refused before routing -------------
@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"temperature": -1}, "temperature", "temperature must be non-negative, got -1.0."),
        ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5."),
        ({"temperature": "hot"}, "temperature", "temperature must be a number, got a string"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5."),
        ({"top_k": -2}, "top_k", "top_k must be 0 (disable), or at least 1, got -2."),
        ({"top_k": 1.5}, "top_k", "top_k must be an integer, got a number"),
        ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1], got 1.5."),
        ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2], got 3.0."),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -2.5."),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be greater than zero, got 0.0."),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be greater than or equal to 0, got -1."),
        (
            {"min_tokens": 5, "max_tokens": 3},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=3, got 5.",
        ),
        ({"min_tokens": None}, "min_tokens", "min_tokens must be an integer, got null"),
        ({"stop": ["a", ""]}, "stop", "stop cannot contain an empty string."),
        ({"stop": 5}, "stop", "stop must be a string or an array of strings, got a number"),
    ],
)
def test_sampling_parameters_vllm_refuses_are_400s(
    tok: PromptTokenizer, fields: dict, param: str, message: str
) -> None:
    for path, base in ((COMPLETIONS, {"prompt": PROMPT}), (CHAT, {"messages": MESSAGES})):
        with pytest.raises(InvalidRequestError) as refused:
            parse(tok, path, {**base, "max_tokens": 4, **fields})
        assert (refused.value.param, str(refused.value)) == (param, message)
        assert error_status(refused.value) == 400


@pytest.mark.parametrize(
    ("path", "fields", "param", "message"),
    [
        (COMPLETIONS, {"logprobs": -2}, "logprobs", "logprobs must be non-negative or -1, got -2."),
        (
            COMPLETIONS,
            {"logprobs": 100},
            "logprobs",
            "Requested sample logprobs of 100, which is greater than max allowed: 20",
        ),
        (
            COMPLETIONS,
            {"logprobs": -1},
            "logprobs",
            "Requested sample logprobs of 4096, which is greater than max allowed: 20",
        ),
        (COMPLETIONS, {"logprobs": "x"}, "logprobs", "`logprobs` must be an integer."),
        (COMPLETIONS, {"logprobs": "2"}, "logprobs", "`logprobs` must be an integer."),
        (COMPLETIONS, {"prompt_logprobs": "1"}, "prompt_logprobs", "`prompt_logprobs` must be an integer."),
        (CHAT, {"top_logprobs": "2", "logprobs": True}, "top_logprobs", "`top_logprobs` must be an integer."),
        (
            COMPLETIONS,
            {"prompt_logprobs": 21},
            "prompt_logprobs",
            "Requested prompt logprobs of 21, which is greater than max allowed: 20",
        ),
        (
            CHAT,
            {"top_logprobs": -3, "logprobs": True},
            "top_logprobs",
            "`top_logprobs` must be a positive value or -1.",
        ),
        (CHAT, {"top_logprobs": 2}, "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."),
        (
            CHAT,
            {"top_logprobs": 30, "logprobs": True},
            "top_logprobs",
            "Requested sample logprobs of 30, which is greater than max allowed: 20",
        ),
    ],
)
def test_logprobs_are_bounded_as_vllm_bounds_them(
    tok: PromptTokenizer, path: str, fields: dict, param: str, message: str
) -> None:
    base = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": MESSAGES}
    with pytest.raises(InvalidRequestError) as refused:
        parse(tok, path, {**base, **fields})
    assert (refused.value.param, str(refused.value)) == (param, message)


def test_sampling_parameters_vllm_takes_pass(tok: PromptTokenizer) -> None:
    """In range, null where vLLM's schema allows it, and read laxly as pydantic reads them."""
    fields = {
        "temperature": 0, "top_p": "0.5", "top_k": -1, "min_p": None, "presence_penalty": -2, "frequency_penalty": 2,
        "repetition_penalty": 1.2, "min_tokens": 4, "max_tokens": 4, "stop": "and", "prompt_logprobs": None,
    }  # fmt: skip
    assert parse(tok, COMPLETIONS, {"prompt": PROMPT, **fields, "logprobs": 20}).max_tokens == 4
    assert parse(tok, CHAT, {"messages": MESSAGES, **fields, "logprobs": True, "top_logprobs": 20}).max_tokens == 4
    assert parse(tok, CHAT, {"messages": MESSAGES, "logprobs": False, "top_logprobs": 0}).n == 1


def test_a_sampling_number_past_a_float_is_out_of_range_not_a_crash(tok: PromptTokenizer) -> None:
    with pytest.raises(InvalidRequestError, match=r"^top_p must be in \(0, 1\], got inf\.$"):
        parse(tok, COMPLETIONS, body(prompt=PROMPT, top_p=10**400))
    with pytest.raises(InvalidRequestError, match=r"^temperature must be a finite number, got -inf\.$"):
        parse(tok, CHAT, body(messages=MESSAGES, temperature=-(10**400)))
