"""The sidecar's split route, its pure parts: the dispatcher's split headers checked against each
other, the prompt's ids from a body, the /tokenize request for the rest, and hop 1's body."""

from __future__ import annotations

from typing import Any

import pytest

from kairos.common import contracts as c
from kairos.nodeagent.sidecar import HOP1_KV_TRANSFER_PARAMS
from kairos.nodeagent.sidecar.split import (
    SplitDegraded,
    SplitRoute,
    body_token_ids,
    check_split_fits,
    parse_split_route,
    parse_tokenize_reply,
    split_hop1_body,
    tokenize_request,
)


def headers(**values: str) -> dict[str, str]:
    base = {c.H_SPLIT_TOKENS: "512", c.H_CHUNK_SCHEDULE: "300,200,8", c.H_PROMPT_TOKENS: "1020"}
    return {**base, **{getattr(c, name): v for name, v in values.items()}}


def test_a_split_route_is_its_headers() -> None:
    assert parse_split_route(headers()) == SplitRoute(512, (300, 200, 8), None, 1020)
    assert parse_split_route(headers(H_STEP_BUDGET_MS="42.5")).step_budget_ms == 42.5
    # Without the dispatcher's prompt count: k plus the schedule of the rest.
    no_count = {k: v for k, v in headers().items() if k != c.H_PROMPT_TOKENS}
    assert parse_split_route(no_count).prompt_tokens == 1020


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"H_SPLIT_TOKENS": "1020"}, "below the prompt's 1020 tokens"),
        ({"H_SPLIT_TOKENS": "2000"}, "below the prompt's"),
        ({"H_SPLIT_TOKENS": "0"}, "not a positive integer"),
        ({"H_SPLIT_TOKENS": "-16"}, "not a positive integer"),
        ({"H_SPLIT_TOKENS": "1e3"}, "not a positive integer"),
        ({"H_SPLIT_TOKENS": " 512"}, "not a positive integer"),
        ({"H_CHUNK_SCHEDULE": "300,200"}, "covers 500 tokens, not the 508"),
        ({"H_CHUNK_SCHEDULE": "300,0,208"}, "not a list of positive integers"),
        ({"H_PROMPT_TOKENS": "1"}, "not a prompt a split can take"),
        ({"H_PROMPT_TOKENS": "many"}, "not a prompt a split can take"),
        ({"H_STEP_BUDGET_MS": "inf"}, "not a positive number"),
    ],
)
def test_split_headers_that_disagree_are_malformed(values: dict[str, str], fragment: str) -> None:
    with pytest.raises(c.MalformedSchedule, match=fragment):
        parse_split_route(headers(**values))


@pytest.mark.parametrize("missing", [c.H_SPLIT_TOKENS, c.H_CHUNK_SCHEDULE])
def test_a_split_needs_its_k_and_its_schedule(missing: str) -> None:
    with pytest.raises(c.MalformedSchedule, match=f"without {missing}"):
        parse_split_route({k: v for k, v in headers().items() if k != missing})


@pytest.mark.parametrize(
    ("prompt", "ids"),
    [
        ([5, 6, 7], [5, 6, 7]),
        ([[5, 6, 7]], [5, 6, 7]),  # a batch of one
        ("text", None),
        (["text"], None),
        ([[1, 2], [3, 4]], None),  # several prompts: no one prompt's ids
        ([], None),
        ([1, True], None),
        ([1, 2.0], None),
    ],
)
def test_a_prompt_of_token_ids_is_its_own_ids(prompt: Any, ids: list[int] | None) -> None:
    assert body_token_ids({"prompt": prompt}) == ids


def test_the_tokenize_request_carries_what_shapes_the_prompt() -> None:
    completion = {"model": "m", "prompt": ["hi"], "max_tokens": 3, "add_special_tokens": False, "n": 2}
    assert tokenize_request("/v1/completions", completion) == {
        "model": "m",
        "prompt": "hi",
        "add_special_tokens": False,
    }
    assert tokenize_request("/v1/completions", {"prompt": "hi"}) == {"prompt": "hi"}
    messages = [{"role": "user", "content": "hi"}]
    chat = {
        "model": "m",
        "messages": messages,
        "temperature": 0,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    assert tokenize_request("/v1/chat/completions", chat) == {k: v for k, v in chat.items() if k != "temperature"}
    assert tokenize_request("/v1/chat/completions", {"messages": messages}) == {
        "messages": messages,
        "add_generation_prompt": True,  # vLLM's default for a chat completion
    }
    for prompt in ([[1, 2], [3]], ["a", "b"], None, 3):
        with pytest.raises(SplitDegraded) as raised:
            tokenize_request("/v1/completions", {"prompt": prompt})
        assert raised.value.reason == "unsupported_prompt"


def test_a_tokenize_reply_is_its_ids() -> None:
    assert parse_tokenize_reply(b'{"count": 3, "max_model_len": 8, "tokens": [1, 2, 3], "token_strs": null}') == [
        1,
        2,
        3,
    ]
    for raw in (b"{", b"[]", b'{"tokens": [1, -2]}', b'{"tokens": [1, "2"]}', b'{"count": 2, "tokens": [1]}', b"\xff"):
        with pytest.raises(ValueError):
            parse_tokenize_reply(raw)


def test_a_split_fits_only_the_dispatchers_count() -> None:
    route = SplitRoute(16, (4,), None, 20)
    check_split_fits(route, list(range(20)))
    for n in (19, 21, 16):
        with pytest.raises(SplitDegraded) as raised:
            check_split_fits(route, list(range(n)))
        assert raised.value.reason == "prompt_mismatch"


def test_hop_1_of_a_split_is_a_completion_of_the_first_k_ids() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50,
        "stream": True,
        "n": 3,
        "min_tokens": 4,
        "priority": -1,
        "cache_salt": "s",
        c.VLLM_XARGS: {"tag": "a"},
    }
    hop = split_hop1_body(body, [9, 8, 7])
    assert hop == {
        "model": "m",
        "prompt": [9, 8, 7],
        "max_tokens": 1,
        "stream": False,
        "priority": -1,
        "cache_salt": "s",
        c.VLLM_XARGS: {"tag": "a"},
        c.KV_TRANSFER_PARAMS: dict(HOP1_KV_TRANSFER_PARAMS),
    }
    assert hop[c.KV_TRANSFER_PARAMS] is not HOP1_KV_TRANSFER_PARAMS  # a copy: the constant stays as it is
