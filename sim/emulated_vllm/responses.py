"""The node's answers in vLLM's shapes: one prompt's response, stream chunks and usage
(:class:`Output`), its sequences' tokens as the engine produces them, the words it streams, and
its JSON and SSE encoding."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kairos.api.openai_request import ParsedRequest
from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.sim.engine import Sequence as EngineSeq
from kairos.sim.realtime import TokenEvent, TokenStream

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
# One short word per output token: the text is noise, the token accounting is what matters. The
# node streams words the model's tokenizer holds as one token each (see ``one_token_words``), as
# vLLM streams one detokenized token per step; these are the fallback for a tokenizer with none.
_WORDS = (" lorem", " ipsum", " dolor", " sit", " amet", " sed", " do", " magna", " aliqua", " enim")
_WORD_COUNT = len(_WORDS)


@dataclass(slots=True)
class Output:
    """One prompt's answer: its ``n`` sequences (vLLM's child requests), by choice index."""

    parsed: ParsedRequest
    rid: str
    model: str
    created: int
    words: tuple[str, ...]  # the text of output token i is words[(i - 1) % len(words)]
    seqs: list[EngineSeq] = field(default_factory=list)
    streams: list[TokenStream] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # output tokens produced so far
    last_at: list[float | None] = field(default_factory=list)  # model time of the latest token
    cached: list[int] = field(default_factory=list)  # prompt tokens found cached (or transferred)
    created_cache: list[int] = field(default_factory=list)  # prompt tokens written to the cache
    details: bool = False  # --enable-prompt-tokens-details: usage says what was cached
    first: int | None = None  # the sequence whose first token came first
    finished: list[int] = field(default_factory=list)  # the sequences in the order they finished

    def add(self, seq: EngineSeq, stream: TokenStream, cached: int, created_cache: int) -> None:
        self.seqs.append(seq)
        self.streams.append(stream)
        self.tokens.append(0)
        self.last_at.append(None)
        self.cached.append(cached)
        self.created_cache.append(created_cache)

    @property
    def chat(self) -> bool:
        return self.parsed.kind == "chat"

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.rid}"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, streamed: bool = False) -> dict[str, Any]:
        p, generated = self.parsed.prompt_tokens, sum(self.tokens)  # the prompt once, every choice's tokens
        return {
            "prompt_tokens": p,
            "total_tokens": p + generated,
            "completion_tokens": generated,
            "prompt_tokens_details": self._details(streamed),
        }

    def _details(self, streamed: bool) -> dict[str, Any] | None:
        """vLLM 0.32's ``PromptTokenUsageInfo`` as its handlers fill and dump it: chat sets the
        cached and the created tokens, completions only the cached ones; a response is dumped
        whole, a stream's chunk with its unset fields left out. With n > 1 they are one child
        request's: a stream's first output's, a response's last to finish (its final output)."""
        if not self.details or not self.seqs:
            return None
        if streamed:
            reporter = 0 if self.first is None else self.first
        else:
            reporter = self.finished[-1] if self.finished else len(self.seqs) - 1
        cached = self.cached[reporter]
        if self.chat:
            return {"cached_tokens": cached, "created_cache_tokens": self.created_cache[reporter],
                    "multimodal_tokens": None}  # fmt: skip
        if streamed:
            return {"cached_tokens": cached}
        return {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}

    def word(self, index: int) -> str:
        return self.words[(index - 1) % len(self.words)]

    def _finish(self, choice: int) -> str:
        return "length" if self.tokens[choice] >= self.parsed.max_tokens else "abort"

    def response(self, kv_params: dict[str, Any] | None) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for j, tokens in enumerate(self.tokens):
            text = "".join(self.word(i) for i in range(1, tokens + 1))
            if self.chat:
                message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": []}
                choices.append(
                    {
                        "index": j,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": self._finish(j),
                        "stop_reason": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": j,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": self._finish(j),
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                )
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": self.usage(),
            "prompt_logprobs": None,
            c.KV_TRANSFER_PARAMS: kv_params,
        }

    def role_chunk(self, choice: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": choice, "delta": delta, "logprobs": None, "finish_reason": None}],
        }

    def token_chunk(self, event: TokenEvent, choice: int) -> dict[str, Any]:
        finish = "length" if event.last else None
        if self.chat:
            delta: dict[str, Any] = {
                "index": choice,
                "delta": {"content": self.word(event.index)},
                "logprobs": None,
                "finish_reason": finish,
            }
            if finish:
                delta["stop_reason"] = None
            return {**self._head("chat.completion.chunk"), "choices": [delta]}
        text = {
            "index": choice,
            "text": self.word(event.index),
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
        # No "usage" key: vLLM writes a chunk with exclude_unset, and sets usage only on the
        # usage chunk (or with continuous_usage_stats, which the emulated node does not serve).
        return {**self._head("text_completion"), "choices": [text]}

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(streamed=True)}


async def token_events(outs: Sequence[Output]) -> AsyncIterator[tuple[int, int, TokenEvent]]:
    """Every sequence's tokens as the engine produces them: (prompt, choice, event). One
    sequence (no batch, n 1) is read directly; several through one queue, in the order they come."""
    streams = [(i, j, stream) for i, out in enumerate(outs) for j, stream in enumerate(out.streams)]
    if len(streams) == 1:
        i, j, stream = streams[0]
        async for event in stream:
            yield i, j, event
        return
    queue: asyncio.Queue[tuple[int, int, TokenEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, j: int, stream: TokenStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((i, j, event))
        except Exception as exc:  # EngineStoppedError: the reader raises it
            queue.put_nowait((i, j, exc))
        else:
            queue.put_nowait((i, j, None))

    pumps = [asyncio.create_task(pump(i, j, stream)) for i, j, stream in streams]
    try:
        for _ in range(len(streams)):
            while True:
                i, j, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield i, j, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def one_token_words(tokenizer: PromptTokenizer) -> tuple[str, ...]:
    """Up to ``_WORD_COUNT`` words (a leading space and letters) that ``tokenizer`` encodes as one
    token each, lowest token id first; ``_WORDS`` when it holds none. Clients that count output
    tokens by re-tokenizing each streamed chunk (inference-perf's ITL does) then count one token
    per chunk, as against vLLM."""
    raw = tokenizer.raw_tokenizer
    words: list[str] = []
    for token_id in range(tokenizer.vocab_size):
        text = raw.decode([token_id])
        word = len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
        if word and raw.encode(text, add_special_tokens=False).ids == [token_id]:
            words.append(text)
            if len(words) == _WORD_COUNT:
                break
    return tuple(words) or _WORDS


def single_token_ids(tokenizer: PromptTokenizer, words: Sequence[str]) -> tuple[int, ...] | None:
    """Each word's one token id, or None when some word is not one token (the fallback words):
    then only the prompt's blocks are cached."""
    raw = tokenizer.raw_tokenizer
    encoded = [raw.encode(w, add_special_tokens=False).ids for w in words]
    return tuple(e[0] for e in encoded) if all(len(e) == 1 for e in encoded) else None


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()
