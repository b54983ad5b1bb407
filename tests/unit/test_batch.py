"""kairos.api.batch: a batch's prompts split into one request each, and their answers merged into
the one answer vLLM 0.32 gives (shapes below are vLLM's, as it sent them to these requests)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kairos.api import batch


def answer(rid: str, texts: list[str], prompt_tokens: int, completion: int, cached: int | None) -> dict[str, Any]:
    """A vLLM 0.32 /v1/completions answer to one prompt (its field order)."""
    details = (
        None if cached is None else {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}
    )
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {"index": j, "text": t, "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None}
            for j, t in enumerate(texts)
        ],
        "service_tier": None,
        "system_fingerprint": "vllm-0.32.0",
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
            "completion_tokens_details": None,
        },
        "kv_transfer_params": {"part": rid},
        "ec_transfer_params": None,
        "metrics": {"ttft_s": 0.1},
    }


def test_split_gives_each_prompt_the_batchs_other_fields_in_order() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    parts = batch.split(body, body["prompt"])
    assert parts == [{**body, "prompt": "a"}, {**body, "prompt": "b"}]
    assert [list(p) for p in parts] == [list(body)] * 2  # the body's field order kept
    assert body["prompt"] == ["a", "b"]  # the batch's own body untouched


def test_split_choices_are_vllms_child_requests() -> None:
    body = {"model": "m", "prompt": "a", "n": 3, "seed": 7, "temperature": 0.5}
    assert batch.split_choices(body, 3) == [{**body, "n": 1, "seed": s} for s in (7, 8, 9)]
    unseeded = {"prompt": "a", "n": 2}
    assert batch.split_choices(unseeded, 2) == [{"prompt": "a", "n": 1}] * 2  # each samples on its own
    assert batch.split_choices({"prompt": "a", "n": 2, "seed": None}, 2) == [{"prompt": "a", "n": 1, "seed": None}] * 2


def test_merged_json_numbers_choices_in_prompt_order_and_sums_usage() -> None:
    parts = [answer("b-0", ["x", "y"], 9, 4, 0), answer("b-1", ["z", "w"], 8, 4, 5)]
    merged = batch.merge_responses(parts, "cmpl-b", 1700000005)
    assert list(merged) == list(parts[0])  # vLLM's field order
    assert (merged["id"], merged["created"]) == ("cmpl-b", 1700000005)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "x"), (1, "y"), (2, "z"), (3, "w")]
    assert merged["usage"] == {
        "prompt_tokens": 17,
        "total_tokens": 25,
        "completion_tokens": 8,
        # vLLM reports the last prompt's cache (its last RequestOutput's num_cached_tokens)
        "prompt_tokens_details": {"cached_tokens": 5, "created_cache_tokens": None, "multimodal_tokens": None},
        "completion_tokens_details": None,
    }
    assert merged["kv_transfer_params"] == {"part": "b-0"}  # the first prompt's
    assert merged["metrics"] is None  # per-request timing describes one generation: not a batch's
    assert merged["system_fingerprint"] == "vllm-0.32.0"
    assert parts[0]["choices"][0]["index"] == 0 and parts[1]["choices"][0]["index"] == 0  # inputs untouched


def test_merged_choices_count_each_prompt_once() -> None:
    """Parts one per choice (n 2 over two prompts): prompt p's choice j is part p * 2 + j."""
    parts = [
        answer(f"c-{i}", [t], prompt, 3, 0) for i, (t, prompt) in enumerate(zip("wxyz", (9, 9, 8, 8), strict=True))
    ]
    merged = batch.merge_responses(parts, "cmpl-c", 5, parts_per_prompt=2)
    assert [(ch["index"], ch["text"]) for ch in merged["choices"]] == [(0, "w"), (1, "x"), (2, "y"), (3, "z")]
    assert (merged["usage"]["prompt_tokens"], merged["usage"]["completion_tokens"]) == (17, 12)
    assert merged["usage"]["total_tokens"] == 29


def test_merged_json_without_cache_details_keeps_them_null() -> None:
    merged = batch.merge_responses([answer("0", ["a"], 3, 1, None), answer("1", ["b"], 4, 1, None)], "cmpl-x", 1)
    assert merged["usage"]["prompt_tokens_details"] is None
    with pytest.raises(ValueError, match="not whole prompts"):
        batch.merge_responses([], "cmpl-x", 1)
    with pytest.raises(ValueError, match="3 parts are not whole prompts of 2 parts each"):
        batch.merge_responses([answer(str(i), ["a"], 3, 1, None) for i in range(3)], "cmpl-x", 1, parts_per_prompt=2)


def chunk(rid: str, index: int, text: str, finish: str | None = None) -> dict[str, Any]:
    """A vLLM 0.32 stream chunk of one prompt's answer."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": None,
    }
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": 1700000000, "model": "m", "choices": [choice]}


def usage_chunk(rid: str, prompt: int, completion: int, cached: int) -> dict[str, Any]:
    usage = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "choices": [],
        "usage": usage,
        "system_fingerprint": "vllm-0.32.0",
    }


def test_streamed_chunks_get_the_batch_id_and_index_and_one_usage_chunk_sums_the_prompts() -> None:
    merge = batch.StreamMerge(2, "cmpl-b", 1700000005, choices_per_part=2)
    sent = [
        merge.chunk(1, chunk("b-1", 0, "p")),  # prompt 1's output came first
        merge.chunk(0, chunk("b-0", 1, "q")),
        merge.chunk(0, chunk("b-0", 0, "r", "length")),
        merge.chunk(1, chunk("b-1", 1, "s", "length")),
        merge.chunk(0, usage_chunk("b-0", 9, 4, 0)),
        merge.chunk(1, usage_chunk("b-1", 8, 4, 3)),
    ]
    assert sent[4:] == [None, None]  # the prompts' own usage chunks are not relayed
    chunks = [c for c in sent if c is not None]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [
        (2, "p"),
        (1, "q"),
        (0, "r"),
        (3, "s"),
    ]
    assert {(c["id"], c["created"]) for c in chunks} == {("cmpl-b", 1700000005)}
    assert [list(c) for c in chunks] == [list(chunk("x", 0, ""))] * 4  # vLLM's field order
    assert merge.usage_chunk() == {
        "id": "cmpl-b",
        "object": "text_completion",
        "created": 1700000005,
        "model": "m",
        "choices": [],
        # vLLM's cache report in a stream is its first output's: prompt 1's here
        "usage": {
            "prompt_tokens": 17,
            "total_tokens": 25,
            "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 3},
        },
        "system_fingerprint": "vllm-0.32.0",
    }


def test_streamed_choices_as_parts_count_each_prompt_once() -> None:
    merge = batch.StreamMerge(4, "cmpl-n", 3, parts_per_prompt=2)  # two prompts, n 2, one part per choice
    out = merge.chunk(3, chunk("n-3", 0, "t"))
    assert out is not None and out["choices"][0]["index"] == 3
    for part, prompt in enumerate((9, 9, 8, 8)):
        assert merge.chunk(part, usage_chunk(f"n-{part}", prompt, 2, 0)) is None
    final = merge.usage_chunk()
    assert final is not None
    assert (final["usage"]["prompt_tokens"], final["usage"]["completion_tokens"]) == (17, 8)
    with pytest.raises(ValueError, match="3 parts of 1 choices, 2 per prompt"):
        batch.StreamMerge(3, "cmpl-n", 3, parts_per_prompt=2)


def test_continuous_usage_rides_on_each_chunk_and_no_usage_asked_means_no_usage_chunk() -> None:
    merge = batch.StreamMerge(2, "cmpl-c", 7)
    with_usage = {**chunk("c-1", 0, "t"), "usage": {"prompt_tokens": 8, "total_tokens": 9, "completion_tokens": 1}}
    out = merge.chunk(1, with_usage)
    assert out is not None and out["choices"][0]["index"] == 1 and out["usage"] == with_usage["usage"]
    assert merge.usage_chunk() is None
    with pytest.raises(ValueError, match="part 2 is not one of the request's 2"):
        merge.chunk(2, chunk("c-2", 0, "t"))


def test_a_usage_chunk_without_metrics_and_an_error_event() -> None:
    merge = batch.StreamMerge(1, "cmpl-d", 1)
    assert merge.chunk(0, {**usage_chunk("d-0", 3, 1, 0), "metrics": {"ttft_s": 1.0}}) is None
    final = merge.usage_chunk()
    assert final is not None and "metrics" not in final
    assert batch.is_error_event({"error": {"message": "boom", "type": "BadRequestError", "param": None, "code": 400}})
    assert not batch.is_error_event(chunk("d-0", 0, "x"))


def test_sse_events_come_whole_across_reads_and_line_endings() -> None:
    first, second = json.dumps(chunk("e", 0, "a")).encode(), json.dumps(chunk("e", 0, "b")).encode()
    stream = b"data: " + first + b"\n\ndata: " + second + b"\r\n\r\ndata: [DONE]\n\n"
    for cut in range(1, len(stream)):  # wherever the network splits it
        sse = batch.SseEvents()
        got = sse.feed(stream[:cut]) + sse.feed(stream[cut:])
        assert got == [first, second, b"[DONE]"], cut
        assert sse.pending == b""
    sse = batch.SseEvents()
    assert sse.feed(b": a comment\n\ndata: " + first[:10]) == [] and sse.pending
