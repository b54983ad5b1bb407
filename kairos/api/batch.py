"""Batch prompts and ``n`` > 1: split into one request per engine request vLLM would run, and
the answers merged back into the one answer vLLM gives (vLLM 0.32's ``OpenAIServingCompletion``
and its ``ParentRequest``).

vLLM runs a batch (``prompt`` a list of several strings or of several token-id lists) as one
engine request per prompt, and ``n`` > 1 as ``n`` child requests per prompt (``n`` 1 each; seeded,
child ``j`` gets ``seed + j``), and answers once for all of them:

- JSON: one ``id`` and ``created`` for the batch; the choices of prompt 0, then of prompt 1, ...,
  numbered 0, 1, 2, ... in that order (with ``n`` choices per prompt, prompt ``p``'s choice ``j``
  is ``p * n + j``); ``usage`` sums the prompts' prompt and completion tokens (a prompt counts
  once whatever its ``n``), its ``prompt_tokens_details`` is the last prompt's;
  ``kv_transfer_params`` are the first prompt's, ``metrics`` are left out (they describe one
  generation).
- SSE: each prompt's chunks as they come, interleaved, each choice carrying its batch index; the
  prompts' own usage chunks and ``[DONE]`` are not relayed. With ``stream_options.include_usage``
  one usage chunk follows the last token chunk (the sums; ``prompt_tokens_details`` those of the
  prompt whose output came first), then one ``data: [DONE]``.
- A prompt that fails fails the whole request: before any byte is sent, its error is the answer;
  mid-stream, its error event, then ``[DONE]`` (vLLM's stream generator ends with ``[DONE]``
  after an error too).

The gateway fans such a request out as one request per prompt (:func:`split`) and per choice
(:func:`split_choices`), each routed by the dispatcher on its own, and merges the answers here;
the emulated vLLM node answers its own batches through the same functions. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PROMPT = "prompt"
N = "n"
SEED = "seed"
CHOICES = "choices"
INDEX = "index"
USAGE = "usage"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
TOTAL_TOKENS = "total_tokens"
PROMPT_TOKENS_DETAILS = "prompt_tokens_details"
METRICS = "metrics"  # per-request timing: vLLM leaves it out of a batch's answer
ERROR = "error"
SSE_DONE = b"data: [DONE]\n\n"


def split(body: Mapping[str, Any], prompts: Sequence[str | list[int]]) -> list[dict[str, Any]]:
    """One body per prompt: the batch's body with its ``prompt`` replaced (every other field, ``n``
    and ``stream_options`` included, as the batch had it: vLLM applies them to each prompt)."""
    return [{**body, PROMPT: prompt} for prompt in prompts]


def split_choices(body: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    """One body per choice of a prompt's ``n``, as vLLM's child requests: ``n`` 1 each, and a
    seeded request's choice ``j`` seeded ``seed + j``."""
    seed = body.get(SEED)
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    return [{**body, N: 1, **({SEED: seed + j} if seeded else {})} for j in range(n)]


def _usage_sums(usages: Sequence[Mapping[str, Any]], parts_per_prompt: int) -> dict[str, Any]:
    """The batch's token counts: every part's output, each prompt once (its first part's)."""
    prompt = sum(int(u.get(PROMPT_TOKENS) or 0) for u in usages[::parts_per_prompt])
    completion = sum(int(u.get(COMPLETION_TOKENS) or 0) for u in usages)
    return {PROMPT_TOKENS: prompt, TOTAL_TOKENS: prompt + completion, COMPLETION_TOKENS: completion}


def merge_responses(
    parts: Sequence[Mapping[str, Any]], response_id: str, created: int, parts_per_prompt: int = 1
) -> dict[str, Any]:
    """The JSON answer from its parts' own answers, in order: one part per prompt, or (with
    ``parts_per_prompt`` the request's ``n``) one per choice of each prompt."""
    if not parts or len(parts) % parts_per_prompt:
        raise ValueError(f"{len(parts)} parts are not whole prompts of {parts_per_prompt} parts each")
    choices: list[dict[str, Any]] = []
    for part in parts:
        for choice in part[CHOICES]:
            choices.append({**choice, INDEX: len(choices)})
    usage: dict[str, Any] = {**parts[0][USAGE], **_usage_sums([p[USAGE] for p in parts], parts_per_prompt)}
    if PROMPT_TOKENS_DETAILS in usage:
        usage[PROMPT_TOKENS_DETAILS] = parts[-1][USAGE].get(PROMPT_TOKENS_DETAILS)
    merged = {**parts[0], "id": response_id, "created": created, CHOICES: choices, USAGE: usage}
    if METRICS in merged:
        merged[METRICS] = None
    return merged


def is_error_event(payload: Mapping[str, Any]) -> bool:
    """An SSE event that reports a failure (vLLM's ``{"error": {...}}``) rather than a chunk."""
    return ERROR in payload and CHOICES not in payload


class StreamMerge:
    """Merges the SSE streams of a request's parts into vLLM's one stream.

    Feed it each part's chunks as they arrive (:meth:`chunk`): a token chunk comes back with the
    request's id, created time and choice indices, to send at once; a part's own usage chunk
    comes back None (kept for :meth:`usage_chunk`). The parts are one per prompt, each with
    ``choices_per_part`` choices (the request's ``n``), or one per choice, ``parts_per_prompt``
    (the request's ``n``) for each prompt.
    """

    def __init__(
        self, parts: int, response_id: str, created: int, *, choices_per_part: int = 1, parts_per_prompt: int = 1
    ) -> None:
        if parts < 1 or choices_per_part < 1 or parts_per_prompt < 1 or parts % parts_per_prompt:
            raise ValueError(f"{parts} parts of {choices_per_part} choices, {parts_per_prompt} per prompt")
        self.parts, self.choices_per_part, self.parts_per_prompt = parts, choices_per_part, parts_per_prompt
        self.response_id, self.created = response_id, created
        self._usage: dict[int, Mapping[str, Any]] = {}  # each part's own usage chunk
        self._first: int | None = None  # the part whose output came first

    def chunk(self, part: int, payload: Mapping[str, Any]) -> dict[str, Any] | None:
        if not 0 <= part < self.parts:
            raise ValueError(f"part {part} is not one of the request's {self.parts}")
        if self._first is None:
            self._first = part
        choices = payload.get(CHOICES)
        if not choices and USAGE in payload and payload[USAGE] is not None:
            self._usage[part] = payload
            return None
        offset = part * self.choices_per_part
        out = {**payload, "id": self.response_id, "created": self.created}
        if choices:
            out[CHOICES] = [{**choice, INDEX: int(choice.get(INDEX, 0)) + offset} for choice in choices]
        return out

    def usage_chunk(self) -> dict[str, Any] | None:
        """The final usage chunk, once every part's stream has ended (None when the parts sent
        none: the request did not ask for usage)."""
        if not self._usage:
            return None
        template = self._usage.get(self._first if self._first is not None else 0) or next(iter(self._usage.values()))
        usages = [self._usage[p][USAGE] for p in range(self.parts) if p in self._usage]
        usage = {**template[USAGE], **_usage_sums(usages, self.parts_per_prompt)}
        out = {**template, "id": self.response_id, "created": self.created, CHOICES: [], USAGE: usage}
        out.pop(METRICS, None)  # dumped without None fields: absent rather than null
        return out


class SseEvents:
    """Splits an SSE byte stream into its events' ``data`` payloads (vLLM's events are one
    ``data:`` line each, ended by a blank line); a payload split across reads is kept until whole."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._pending + data
        events = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        self._pending = events.pop()
        payloads = []
        for event in events:
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                payloads.append(b"\n".join(lines))
        return payloads

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet ended (b"" at a clean end of stream)."""
        return self._pending
