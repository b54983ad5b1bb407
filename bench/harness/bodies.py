"""Request bodies the benchmarks send: /v1/completions of a given size in English-like text (the
tiny model's common words), so that a tokenizer sees words rather than noise."""

from __future__ import annotations

import json
import random

from kairos.launcher.tinymodel import _COMMON_TEXT

MODEL = "kairos-tiny-llama"


def prompt_text(chars: int, seed: int) -> str:
    """English-like sentences (the tiny model's common words), ``chars`` characters long."""
    words = _COMMON_TEXT.split()
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 18))).capitalize() + "."
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)[:chars]


def completion_body(total_bytes: int, seed: int) -> bytes:
    """A /v1/completions JSON body of about ``total_bytes`` bytes, max_tokens 1."""
    shell = json.dumps({"model": MODEL, "prompt": "", "max_tokens": 1, "temperature": 0})
    return json.dumps(
        {"model": MODEL, "prompt": prompt_text(total_bytes - len(shell), seed), "max_tokens": 1, "temperature": 0}
    ).encode()
