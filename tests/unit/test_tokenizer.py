"""PromptTokenizer: counts equal to vLLM's (checked against tokenizers directly) and HF-style chat rendering."""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import shutil
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import kairos.api.tokenizer.word_counter as word_counter
from kairos.api.tokenizer import (
    COUNT_CHUNK_CHARS,
    GIL_RELEASE_CHARS,
    ChatTemplateError,
    NoChatTemplateError,
    PromptTokenizer,
    detect_content_format,
)
from kairos.api.tokenizer.word_counter import (
    _BYTE_LEVEL_ASCII,
    _GPT2_ASCII,
    _LLAMA3_SPLIT,
    _QWEN2_SPLIT,
    _SPLIT_ASCII,
    _chunks,
    _islands,
)
from kairos.common.errors import ConfigError, InvalidRequestError
from kairos.launcher.tinymodel import CHAT_TEMPLATE, build_tiny_model

# A Llama-3-style template: content used as a string, never iterated (vLLM's "string" format).
STRING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '[' + message['role'] + '] ' + message['content'] | trim + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)

TWO_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "How are you?"},
]
TWO_TURNS_RENDERED = (
    "<s><|system|>\nYou are terse.</s>\n"
    "<|user|>\nHello</s>\n"
    "<|assistant|>\nHi!</s>\n"
    "<|user|>\nHow are you?</s>\n"
    "<|assistant|>\n"
)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kairos-tinymodel")


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def raw(model_dir: Path) -> Tokenizer:
    """The same tokenizer loaded independently, as the reference for every count."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "Numbers 1024, 2048 and 3.14159; symbols {}[]<>@#$%^&*",
    "Ünïcödé ✓ 日本語 🙂",
    "literal special tokens <s> and </s> inside text",
    "line one\nline two\n\n\ttabbed",
]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_count_is_the_encoding_with_bos(tok: PromptTokenizer, raw: Tokenizer, text: str) -> None:
    ids = raw.encode(text, add_special_tokens=True).ids
    assert tok.count_completion_prompt(text) == len(ids)
    assert tok.encode(text) == ids
    assert ids[0] == tok.bos_token_id == 1


def test_long_text_path_counts_the_same(tok: PromptTokenizer, raw: Tokenizer) -> None:
    text = " ".join(TEXTS) * (GIL_RELEASE_CHARS // 100)
    assert len(text) > GIL_RELEASE_CHARS
    assert tok.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert tok.count_completion_prompt(text) == len(raw.encode(text).ids)


def test_token_ids_are_counted_as_given(tok: PromptTokenizer) -> None:
    assert tok.count_completion_prompt([5, 6, 7]) == 3
    assert tok.count_completion_prompt([]) == 0
    with pytest.raises(TypeError):
        tok.count_completion_prompt([1, "a"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        tok.count_completion_prompt(3)  # type: ignore[arg-type]


def test_decode_round_trips(tok: PromptTokenizer) -> None:
    text = TEXTS[4]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode(tok.encode(text)) == "<s>" + text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_loads_specials_and_template_from_the_directory(tok: PromptTokenizer) -> None:
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == ("<s>", "</s>", 1, 2)
    assert tok.vocab_size == 4096
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.content_format == "openai"


# -- chat ------------------------------------------------------------------------------------
def test_two_turn_chat_renders_as_written_by_hand(tok: PromptTokenizer) -> None:
    assert tok.render_chat(TWO_TURNS) == TWO_TURNS_RENDERED
    assert tok.render_chat(TWO_TURNS, add_generation_prompt=False) == TWO_TURNS_RENDERED.removesuffix("<|assistant|>\n")


def test_chat_count_is_the_rendered_text_without_added_bos(tok: PromptTokenizer, raw: Tokenizer) -> None:
    ids = raw.encode(TWO_TURNS_RENDERED, add_special_tokens=False).ids
    assert tok.count_chat_prompt(TWO_TURNS) == len(ids)
    assert ids[0] == 1 and ids[1] != 1  # exactly one BOS: the template's
    assert ids.count(2) == 4  # each turn closed by EOS, recognised as the special token
    assert tok.count_chat_prompt(TWO_TURNS, add_special_tokens=True) == len(ids) + 1


def test_content_part_lists_render_like_the_string(tok: PromptTokenizer) -> None:
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": [{"type": "input_text", "text": "How are you?"}]},
    ]
    assert tok.render_chat(as_parts) == TWO_TURNS_RENDERED
    assert tok.count_chat_prompt(as_parts) == tok.count_chat_prompt(TWO_TURNS)


def test_string_format_templates_get_parts_joined_by_newlines_like_vllm(model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(model_dir, chat_template=STRING_TEMPLATE)
    assert tok.content_format == "string"
    messages = [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": " b"}]}]
    assert tok.render_chat(messages) == "<s>[user] a \n b</s>[assistant] "


def test_assistant_tool_call_without_content_renders_empty(tok: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert tok.render_chat(messages, add_generation_prompt=False) == "<s><|user|>\nx</s>\n<|assistant|>\n</s>\n"


def test_continue_final_message_cuts_after_its_text(tok: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}]
    rendered = tok.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered == "<s><|user|>\nCount</s>\n<|assistant|>\nOne, two,"
    # transformers >= 4.57 semantics (checked against it): spacing the template keeps is kept
    spaced = [messages[0], {"role": "assistant", "content": [{"type": "text", "text": " One, two,  "}]}]
    assert tok.render_chat(spaced, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|assistant|>\n One, two,  "
    )
    assert spaced[1]["content"][0]["text"] == " One, two,  "  # the caller's messages are not modified
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        tok.render_chat(messages, add_generation_prompt=True, continue_final_message=True)


def test_missing_template_raises_a_clear_error(model_dir: Path, raw: Tokenizer) -> None:
    tok = PromptTokenizer.from_files(model_dir / "tokenizer.json")
    assert tok.chat_template is None
    with pytest.raises(NoChatTemplateError, match="no chat template") as info:
        tok.render_chat(TWO_TURNS)
    assert isinstance(info.value, InvalidRequestError)  # a 400, as vLLM answers
    assert tok.count_completion_prompt("Hello") == len(raw.encode("Hello").ids)  # completions still work


def test_unsupported_content_part_is_a_request_error(tok: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match="image_url") as info:
        tok.render_chat(messages)
    assert info.value.param == "messages[0].content[0].type"


def test_hf_environment_features(model_dir: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ tools | tojson }}|{{ flavour }}|{{ unk_token }}"
        "{% if messages | length > 2 %}{{ raise_exception('too many: ' ~ messages | length) }}{% endif %}"
    )
    tok = PromptTokenizer.from_dir(model_dir, chat_template=template)
    messages = [{"role": "user", "content": "é"}, {"role": "user", "content": "second"}]
    rendered = tok.render_chat(messages, tools=[{"type": "function"}], template_kwargs={"flavour": "mint"})
    assert rendered == '{"role": "user", "content": "é"}[{"type": "function"}]|mint|<unk>'
    with pytest.raises(ChatTemplateError, match="too many: 3"):
        tok.render_chat([*messages, messages[0]])


def test_sandbox_blocks_unsafe_attribute_access(model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(model_dir, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tok.render_chat(TWO_TURNS)


def test_counting_is_safe_across_threads(tok: PromptTokenizer) -> None:
    texts = [t * k for k in range(1, 40) for t in TEXTS]
    expected = [tok.count_completion_prompt(t) for t in texts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(tok.count_completion_prompt, texts)) == expected
        assert (
            list(pool.map(lambda _: tok.count_chat_prompt(TWO_TURNS), range(50)))
            == [tok.count_chat_prompt(TWO_TURNS)] * 50
        )


# -- exact counting without Encodings ---------------------------------------------------------
# Seeded random texts built from the pieces that stress a GPT-2 pre-tokenizer and the cuts:
# every ASCII character, whitespace runs (Unicode ones too), digits, punctuation, contractions,
# scripts, combining marks, emoji, and the special-token strings and near misses.
ASCII_CHARS = [chr(i) for i in range(128)]
PIECES = {
    "words": [
        "the",
        "Hello",
        "world",
        "don't",
        "it's",
        "we're",
        "they've",
        "I'm",
        "you'll",
        "he'd",
        "o'clock",
        "'S",
        "'LL",
        "'re",
        "'",
        "''",
        "x'",
        "a",
        "Z",
        "supercalifragilistic",
    ],
    "spaces": [
        " ",
        " ",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        " \t ",
        "\x0b",
        "\x0c",
        "\x1c",
        "\x1f",
        "\u00a0",
        "\u3000",
        "\u2028",
        "\x85",
        "\u200b",
        " \u00a0 ",
    ],
    "digits": ["0", "42", "3.14159", "1,024", "2048", "\u0661\u0662\u0663", "\u00b2", "\u00bd", "\u216b"],
    "punct": [*"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "...", "\u2014", "\u201c", "\u201d", "\u2019", "\u00ab", "\u00bf"],
    "unicode": [
        "\u00dcn\u00efc\u00f6d\u00e9",
        "\u65e5\u672c\u8a9e",
        "\U0001f642",
        "\U0001f469\u200d\U0001f467",
        "\u00e9",
        "e\u0301",
        "\u00df",
        "\u03a9\u03bc\u03ad\u03b3\u03b1",
        "\u041f\u0440\u0438\u0432\u0435\u0442",
        "\u05e2\u05d1\u05e8\u05d9\u05ea",
        "\ufb01",
        "\uff46\uff55\uff4c\uff4c",
        "\u0300",
        "\U0001d518",
        "\ufeff",
    ],
    "specials": ["<s>", "</s>", "<unk>", "<s", "s>", "</s></s>", "<<s>>", "<s><s>", "<s> ", " </s>"],
    "ascii": ASCII_CHARS,
}


def random_text(rng: random.Random, kinds: tuple[str, ...] = tuple(PIECES)) -> str:
    parts: list[str] = []
    for _ in range(rng.randint(0, 120)):
        parts.append(rng.choice(PIECES[rng.choice(kinds)]))
        if rng.random() < 0.6:
            parts.append(" ")
    return "".join(parts)


def random_texts(seed: int, n: int, kinds: tuple[str, ...] = tuple(PIECES)) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, kinds) for _ in range(n)]


def pre_tokens(text: str) -> list[str]:
    return [w for w, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)]


def exhaustive_ascii_texts(three: str, four: str, seed: int) -> list[str]:
    """The inputs of an exhaustive regex check: every ASCII character alone and in pairs, every
    string of 3 (4) characters over ``three`` (``four``), the characters the regex treats apart,
    and seeded random ASCII texts."""
    return [
        *ASCII_CHARS,
        *("".join(p) for p in itertools.product(ASCII_CHARS, repeat=2)),
        *("".join(p) for p in itertools.product(three, repeat=3)),
        *("".join(p) for p in itertools.product(four, repeat=4)),
        *(text for text in random_texts(seed, 300, ("ascii", "spaces", "words", "punct", "digits")) if text.isascii()),
    ]


def weight(word: str) -> int:
    return zlib.crc32(word.encode()) & 0xFFFFF


def assert_space_pieces_weighted(
    raw: Tokenizer,
    words: re.Pattern[str],
    pre_tokenize: Callable[[str], list[str]],
    texts: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The space-piece cut is checked on pre-tokens, not counts (a tiny vocabulary may count two
    different splits alike): with each pre-token ``words`` finds "counted" as a pseudo-random
    weight, the sum over space pieces and open runs is the sum over ``pre_tokenize``'s own
    pre-tokens, counted cold and then from the piece cache."""

    def weighted_words(self: object, chunk: str) -> int:
        return sum(weight(w.translate(_BYTE_LEVEL_ASCII)) for w in words.findall(chunk))

    monkeypatch.setattr(word_counter.WordCounter, "_count_words", weighted_words)
    for text in texts:
        expected = sum(weight(w) for w in pre_tokenize(text))
        counter = PromptTokenizer(raw)
        assert counter.count_tokens(text, add_special_tokens=False) == expected, repr(text)
        assert counter.count_tokens(text, add_special_tokens=False) == expected, repr(text)  # warm


def test_the_fast_counter_is_used_for_the_tiny_model(tok: PromptTokenizer) -> None:
    assert tok.counter_refusal is None


def test_the_ascii_regex_gives_the_pre_tokenizers_pre_tokens() -> None:
    """Exhaustive on short strings: every ASCII character alone and in pairs, and every string
    of 3 (4) characters over the ones the regex treats apart (contraction letters, each
    whitespace character, 0x1c which Python's \\s takes but Oniguruma's does not, ...)."""
    texts = exhaustive_ascii_texts("aZstlrevmd09 \t\n\r\x0b\x0c\x1c\x00'.\x7f", "'slre \ta0.", seed=1)
    for text in texts:
        assert [w.translate(_BYTE_LEVEL_ASCII) for w in _GPT2_ASCII.findall(text)] == pre_tokens(text), repr(text)


def test_safe_cuts_are_pre_token_boundaries_in_any_text() -> None:
    """Cut at every safe point (chunk size 1) and around every non-ASCII run: the pre-tokens of
    the pieces are the pre-tokens of the whole, Unicode text included."""
    for text in random_texts(2, 400):
        chunks = _chunks(text, 1)
        assert "".join(chunks) == text
        assert [w for c in chunks for w in pre_tokens(c)] == pre_tokens(text), repr(text)
        for size in (1, 40, 10_000):
            for chunk in _chunks(text, size):
                pieces = _islands(chunk)
                assert "".join(pieces) == chunk
                assert [w for p in pieces for w in pre_tokens(p)] == pre_tokens(chunk), repr(chunk)


@pytest.mark.parametrize("chunk_chars", [1, 3, 16, 200, COUNT_CHUNK_CHARS])
def test_fast_counts_equal_the_encoding_on_random_texts(raw: Tokenizer, chunk_chars: int) -> None:
    tok = PromptTokenizer(raw, count_chunk_chars=chunk_chars)
    assert tok.counter_refusal is None
    for i, text in enumerate(random_texts(3, 300)):
        for specials in (True, False):
            assert tok.count_tokens(text, specials) == len(raw.encode(text, add_special_tokens=specials).ids), (
                i,
                text,
            )


def test_fast_counts_on_long_mixed_texts(tok: PromptTokenizer, raw: Tokenizer) -> None:
    """Texts of several chunks: pure ASCII, sparse non-ASCII (islands), dense non-ASCII."""
    rng = random.Random(4)
    words = [w for w in PIECES["words"] + PIECES["punct"] + PIECES["digits"] if w.isascii()]
    ascii_text = " ".join(rng.choice(words) for _ in range(20_000))
    sparse = " ".join(rng.choice(PIECES["unicode"]) if i % 97 == 0 else w for i, w in enumerate(ascii_text.split(" ")))
    dense = "".join(random_texts(5, 300))
    for text in (ascii_text, sparse, dense, ascii_text + "<s>" + dense + "</s>" + sparse):
        assert len(text) > 3 * COUNT_CHUNK_CHARS
        assert tok.count_tokens(text) == len(raw.encode(text).ids)
        assert tok.count_tokens(text, add_special_tokens=False) == len(raw.encode(text, add_special_tokens=False).ids)


def test_space_pieces_count_exactly_around_whitespace(tok: PromptTokenizer, raw: Tokenizer) -> None:
    """ASCII text is counted a space piece at a time: closed pieces from the piece cache, runs of
    open ones (double spaces, indentation, a space next to a newline or tab) by the regex. Code,
    ragged whitespace and random ASCII, counted cold and then from a warm cache."""
    code = "def f(x):\n    if x:  # a comment \n\treturn  x \n\n  \n    y = [1,  2 ]\r\n"
    rng = random.Random(7)
    ragged = "".join(
        rng.choice(["word", "it's", " ", " ", "  ", "\n", " \n", "\n ", "\t", ".", "\x0b", "\x1c"]) for _ in range(4000)
    )
    texts = [
        code * 200,
        ragged,
        " leading and trailing ",
        "   ",
        " ",
        "x",
        "\n x",
        "x \n",
        *(t for t in random_texts(8, 300, ("ascii", "spaces", "words", "punct")) if t.isascii()),
    ]
    for text in texts:
        expected = len(raw.encode(text, add_special_tokens=False).ids)
        fresh = PromptTokenizer(raw)
        assert fresh.count_tokens(text, add_special_tokens=False) == expected, repr(text[:80])  # cold
        assert fresh.count_tokens(text, add_special_tokens=False) == expected, repr(text[:80])  # warm
        assert tok.count_tokens(text, add_special_tokens=False) == expected, repr(text[:80])


def test_space_pieces_give_the_pre_tokenizers_pre_tokens(raw: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The space-piece cut is checked on pre-tokens, not counts (a tiny vocabulary may count two
    different splits alike): with each pre-token "counted" as a pseudo-random weight, the sum
    over space pieces and open runs is the sum over the pre-tokenizer's own pre-tokens."""
    rng = random.Random(9)
    cells = ["w", "it's", "9", ".", " ", " ", "  ", "\n", "\t", "\r\n", "\x0b", "\x1c"]
    texts = [
        "word\n \nx",
        "a \nb",
        "\n \n",
        *("".join(rng.choice(cells) for _ in range(rng.randint(1, 60))) for _ in range(3000)),
        *(t for t in random_texts(10, 300, ("ascii", "spaces", "words", "punct")) if t.isascii()),
    ]
    assert_space_pieces_weighted(raw, _GPT2_ASCII, pre_tokens, texts, monkeypatch)


def test_fast_counts_with_more_added_tokens(raw: Tokenizer) -> None:
    """Added tokens overlapping each other (leftmost-longest), holding spaces, and a normalized
    one (split after the non-normalized ones, as tokenizers does)."""
    custom = Tokenizer.from_str(raw.to_str())
    custom.add_special_tokens([AddedToken("<|im_start|>", normalized=False), AddedToken("s> <", normalized=False)])
    custom.add_tokens(
        [
            AddedToken("ab", normalized=False, special=False),
            AddedToken("abc", normalized=False, special=False),
            AddedToken("hello world", normalized=True, special=False),
            AddedToken("world", normalized=True, special=False),
            AddedToken("d</s", normalized=True, special=False),
        ]
    )
    tok = PromptTokenizer(custom, count_chunk_chars=5)
    assert tok.counter_refusal is None
    extra = ["ab", "abc", "abcab", "aabc", "hello world", "hello worldab", "<|im_start|>", "s> <", "d</s>", "world"]
    rng = random.Random(6)
    for _ in range(300):
        text = "".join(rng.choice([*extra, " ", " ", "x", "\u00e9", *PIECES["specials"]]) for _ in range(40))
        assert tok.count_tokens(text) == len(custom.encode(text).ids), text


def _variant(raw: Tokenizer, change: str) -> Tokenizer:
    custom = Tokenizer.from_str(raw.to_str())
    if change == "normalizer":
        custom.normalizer = normalizers.NFKC()
    elif change == "pre-tokenizer":
        custom.pre_tokenizer = pre_tokenizers.Whitespace()
    elif change == "prefix space":
        custom.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif change == "dropout":
        custom.model.dropout = 0.5
    elif change == "lstrip":
        custom.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    elif change == "truncation":
        custom.enable_truncation(8)
    return custom


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("normalizer", "normalizer"),
        ("pre-tokenizer", "pre-tokenizer is Whitespace"),
        ("prefix space", "prefix space"),
        ("dropout", "dropout"),
        ("lstrip", "strips spaces"),
        ("truncation", "truncates"),
    ],
)
def test_tokenizers_the_fast_counter_cannot_prove_are_encoded_whole(raw: Tokenizer, change: str, reason: str) -> None:
    custom = _variant(raw, change)
    tok = PromptTokenizer(custom)
    assert tok.counter_refusal is not None and reason in tok.counter_refusal
    if change == "dropout":
        return  # counts vary from one encoding to the next
    for text in [*TEXTS, "x <mask> y", " ".join(TEXTS) * 50]:
        assert tok.count_tokens(text) == len(custom.encode(text).ids)


def test_the_word_cache_is_bounded(raw: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(word_counter, "WORD_CACHE_ENTRIES", 16)
    tok = PromptTokenizer(raw)
    text = " ".join(f"w{i}x" for i in range(500))
    assert tok.count_tokens(text) == len(raw.encode(text).ids)
    assert tok.count_tokens(text) == len(raw.encode(text).ids)
    assert len(tok._counter._cache) <= 16  # type: ignore[union-attr]
    assert len(tok._counter._pieces) <= 16  # type: ignore[union-attr]


def test_count_chunk_chars_must_be_positive(raw: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="count_chunk_chars"):
        PromptTokenizer(raw, count_chunk_chars=0)


# -- content-format detection -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (CHAT_TEMPLATE, "openai"),
        (STRING_TEMPLATE, "string"),
        ("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% set rest = messages[1:] %}{% for m in rest %}{% for c in m['content'] %}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for c in m['content'] | reverse %}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% for c in other['content'] %}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %", "string"),  # does not parse: vLLM's default
    ],
)
def test_detect_content_format(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_content_format_can_be_forced(model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(model_dir, content_format="string")
    assert tok.content_format == "string"
    with pytest.raises(ConfigError, match="content_format"):
        PromptTokenizer.from_dir(model_dir, content_format="json")  # type: ignore[arg-type]


# -- loading ---------------------------------------------------------------------------------
def test_from_dir_without_tokenizer_json_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        PromptTokenizer.from_dir(tmp_path)


def test_malformed_files_are_config_errors(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        PromptTokenizer.from_dir(tmp_path)
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ConfigError, match="JSON object"):
        PromptTokenizer.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="does not compile"):
        PromptTokenizer.from_files(tmp_path / "tokenizer.json", chat_template="{% for %}")


def test_template_sources_and_added_token_specials(model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {
        "bos_token": {"content": "<s>", "__type": "AddedToken", "special": True},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<unk>"}))
    tok = PromptTokenizer.from_dir(tmp_path)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")  # the config wins, the map fills gaps
    assert tok.render_chat(TWO_TURNS) == "D<s>"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert PromptTokenizer.from_dir(tmp_path).render_chat(TWO_TURNS) == "J</s>"
    assert PromptTokenizer.from_dir(tmp_path, chat_template="X").render_chat(TWO_TURNS) == "X"

    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="none named 'default'"):
        PromptTokenizer.from_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")


# -- the Llama 3 / Qwen2 family: Split(regex, isolated) + ByteLevel(no regex) -------------------
def _split_pre_tokenizer(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@functools.cache
def _split_family_tokenizer(pattern: str) -> Tokenizer:
    """A tiny tokenizer shaped like Llama 3's (ignore_merges, BOS by the post-processor) or
    Qwen2's (NFC normalizer, no BOS), trained on English-like text and code; trained once."""
    qwen2 = pattern == _QWEN2_SPLIT
    tokenizer = Tokenizer(models.BPE(ignore_merges=not qwen2))
    tokenizer.pre_tokenizer = _split_pre_tokenizer(pattern)
    tokenizer.decoder = decoders.ByteLevel()
    if qwen2:
        tokenizer.normalizer = normalizers.NFC()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [*random_texts(20, 400), *(["def f(x):\n    return  x + 1234567\n"] * 50), *TEXTS]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if not qwen2:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A:0", special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id(specials[0]))]
        )
    return tokenizer


SPLIT_PATTERNS = [pytest.param(_LLAMA3_SPLIT, id="llama3"), pytest.param(_QWEN2_SPLIT, id="qwen2")]


def _split_pre_tokens(pattern: str) -> Callable[[str], list[str]]:
    split = _split_pre_tokenizer(pattern)
    return lambda text: [w for w, _ in split.pre_tokenize_str(text)]


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
def test_the_split_ascii_regexes_give_the_pre_tokenizers_pre_tokens(pattern: str) -> None:
    """As for GPT-2's regex: exhaustive on short strings over the characters the regex treats
    apart (upper-case contraction letters, CR and LF apart from other whitespace, digits in
    runs of up to four for Llama 3's groups of three)."""
    split_pre_tokens = _split_pre_tokens(pattern)
    words = _SPLIT_ASCII[pattern]
    texts = exhaustive_ascii_texts("aZsStTlLrReEvVmMdD09 \t\n\r\x0b\x0c\x1c\x00'.\x7f", "'sLre \t\r\na0.", seed=11)
    for text in [*texts, "1234567", " 12345 x\r\n\r\n  y"]:
        assert [w.translate(_BYTE_LEVEL_ASCII) for w in words.findall(text)] == split_pre_tokens(text), repr(text)


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
def test_safe_cuts_are_split_pre_token_boundaries_in_any_text(pattern: str) -> None:
    split_pre_tokens = _split_pre_tokens(pattern)
    for text in random_texts(12, 400):
        assert [w for c in _chunks(text, 1) for w in split_pre_tokens(c)] == split_pre_tokens(text), repr(text)
        for chunk in _chunks(text, 40):
            pieces = _islands(chunk)
            assert [w for p in pieces for w in split_pre_tokens(p)] == split_pre_tokens(chunk), repr(chunk)


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
def test_split_family_counts_equal_the_encoding(pattern: str) -> None:
    """Random texts (Unicode, specials and near misses), code and long mixed text; counted
    cold, then warm, and with chunks small enough that every text is cut."""
    raw_split = _split_family_tokenizer(pattern)
    rng = random.Random(13)
    words = [w for w in PIECES["words"] + PIECES["punct"] + PIECES["digits"] if w.isascii()]
    long_text = " ".join(rng.choice(words) for _ in range(5000))
    special = ["<|begin_of_text|>", "<|im_start|>", "<|im_start", "x<|end_of_text|>y"]
    texts = [
        *random_texts(14, 300),
        *("".join(rng.choice([*special, " ", "a", "\u00e9", "e\u0301"]) for _ in range(30)) for _ in range(100)),
        "def f(x):\n    return  x + 1234567\n" * 100,
        long_text + " \u00c5ngstr\u00f6m e\u0301 " + long_text,
    ]
    for chunk_chars in (7, COUNT_CHUNK_CHARS):
        tok = PromptTokenizer(raw_split, count_chunk_chars=chunk_chars)
        assert tok.counter_refusal is None
        for _ in ("cold", "warm"):
            for text in texts:
                for specials in (True, False):
                    expected = len(raw_split.encode(text, add_special_tokens=specials).ids)
                    assert tok.count_tokens(text, specials) == expected, repr(text[:80])


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
def test_space_pieces_give_the_split_pre_tokens(pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weighted check of test_space_pieces_give_the_pre_tokenizers_pre_tokens, for the
    Split regexes: a space piece's pre-tokens do not depend on what stands around it."""
    rng = random.Random(15)
    cells = ["w", "it's", "IT'S", "9", "12345", ".", "!x", " ", " ", "  ", "\n", "\t", "\r\n", "\x0b", "\x1c", "'"]
    texts = [
        "word\n \nx",
        "a \nb",
        "\n \n",
        "x .\n y",
        *("".join(rng.choice(cells) for _ in range(rng.randint(1, 60))) for _ in range(3000)),
    ]
    raw_split = _split_family_tokenizer(pattern)
    assert_space_pieces_weighted(raw_split, _SPLIT_ASCII[pattern], _split_pre_tokens(pattern), texts, monkeypatch)


def _split_variant(raw_split: Tokenizer, change: str) -> Tokenizer:
    state = json.loads(raw_split.to_str())
    split, byte_level = state["pre_tokenizer"]["pretokenizers"]
    if change == "unknown regex":
        split["pattern"]["Regex"] = r"\s+|\S+"
    elif change == "removed":
        split["behavior"] = "Removed"
    elif change == "byte-level regex":
        byte_level["use_regex"] = True
    elif change == "nfkc":
        state["normalizer"] = {"type": "NFKC"}
    elif change == "normalized added token":
        state["normalizer"] = {"type": "NFC"}
        cafe = {**state["added_tokens"][-1], "id": 10_000, "content": "caf\u00e9", "normalized": True}
        state["added_tokens"].append(cafe)
    return Tokenizer.from_str(json.dumps(state))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("unknown regex", "none of those known"),
        ("removed", "does not isolate"),
        ("byte-level regex", "splits again"),
        ("nfkc", "normalizer (NFKC)"),
        ("normalized added token", "added tokens matched after normalization"),
    ],
)
def test_split_tokenizers_the_fast_counter_cannot_prove_are_encoded_whole(change: str, reason: str) -> None:
    custom = _split_variant(_split_family_tokenizer(_LLAMA3_SPLIT), change)
    tok = PromptTokenizer(custom)
    assert tok.counter_refusal is not None and reason in tok.counter_refusal
    for text in [*TEXTS, "caf\u00e9 cafe\u0301 \ufb01", " ".join(TEXTS) * 50]:
        assert tok.count_tokens(text) == len(custom.encode(text).ids)


# -- token ids without Encodings (prompt_ids: the exact counter's steps, ids in place of counts) --
def assert_ids(tok: PromptTokenizer, raw_tok: Tokenizer, texts: list[str]) -> None:
    for _ in ("cold", "warm"):
        for text in texts:
            for specials in (True, False):
                expected = raw_tok.encode(text, add_special_tokens=specials).ids
                assert tok.prompt_ids(text, specials) == expected, (specials, repr(text[:80]))


@pytest.mark.parametrize("chunk_chars", [1, 3, 16, 200, COUNT_CHUNK_CHARS])
def test_prompt_ids_equal_the_encoding_on_random_texts(raw: Tokenizer, chunk_chars: int) -> None:
    tok = PromptTokenizer(raw, count_chunk_chars=chunk_chars)
    assert tok.counter_refusal is None
    assert_ids(tok, raw, random_texts(3, 300))


def test_prompt_ids_on_long_mixed_texts_and_whitespace(raw: Tokenizer) -> None:
    rng = random.Random(4)
    words = [w for w in PIECES["words"] + PIECES["punct"] + PIECES["digits"] if w.isascii()]
    ascii_text = " ".join(rng.choice(words) for _ in range(20_000))
    sparse = " ".join(rng.choice(PIECES["unicode"]) if i % 97 == 0 else w for i, w in enumerate(ascii_text.split(" ")))
    dense = "".join(random_texts(5, 300))
    cells = ["word", "it's", " ", " ", "  ", "\n", " \n", "\n ", "\t", ".", "\x0b"]
    ragged = "".join(rng.choice(cells) for _ in range(4000))
    code = "def f(x):\n    if x:  # a comment \n\treturn  x \n\n  \n    y = [1,  2 ]\r\n" * 200
    mixed = ascii_text + "<s>" + dense + "</s>" + sparse
    texts = [ascii_text, sparse, dense, mixed, ragged, code, " ", "   ", "x", "\n x"]
    assert_ids(PromptTokenizer(raw), raw, texts)


def test_prompt_ids_with_more_added_tokens(raw: Tokenizer) -> None:
    custom = Tokenizer.from_str(raw.to_str())
    custom.add_special_tokens([AddedToken("<|im_start|>", normalized=False), AddedToken("s> <", normalized=False)])
    custom.add_tokens(
        [
            AddedToken("ab", normalized=False, special=False),
            AddedToken("abc", normalized=False, special=False),
            AddedToken("hello world", normalized=True, special=False),
            AddedToken("world", normalized=True, special=False),
        ]
    )
    tok = PromptTokenizer(custom, count_chunk_chars=5)
    assert tok.counter_refusal is None
    extra = ["ab", "abc", "abcab", "aabc", "hello world", "hello worldab", "<|im_start|>", "s> <", "world"]
    rng = random.Random(6)
    cells = [*extra, " ", " ", "x", "\u00e9", *PIECES["specials"]]
    texts = ["".join(rng.choice(cells) for _ in range(40)) for _ in range(300)]
    assert_ids(tok, custom, texts)


@pytest.mark.parametrize("pattern", SPLIT_PATTERNS)
def test_split_family_prompt_ids_equal_the_encoding(pattern: str) -> None:
    raw_split = _split_family_tokenizer(pattern)
    rng = random.Random(13)
    special = ["<|begin_of_text|>", "<|im_start|>", "<|im_start", "x<|end_of_text|>y"]
    texts = [
        *random_texts(14, 200),
        *("".join(rng.choice([*special, " ", "a", "\u00e9", "e\u0301"]) for _ in range(30)) for _ in range(100)),
        "def f(x):\n    return  x + 1234567\n" * 100,
    ]
    for chunk_chars in (7, COUNT_CHUNK_CHARS):
        assert_ids(PromptTokenizer(raw_split, count_chunk_chars=chunk_chars), raw_split, texts)


def test_prompt_ids_caches_are_bounded(raw: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(word_counter, "WORD_CACHE_ENTRIES", 16)
    tok = PromptTokenizer(raw)
    text = " ".join(f"w{i}x" for i in range(500)) + "  a  b "
    assert_ids(tok, raw, [text])
    assert len(tok._counter._word_ids) <= 16 and len(tok._counter._piece_ids) <= 16  # type: ignore[union-attr]


def test_prompt_ids_without_the_counter_are_the_encoding(raw: Tokenizer) -> None:
    custom = _variant(raw, "normalizer")
    tok = PromptTokenizer(custom)
    assert tok.counter_refusal is not None
    assert_ids(tok, custom, [*TEXTS, " ".join(TEXTS) * 50])


@pytest.mark.parametrize("chunk_chars", [3, 200, COUNT_CHUNK_CHARS])
def test_prompt_ids_with_a_limit_stop_with_a_prefix(raw: Tokenizer, chunk_chars: int) -> None:
    tok = PromptTokenizer(raw, count_chunk_chars=chunk_chars)
    rng = random.Random(17)
    long_texts = [" ".join(random_texts(18, 200)), "word " * 30_000, "\u65e5\u672c " * 40_000]
    for text in [*random_texts(16, 100), *long_texts]:
        full = raw.encode(text).ids
        for limit in (0, rng.randrange(1, 50), len(full) - 1, len(full), len(full) + 5):
            got = tok.prompt_ids(text, True, max(limit, 0))
            if len(full) > limit:
                assert len(got) > limit and got == full[: len(got)], (limit, repr(text[:60]))
            else:
                assert got == full, (limit, repr(text[:60]))
