"""What ``kairos replay`` sends: prompts whose token blocks repeat exactly as the workload says,
and the turn chains of its conversations. Pure: no I/O once the tokenizer is loaded.

Prompt content. A workload or trace says which prompts share which prefix through block hashes
(``RequestSpec.block_hashes``, one per ``BLOCK_TOKENS``-token KV block: the multi-turn
workload's shared system prompts and conversations, Mooncake's ``hash_ids``). Token block ``j``
of a prompt is drawn from a vocabulary by a digest of block ``j``'s hash, or past the hashes of
the request id and ``j``; so two prompts share exactly the blocks whose hashes they share (a
shared system prompt is the same text byte for byte), and requests without hashes share nothing
(a prefix cache sees no reuse in Bursty, as the workload says).

The vocabulary is words the tokenizer encodes as one token each, a space and ASCII letters (the
emulated node streams such words too). Under a byte-level BPE pre-tokenizer (GPT-2's, Llama 3's,
Qwen2's regex: the tiny model's and the usual served models') each such word is a pre-token of
its own whatever precedes it, and BPE never merges across pre-tokens, so the ids of a text of
words are the concatenation of the words' ids: n words are n tokens, and a text that starts with
another starts with its ids. :meth:`Vocabulary.from_tokenizer` checks that on a sample and limits
a tokenizer that breaks it to token-id prompts. Without a tokenizer, prompts are token ids from a
fixed range.

Conversations. Turn k's prompt is turn k-1's prompt text, then the answer the server streamed
for it, then a new user message of words (:meth:`PromptBuilder.continuation`). The previous
prompt ends in a word, so the token prefix survives the join whenever the answer starts with
anything but a letter (a space, a newline, a digit, punctuation), as the emulated node's always
do; an answer starting with letters can merge with that word (a real model's mid-word
continuation, a dummy-weight model's noise), and the replay records how many tokens each turn
kept (``RequestResult.prefix_tokens``). Turn k is released ``think_s`` after turn k-1's answer
ended when the trace names it with ``after`` (closed loop, as the simulator runs it); a trace with
only session and turn ids releases it at its own arrival time, and never before the answer it
quotes (:func:`turn_chains`, :meth:`Turn.release`).
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kairos.api.tokenizer import PromptTokenizer
from kairos.common.errors import ConfigError
from kairos.traffic.requests import BLOCK_TOKENS, RequestSpec

# Without a tokenizer: BOS (id 1 in Llama-style vocabularies), then ids 100..199, valid in any
# vocabulary of >= 200 ids.
FALLBACK_HEAD = (1,)
FALLBACK_IDS = tuple(range(100, 200))
# A tokenizer with fewer one-token words than this is not the byte-level BPE the text relies on.
MIN_WORDS = 64
_CHECK_SAMPLES = 32  # random texts the vocabulary check encodes
_CHECK_WORDS = 48  # words in each


@dataclass(frozen=True)
class Vocabulary:
    """The tokens prompts are drawn from: ``ids[i]`` is the one token of ``words[i]``; ``head`` is
    what the tokenizer puts before a text prompt (BOS), so a text of n words is ``len(head) + n``
    tokens. Without words (no tokenizer, or one whose words do not join cleanly, said in
    ``no_text``) prompts are token ids only, and conversations cannot be replayed."""

    ids: tuple[int, ...]
    head: tuple[int, ...]
    words: tuple[str, ...] = ()
    no_text: str = "text prompts (conversations) need the served model's tokenizer: pass --model-dir"

    @property
    def has_text(self) -> bool:
        return bool(self.words)

    @classmethod
    def fallback(cls) -> Vocabulary:
        return cls(ids=FALLBACK_IDS, head=FALLBACK_HEAD)

    @classmethod
    def from_tokenizer(cls, tok: PromptTokenizer) -> Vocabulary:
        """Every vocabulary entry that decodes to a space and ASCII letters and encodes back to
        itself alone, lowest id first. Text only if there are ``MIN_WORDS`` of them and texts of
        them tokenize as the tokenizer's head and then their ids, nothing else; otherwise token ids
        only (the words' ids, or the fallback range when there are too few)."""
        raw = tok.raw_tokenizer
        words: list[str] = []
        ids: list[int] = []
        for token_id in range(tok.vocab_size):
            text = raw.decode([token_id])
            word = len(text) > 1 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
            if word and raw.encode(text, add_special_tokens=False).ids == [token_id]:
                words.append(text)
                ids.append(token_id)
        head = tuple(tok.encode("", add_special_tokens=True))
        if len(words) < MIN_WORDS:
            reason = f"the tokenizer holds {len(words)} one-token words (a space and letters), text needs {MIN_WORDS}"
            return cls(ids=FALLBACK_IDS, head=head, no_text=reason)
        rng = random.Random(0)
        for _ in range(_CHECK_SAMPLES):
            picks = [rng.randrange(len(words)) for _ in range(_CHECK_WORDS)]
            text = "".join(words[i] for i in picks)
            if tok.completion_prompt_ids(text) != [*head, *(ids[i] for i in picks)]:
                reason = (
                    "the tokenizer merges or splits words across their joins (not a byte-level BPE one?): "
                    f"{text[:60]!r}... does not encode as its words' ids, so text prompts would not be exact"
                )
                return cls(ids=tuple(ids), head=head, no_text=reason)
        return cls(ids=tuple(ids), head=head, words=tuple(words))


def _block_key(spec: RequestSpec, block: int) -> bytes:
    """What names block ``block``'s tokens: its hash where the workload gives one, otherwise the
    request and the block (content of its own)."""
    if block < len(spec.block_hashes):
        return b"h%d" % spec.block_hashes[block]
    return b"r" + spec.request_id.encode() + struct.pack("<I", block)


def _picks(keys: Sequence[bytes], start: int, end: int, size: int) -> list[int]:
    """Vocabulary indices in [0, size) of positions [start, end) of a sequence whose block j is
    named by ``keys[j]``: each block's ``BLOCK_TOKENS`` draws are a pure function of its key."""
    if end <= start:
        return []
    first, last = start // BLOCK_TOKENS, -(-end // BLOCK_TOKENS)
    raw = b"".join(hashlib.blake2b(key, digest_size=2 * BLOCK_TOKENS).digest() for key in keys[first:last])
    draws = np.frombuffer(raw, dtype="<u2") % size
    offset = first * BLOCK_TOKENS
    picks: list[int] = draws[start - offset : end - offset].tolist()
    return picks


class PromptBuilder:
    """Prompts for requests (token ids, or text with a tokenizer) and their request bodies."""

    def __init__(self, vocab: Vocabulary, tokenizer: PromptTokenizer | None = None) -> None:
        self.vocab = vocab
        self.tokenizer = tokenizer  # counts a later turn's prompt (its answer is the server's text)

    @classmethod
    def from_model_dir(cls, model_dir: str) -> PromptBuilder:
        if not model_dir:
            return cls(Vocabulary.fallback())
        tok = PromptTokenizer.from_dir(Path(model_dir))
        return cls(Vocabulary.from_tokenizer(tok), tok)

    def _prompt_picks(self, spec: RequestSpec) -> list[int]:
        """Vocabulary indices of the prompt's tokens after the head."""
        head = min(len(self.vocab.head), spec.prompt_tokens)
        keys = [_block_key(spec, j) for j in range(-(-spec.prompt_tokens // BLOCK_TOKENS))]
        return _picks(keys, head, spec.prompt_tokens, len(self.vocab.ids))

    def ids(self, spec: RequestSpec) -> list[int]:
        """Exactly ``spec.prompt_tokens`` token ids: the head, then the blocks as described."""
        ids = self.vocab.ids
        return [*self.vocab.head[: spec.prompt_tokens], *(ids[i] for i in self._prompt_picks(spec))]

    def text(self, spec: RequestSpec) -> str:
        """The text whose ids (head included) are :meth:`ids`."""
        self._need_text()
        words = self.vocab.words
        return "".join(words[i] for i in self._prompt_picks(spec))

    def message(self, request_id: str, tokens: int) -> str:
        """A new user message of exactly ``tokens`` words, content of its own."""
        self._need_text()
        keys = [b"m" + request_id.encode() + struct.pack("<I", j) for j in range(-(-tokens // BLOCK_TOKENS))]
        words = self.vocab.words
        return "".join(words[i] for i in _picks(keys, 0, tokens, len(words)))

    def continuation(self, previous_prompt: str, answer: str, turn: Turn) -> str:
        """Turn ``turn``'s prompt: the previous prompt, the answer the server gave, a new message."""
        return previous_prompt + answer + self.message(turn.spec.request_id, turn.message_tokens)

    def prompt_ids(self, text: str) -> list[int]:
        """The ids the server runs for a text prompt (what its prefix cache hashes)."""
        if self.tokenizer is None:
            raise ConfigError("counting a text prompt needs the model's tokenizer (--model-dir)")
        return self.tokenizer.completion_prompt_ids(text)

    def _need_text(self) -> None:
        if not self.vocab.has_text:
            raise ConfigError(self.vocab.no_text)

    @staticmethod
    def body(model: str, prompt: str | list[int], max_tokens: int) -> bytes:
        payload = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return json.dumps(payload, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------
# Conversations: which turn continues which, and when it is released
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    """One request in its chain. A chain's head is sent at its arrival time with a prompt of its
    own; every later turn continues the one before it."""

    spec: RequestSpec
    message_tokens: int = 0  # the new message's tokens after the previous prompt and answer (0: head)
    closed_loop: bool = False  # released think_s after the previous answer (the trace's ``after``)

    def release(self, previous_end: float, arrival: float, scale: float) -> float:
        """Wall time to send this later turn, given when the previous answer ended and the wall
        time of its own arrival in the trace: ``think_s`` (model seconds, / ``scale``) after that
        answer when closed loop, else its arrival but never before the answer it quotes."""
        if self.closed_loop:
            return previous_end + self.spec.think_s / scale
        return max(arrival, previous_end)


def turn_chains(requests: Sequence[RequestSpec]) -> list[list[Turn]]:
    """The requests as chains of turns, in order of their heads' arrival (a request outside any
    conversation is a chain of one).

    A request continues the one its ``after`` names (closed loop); without ``after``, a request
    with a session id and turn k > 1 continues its session's turn k - 1 (open loop). A request
    whose predecessor is not among ``requests`` (a truncated trace) heads a chain of its own.
    Refused (ConfigError): two requests continuing one, and a turn whose prompt is not longer than
    its predecessor's prompt and answer (it must resend both and add a message)."""
    by_id = {r.request_id: r for r in requests}
    by_turn = {(r.session_id, r.turn): r for r in requests if r.session_id is not None and r.turn >= 1}
    previous: dict[str, tuple[RequestSpec, bool]] = {}
    for r in requests:
        if r.after is not None:
            prev = by_id.get(r.after)
            closed = True
        elif r.session_id is not None and r.turn > 1:
            prev = by_turn.get((r.session_id, r.turn - 1))
            closed = False
        else:
            prev = None
        if prev is not None:
            previous[r.request_id] = (prev, closed)
    nexts: dict[str, RequestSpec] = {}
    for rid, (prev, _) in previous.items():
        if prev.request_id in nexts:
            raise ConfigError(
                f"requests {nexts[prev.request_id].request_id} and {rid} both continue {prev.request_id}: a "
                "conversation is one chain of turns"
            )
        nexts[prev.request_id] = by_id[rid]
    chains: list[list[Turn]] = []
    for head in sorted((r for r in requests if r.request_id not in previous), key=lambda r: r.arrival_s):
        chain = [Turn(head)]
        # Each request continues at most one and is continued by at most one, so a walk from a
        # head never meets a cycle (requests in one have no head and are counted below).
        while (nxt := nexts.get(chain[-1].spec.request_id)) is not None:
            prev_spec, closed = previous[nxt.request_id]
            message = nxt.prompt_tokens - prev_spec.prompt_tokens - prev_spec.output_tokens
            if message < 1:
                raise ConfigError(
                    f"{nxt.request_id}: a later turn's prompt ({nxt.prompt_tokens} tokens) must be longer than "
                    f"{prev_spec.request_id}'s prompt + answer ({prev_spec.prompt_tokens} + "
                    f"{prev_spec.output_tokens})"
                )
            chain.append(Turn(nxt, message, closed))
        chains.append(chain)
    placed = sum(len(chain) for chain in chains)
    if placed != len(requests):
        raise ConfigError(f"{len(requests) - placed} requests wait for each other in a cycle (see their 'after')")
    return chains


def chain_deadline(
    chain: Sequence[Turn], head_at: float, arrival: Sequence[float], scale: float, timeout_s: float
) -> float:
    """The latest wall time ``chain`` can finish if every turn takes up to ``timeout_s``: its
    head sent at ``head_at``, ``arrival[k]`` turn k's arrival in wall time."""
    end = head_at + timeout_s
    for turn, at in zip(chain[1:], arrival[1:], strict=True):
        end = turn.release(end, at, scale) + timeout_s
    return end


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
