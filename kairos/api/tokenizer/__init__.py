"""Prompt token counting that matches what vLLM will count for the same request
(:class:`PromptTokenizer`), in four modules:

- ``prompt_tokenizer``: :class:`PromptTokenizer`, a model's tokenizer and chat template loaded
  from its files, counting and encoding prompts as vLLM does;
- ``word_counter``: the exact counter that needs no ``Encoding`` (byte-level BPE tokenizers);
- ``chat_template``: the chat template rendered as transformers renders it, its content format
  and its errors;
- ``content_parts``: the OpenAI request's message content as vLLM reads it.

This package exports the names its callers use; the rest is imported from its module.
"""

from kairos.api.tokenizer.chat_template import (
    ChatTemplateError,
    ContentFormat,
    NoChatTemplateError,
    detect_content_format,
)
from kairos.api.tokenizer.content_parts import TEXT_PART_KEYS, json_type, text_part_key
from kairos.api.tokenizer.prompt_tokenizer import GIL_RELEASE_CHARS, ContentFormatOption, PromptTokenizer
from kairos.api.tokenizer.word_counter import COUNT_CHUNK_CHARS

__all__ = [
    "COUNT_CHUNK_CHARS",
    "GIL_RELEASE_CHARS",
    "TEXT_PART_KEYS",
    "ChatTemplateError",
    "ContentFormat",
    "ContentFormatOption",
    "NoChatTemplateError",
    "PromptTokenizer",
    "detect_content_format",
    "json_type",
    "text_part_key",
]
