"""Exact token counts and ids without building ``Encoding``'s, for byte-level BPE tokenizers
(the GPT-2 and Llama 3 / Qwen2 families): ``WordCounter``.

``PromptTokenizer``'s counting (``count_tokens``, and the ``count_*_prompt`` methods on it)
builds no ``Encoding`` when it can prove the count exact without one. Building one costs about 1 µs a
token in ``tokenizers``, whatever the model: the NormalizedString alignments, a String per
token, offsets, masks. For the GPT-2 family of tokenizers (no normalizer, the ``ByteLevel``
pre-tokenizer with its own regex, a BPE model without dropout, added tokens without
lstrip/rstrip/single_word) and the Llama 3 / Qwen2 family (the same, but pre-tokenized by a
``Split`` on Llama 3's or Qwen2's regex, each match isolated, then ``ByteLevel`` without its
regex; an NFC normalizer allowed, which leaves ASCII alone), the count is a sum over pre-tokens
of counts that each depend on one pre-token alone (``WordCounter.refusal`` names the first
condition a tokenizer misses), so:

- added tokens are split out first, as ``tokenizers`` does (non-normalized ones, then normalized
  ones, leftmost-longest), one token each;
- ASCII text is cut at its spaces (``str.split``, in C) into space pieces; a piece that neither
  is empty nor begins or ends with whitespace always pre-tokenizes as " " + piece alone (the
  proof is at ``_OPEN_PIECE``), so its count comes from a piece cache; runs of the other pieces
  are split with the pre-tokenizer's regex written for ASCII (``_GPT2_ASCII``, ``_SPLIT_ASCII``:
  Python's ``re`` has no Unicode letter classes), and each pre-token's BPE length comes from a
  word cache filled by the model itself (``model.tokenize``). This holds the GIL (100 KB of English, caches warm, on
  the 2-core development machine: about 2 ms, against 3.3 ms for the regex on all of it):
  an event loop waiting on a pool thread that counts gets the GIL back at the interpreter's
  switch interval (5 ms), not at once as with Rust, so callers should count such text inline;
- text with non-ASCII characters is cut into chunks of about ``COUNT_CHUNK_CHARS`` at a space
  that follows a printable ASCII character: no pre-token of either family crosses such a point
  (the proof is at ``_SAFE_CUT``), so the count is the sum of the chunks' counts. In each chunk, the pieces
  around the non-ASCII characters (from the safe cut before each non-ASCII run to the one after
  it, ``_islands``) go to ``encode_batch_fast`` in one call, which releases the GIL and spreads
  them over the cores; the rest is ASCII, counted as above.

The same steps give the token ids a prefix-cache lookup hashes (``prompt_ids``): each cut is a
pre-token boundary, so the ids of the parts in order are the text's, from caches of each
pre-token's and each closed piece's ids; at about the count's cost (100 KB of English: 3 ms,
against 36 ms for an Encoding).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from tokenizers import Tokenizer, models

# The exact counter cuts long texts into chunks of about this many characters (see _SAFE_CUT).
COUNT_CHUNK_CHARS = 8192
# With a limit, the exact counter encodes its non-ASCII pieces in batches of this many characters,
# checking the limit between them.
_BOUNDED_BATCH_CHARS = 65_536
# The exact counter's word cache is emptied when it reaches this many pre-tokens (bounded memory).
WORD_CACHE_ENTRIES = 1 << 16


# Oniguruma's \s on ASCII, as the ByteLevel pre-tokenizer applies it: tab, LF, VT, FF, CR and
# space; not \x1c-\x1f, which Python's \s includes. tests/unit/test_tokenizer.py checks every ASCII
# character against the pre-tokenizer itself.
_ASCII_SPACE = "\t\n\x0b\x0c\r "
# ByteLevel's regex  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# with \p{L} = [A-Za-z] and \p{N} = [0-9]: the same pre-tokens, on ASCII text only.
_GPT2_ASCII = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_ASCII_SPACE}A-Za-z0-9]+"
    rf"|[{_ASCII_SPACE}]+(?![^{_ASCII_SPACE}])|[{_ASCII_SPACE}]+"
)
# Llama 3's and Qwen2's pre-tokenizer: Split on one of these regexes (tokenizer.json's pattern
# strings), each match isolated, then ByteLevel without its own regex. Each has an ASCII twin
# below, built as _GPT2_ASCII is (\p{L} = [A-Za-z], \p{N} = [0-9], \s = _ASCII_SPACE, the
# case-insensitive contractions spelled out); tests/unit/test_tokenizer.py checks them exhaustively.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_ascii(digits: str) -> re.Pattern[str]:
    """The ASCII twin of a Split regex above; ``digits`` is its quantifier on \\p{N}."""
    sp = _ASCII_SPACE
    return re.compile(
        r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
        + digits
        + rf"| ?[^{sp}A-Za-z0-9]+[\r\n]*|[{sp}]*[\r\n]+|[{sp}]+(?![^{sp}])|[{sp}]+"
    )


_SPLIT_ASCII = {_LLAMA3_SPLIT: _split_ascii("{1,3}"), _QWEN2_SPLIT: _split_ascii("")}
# A cut before a space that follows a printable ASCII character ("x| y") is a pre-token boundary
# of the GPT-2 regex in any text, Unicode included, so counts add up over the two sides (and of
# the Split regexes above, by the same points: their runs of letters, digits or other
# non-space characters stop at a space too, the one before letters included):
# 1. every character starts some alternative, so the matches tile the text;
# 2. the character before the cut is not whitespace in any Unicode version, so the match that
#    holds it is a contraction or an " ?X+" run whose X excludes whitespace; a space can only
#    open such a match, so that match ends at the cut and the next one starts there;
# 3. no match before the cut looks at the space: the runs stop at it as they stop at the end of
#    the text, a contraction needs a letter there, and a whitespace run (with its (?!\S)) that
#    ends before the cut sees its next character on the same side; the regex has no
#    look-behind, so the matches after the cut depend on the text after it alone.
_SAFE_CUT = re.compile(r"[!-~](?= )")
# ByteLevel's byte-to-character map (GPT-2's bytes_to_unicode) on ASCII: printable characters
# stay, the 33 others (0x00-0x20, 0x7f) become U+0100 to U+0121 in byte order.
_BYTE_LEVEL_ASCII = str.maketrans({chr(b): chr(0x100 + n) for n, b in enumerate([*range(0x21), 0x7F])})
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
# ASCII text is counted a space piece at a time: the text between two spaces (``str.split(" ")``).
# A piece that is "closed" (not empty, and neither its first nor its last character is
# whitespace) always pre-tokenizes as " " + piece alone, wherever it stands, so its count is a
# cache lookup; in GPT-2's regex and in the Split ones above:
# 1. the space before it starts a match: the character before that space is either non-space,
#    ending the match that holds it (point 2 at _SAFE_CUT), or whitespace, where \s+(?!\S) stops
#    one short of the non-space first character and leaves the space for the next match (and
#    \s*[\r\n]+ must end on a line break, which the space is not and which cannot follow it);
# 2. inside, matches see the same characters either way; whitespace runs inside are bounded by
#    non-space on both sides, and the last match (a non-space run) stops at the next space as it
#    stops at the end of the text.
# Runs of other pieces (empty ones: double spaces; ones that begin or end with whitespace, like
# indentation after a newline), with the first piece of the text, are counted by the regex, each
# run as one string: a cut before a space that is followed by a closed piece is a boundary by
# point 1, and so is a cut after a closed piece (_SAFE_CUT's point 2).
_OPEN_PIECE = 1 << 40  # the piece cache's value for a piece that is not closed: counted in runs
_UNSEEN: Any = object()  # the id piece cache's miss (None there means an open piece)
_COUNT_BITS = _OPEN_PIECE - 1  # sums of piece counts stay far below this
# In a chunk with non-ASCII characters (see _islands): ASCII stretches shorter than this stay in
# the island around them, and after this many non-ASCII runs the rest of the chunk goes to Rust
# whole (dense non-ASCII text is Rust's anyway; this bounds the Python work per chunk).
_MIN_PLAIN_CHARS = 128
_MAX_RUNS = 16


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizers component (normalizer, pre-tokenizer) as its tokenizer.json object."""
    return None if component is None else json.loads(component.__getstate__())


def _chunks(text: str, size: int) -> list[str]:
    """``text`` cut at safe points (``_SAFE_CUT``) into pieces of at least ``size`` characters."""
    if len(text) <= size:
        return [text]
    out: list[str] = []
    start = 0
    while len(text) - start > size:
        m = _SAFE_CUT.search(text, start + size - 1)
        if m is None:
            break
        out.append(text[start : m.end()])
        start = m.end()
    out.append(text[start:])
    return out


def _islands(chunk: str) -> list[str]:
    """``chunk`` cut at safe points, in order, into ASCII pieces and "islands" holding its
    non-ASCII characters, each island from the safe cut before a non-ASCII run to the one after."""
    pieces: list[str] = []
    pos = 0  # chunk[:pos] is in pieces or in the open island; a safe cut (or 0)
    island = -1  # start of the open island, which ends at pos; -1 when none is open
    runs = 0
    while (m := _NON_ASCII.search(chunk, pos)) is not None:
        runs += 1
        if runs > _MAX_RUNS:  # dense: the rest of the chunk joins the open island
            pos = len(chunk)
            break
        start = pos  # the last safe cut in (pos, m.start()), else pos
        at = m.start()
        for _ in range(8):  # a few tries: spaces after whitespace or control characters are no cuts
            at = chunk.rfind(" ", pos + 1, at)
            if at < 0:
                break
            if "!" <= chunk[at - 1] <= "~":
                start = at
                break
        if island < 0 or start - pos >= _MIN_PLAIN_CHARS:
            if island >= 0:
                pieces.append(chunk[island:pos])
            if start > pos:
                pieces.append(chunk[pos:start])
            island = start
        after = _SAFE_CUT.search(chunk, m.end())
        pos = after.end() if after is not None else len(chunk)
    if island >= 0:
        pieces.append(chunk[island:pos])
    if pos < len(chunk):
        pieces.append(chunk[pos:])
    return pieces


class WordCounter:
    """Exact token counts for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2), without Encodings.

    Each pre-token's count is the model's own (``model.tokenize``), cached by pre-token; see the
    module docstring for the steps and ``refusal`` for the tokenizers this is exact for.
    """

    __slots__ = (
        "_added_ids",
        "_cache",
        "_chunk_chars",
        "_encode_many",
        "_id_splitters",
        "_model",
        "_piece_ids",
        "_pieces",
        "_special_head",
        "_special_tail",
        "_specials",
        "_splitters",
        "_word_ids",
        "_words",
    )

    def __init__(self, tokenizer: Tokenizer, encode_many: Any, chunk_chars: int) -> None:
        self._model = tokenizer.model
        words, why = self.words_regex(tokenizer)
        assert words is not None, f"built only when refusal() is None, but {why}"
        self._words = words
        self._specials = tokenizer.num_special_tokens_to_add(False)
        self._encode_many = encode_many  # (texts, add_special_tokens) -> Encodings, GIL released
        self._chunk_chars = chunk_chars
        self._cache: dict[str, int] = {}  # pre-token -> BPE tokens
        self._pieces: dict[str, int] = {}  # space piece -> tokens of " " + piece, or _OPEN_PIECE
        # tokenizers splits out non-normalized added tokens first, then normalized ones (the
        # same strings here: no normalizer), each set leftmost-longest: an alternation tried
        # longest first finds the same matches.
        added = [t for t in tokenizer.get_added_tokens_decoder().values() if t.content]
        splitters = []
        for normalized in (False, True):
            contents = sorted({t.content for t in added if bool(t.normalized) is normalized}, key=len, reverse=True)
            if contents:
                splitters.append(re.compile("|".join(map(re.escape, contents))))
        self._splitters = tuple(splitters)
        # Token ids in the same steps (``ids``): the splitters capture the added token they match;
        # each pre-token's ids and each closed piece's (of " " + piece) come from their own caches.
        self._id_splitters = tuple(re.compile(f"({s.pattern})") for s in splitters)
        self._added_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.content}
        self._word_ids: dict[str, tuple[int, ...]] = {}
        self._piece_ids: dict[str, tuple[int, ...] | None] = {}  # None: an open piece
        # The post-processor's tokens around a text (refusal() checked their number is fixed).
        bare = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a", add_special_tokens=True).ids
        at = next(i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare)
        self._special_head, self._special_tail = tuple(full[:at]), tuple(full[at + len(bare) :])

    @staticmethod
    def refusal(tokenizer: Tokenizer) -> str | None:
        """Why counting without Encodings would not be provably exact for ``tokenizer``; None if it is."""
        normalizer = _state(tokenizer.normalizer)
        if normalizer is not None:
            # NFC leaves ASCII as it is, and Rust normalizes the rest (cut only before a space, which
            # composes with nothing before it); normalized added tokens would match after it.
            if normalizer.get("type") != "NFC":
                return f"it has a normalizer ({normalizer.get('type')})"
            if any(t.normalized for t in tokenizer.get_added_tokens_decoder().values()):
                return "it has an NFC normalizer and added tokens matched after normalization"
        words, why = WordCounter.words_regex(tokenizer)
        if words is None:
            return why
        model = tokenizer.model
        if not isinstance(model, models.BPE):
            return f"its model is {type(model).__name__}, not BPE"
        if model.dropout not in (None, 0.0):
            return f"its BPE has dropout {model.dropout} (counts vary from one encoding to the next)"
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return "it truncates or pads"
        if getattr(tokenizer, "encode_special_tokens", False):
            return "it encodes special tokens as text"
        for token in tokenizer.get_added_tokens_decoder().values():
            if token.lstrip or token.rstrip or token.single_word:
                return f"added token {token.content!r} strips spaces or matches single words"
        with_specials = len(tokenizer.encode("a", add_special_tokens=True))
        if with_specials - len(tokenizer.encode("a", add_special_tokens=False)) != tokenizer.num_special_tokens_to_add(
            False
        ):
            return "its post-processor adds a number of tokens that num_special_tokens_to_add does not tell"
        return None

    @staticmethod
    def words_regex(tokenizer: Tokenizer) -> tuple[re.Pattern[str] | None, str]:
        """The ASCII regex giving ``tokenizer``'s pre-tokens on ASCII text, or None and why not."""
        pre = _state(tokenizer.pre_tokenizer) or {}
        kind = pre.get("type")
        if kind == "ByteLevel":
            if pre.get("add_prefix_space") or not pre.get("use_regex", True):
                return None, "its ByteLevel pre-tokenizer adds a prefix space or has no regex"
            return _GPT2_ASCII, ""
        steps = pre.get("pretokenizers") or []
        if kind == "Sequence" and [step.get("type") for step in steps] == ["Split", "ByteLevel"]:
            split, byte_level = steps
            words = _SPLIT_ASCII.get((split.get("pattern") or {}).get("Regex"))
            if words is None:
                return None, "its Split pre-tokenizer's regex is none of those known (Llama 3's, Qwen2's)"
            if split.get("behavior") != "Isolated" or split.get("invert"):
                return None, "its Split pre-tokenizer does not isolate each match"
            if byte_level.get("add_prefix_space") or byte_level.get("use_regex", True):
                return None, "the ByteLevel step after its Split adds a prefix space or splits again"
            return words, ""
        return None, f"its pre-tokenizer is {kind}, not ByteLevel or Split + ByteLevel"

    def count(self, text: str, add_special_tokens: bool, limit: int | None = None) -> int:
        """The exact count, or, with ``limit``, any number above ``limit`` once the count is
        known to pass it: the text is then counted chunk by chunk (safe cuts, so the sum stays
        exact) and the rest is never counted. A 7 MB prompt is known to be over a 32K context
        after its first ~100 KB."""
        total = self._specials if add_special_tokens else 0
        pieces = [text]
        for splitter in self._splitters:
            rest: list[str] = []
            for piece in pieces:
                parts = splitter.split(piece)
                total += len(parts) - 1  # one token per added-token match
                rest.extend(p for p in parts if p)
            pieces = rest
        other: list[str] = []
        pending = 0  # characters in ``other``
        for piece in pieces:
            if piece.isascii() and (limit is None or len(piece) <= self._chunk_chars):
                total += self._count_ascii(piece)
            else:
                for chunk in _chunks(piece, self._chunk_chars):
                    for part in [chunk] if chunk.isascii() else _islands(chunk):
                        if part.isascii():
                            total += self._count_ascii(part)
                        else:
                            other.append(part)
                            pending += len(part)
                    if limit is not None:
                        if total > limit:
                            return total
                        if pending >= _BOUNDED_BATCH_CHARS:  # a batch big enough to release the GIL for
                            total += sum(len(e) for e in self._encode_many(other, False))
                            other, pending = [], 0
            if limit is not None and total > limit:
                return total
        if other:
            total += sum(len(e) for e in self._encode_many(other, False))
        return total

    def _count_ascii(self, text: str) -> int:
        """Exact count of ASCII ``text``, a space piece at a time (see ``_OPEN_PIECE``)."""
        parts = text.split(" ")
        try:
            # Every piece known: the loop stays in C. Each open piece adds _OPEN_PIECE.
            total = sum(map(self._pieces.__getitem__, itertools.islice(parts, 1, None)))
        except KeyError:
            total = sum(map(self._piece, itertools.islice(parts, 1, None)))
        if total < _OPEN_PIECE:
            return total + self._count_words(parts[0])
        total &= _COUNT_BITS
        # Runs of open pieces, the first piece starting one: each is counted whole.
        opened = itertools.compress(
            itertools.count(1), map(_OPEN_PIECE.__le__, map(self._piece, itertools.islice(parts, 1, None)))
        )
        start = end = 0  # the run parts[start:end + 1]
        for i in itertools.chain(opened, (len(parts) + 1,)):
            if i == end + 1:
                end = i
                continue
            run = " ".join(parts[start : end + 1])
            total += self._count_words(run if start == 0 else " " + run)
            start = end = i
        return total

    def _piece(self, piece: str) -> int:
        """The piece cache's value for one space piece, learnt when new."""
        n = self._pieces.get(piece)
        if n is None:
            closed = piece and piece[0] not in _ASCII_SPACE and piece[-1] not in _ASCII_SPACE
            n = self._count_words(" " + piece) if closed else _OPEN_PIECE
            if len(self._pieces) >= WORD_CACHE_ENTRIES:
                self._pieces.clear()
            self._pieces[piece] = n
        return n

    def _count_words(self, chunk: str) -> int:
        """Exact count of ASCII ``chunk``, a pre-token at a time."""
        words = self._words.findall(chunk)
        try:
            return sum(map(self._cache.__getitem__, words))  # every pre-token known: the loop stays in C
        except KeyError:
            pass  # a pre-token not seen before: count word by word below, learning the new ones
        get = self._cache.get
        total = 0
        for word in words:
            n = get(word)
            if n is None:
                n = self._learn(word)
            total += n
        return total

    def ids(self, text: str, add_special_tokens: bool, limit: int | None = None) -> list[int]:
        """``text``'s token ids, by the same steps as :meth:`count` (every cut it makes is a
        pre-token boundary, so the ids of the parts, in order, are the text's): the Rust encoder
        only for the islands around non-ASCII characters. With ``limit``, once more than
        ``limit`` ids are known the rest is never encoded: the result is then a prefix of the
        text's ids, longer than ``limit``."""
        segments: list[str | int] = [text]
        for splitter in self._id_splitters:
            split: list[str | int] = []
            for segment in segments:
                if type(segment) is int:
                    split.append(segment)
                    continue
                for j, part in enumerate(splitter.split(segment)):  # text, match, text, ...
                    if j % 2:
                        split.append(self._added_ids[part])
                    elif part:
                        split.append(part)
            segments = split
        out = list(self._special_head) if add_special_tokens else []
        for segment in segments:
            if type(segment) is int:
                out.append(segment)
            elif segment.isascii() and (limit is None or len(segment) <= self._chunk_chars):
                self._ids_ascii(segment, out)
            else:
                self._ids_chunked(segment, out, limit)
            if limit is not None and len(out) > limit:
                return out
        if add_special_tokens:
            out.extend(self._special_tail)
        return out

    def _ids_chunked(self, segment: str, out: list[int], limit: int | None) -> None:
        """Append ``segment``'s ids a safe chunk at a time, its islands batched into one Rust
        call (with ``limit``: one per ``_BOUNDED_BATCH_CHARS`` of text, checking it between)."""
        parts: list[str | int] = []  # ASCII text, or the index of an island in ``islands``
        islands: list[str] = []
        pending = 0  # characters in ``parts`` since the last flush
        for chunk in _chunks(segment, self._chunk_chars):
            for part in [chunk] if chunk.isascii() else _islands(chunk):
                if part.isascii():
                    parts.append(part)
                else:
                    parts.append(len(islands))
                    islands.append(part)
            pending += len(chunk)
            if limit is not None and (not islands or pending >= _BOUNDED_BATCH_CHARS):
                self._flush_ids(parts, islands, out)
                parts, islands, pending = [], [], 0
                if len(out) > limit:
                    return
        self._flush_ids(parts, islands, out)

    def _flush_ids(self, parts: list[str | int], islands: list[str], out: list[int]) -> None:
        encodings = self._encode_many(islands, False) if islands else []
        for part in parts:
            if type(part) is int:
                out.extend(encodings[part].ids)
            else:
                self._ids_ascii(part, out)

    def _ids_ascii(self, text: str, out: list[int]) -> None:
        """Append ASCII ``text``'s ids: closed space pieces from the cache, runs of open ones
        (the first piece starting one) by the regex, in text order (see ``_count_ascii``)."""
        parts = text.split(" ")
        run_start, run_end = 0, 0  # the open run parts[run_start:run_end + 1]; run_start -1: none
        piece_ids = self._piece_ids
        for i in range(1, len(parts)):
            piece = parts[i]
            ids = piece_ids.get(piece, _UNSEEN)
            if ids is _UNSEEN:
                ids = self._learn_piece(piece)
            if ids is None:  # open
                if run_start >= 0 and i == run_end + 1:
                    run_end = i
                    continue
                run_start = run_end = i
                continue
            if run_start >= 0:
                self._run_ids(parts, run_start, run_end, out)
                run_start = -1
            out.extend(ids)
        if run_start >= 0:
            self._run_ids(parts, run_start, run_end, out)

    def _run_ids(self, parts: list[str], start: int, end: int, out: list[int]) -> None:
        run = " ".join(parts[start : end + 1])
        self._extend_words(run if start == 0 else " " + run, out)

    def _learn_piece(self, piece: str) -> tuple[int, ...] | None:
        closed = piece and piece[0] not in _ASCII_SPACE and piece[-1] not in _ASCII_SPACE
        ids: tuple[int, ...] | None = None
        if closed:
            collected: list[int] = []
            self._extend_words(" " + piece, collected)
            ids = tuple(collected)
        if len(self._piece_ids) >= WORD_CACHE_ENTRIES:
            self._piece_ids.clear()
        self._piece_ids[piece] = ids
        return ids

    def _extend_words(self, chunk: str, out: list[int]) -> None:
        """Append ASCII ``chunk``'s ids, a pre-token at a time."""
        cache = self._word_ids
        for word in self._words.findall(chunk):
            ids = cache.get(word)
            if ids is None:
                ids = tuple(t.id for t in self._model.tokenize(word.translate(_BYTE_LEVEL_ASCII)))
                if len(cache) >= WORD_CACHE_ENTRIES:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _learn(self, word: str) -> int:
        """The model's token count for one ASCII pre-token, cached."""
        n = len(self._model.tokenize(word.translate(_BYTE_LEVEL_ASCII)))
        cache = self._cache
        if len(cache) >= WORD_CACHE_ENTRIES:
            cache.clear()
        cache[word] = n
        return n
