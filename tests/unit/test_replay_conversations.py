"""What ``kairos replay`` sends for conversations and prefix-sharing traces, without servers: the
prompts' token blocks repeat exactly as the workload's block hashes say (checked with the tiny
model's tokenizer, the cluster's), a later turn's prompt starts with the previous turn's token
ids, the turn chains and when each turn is released, and the report's turn and prefix figures."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import pytest

from kairos.api.tokenizer import PromptTokenizer
from kairos.common.errors import ConfigError
from kairos.launcher.replay import ReplayConfig, RequestResult, format_summary, summarize
from kairos.launcher.replay_prompts import (
    FALLBACK_HEAD,
    FALLBACK_IDS,
    PromptBuilder,
    Turn,
    Vocabulary,
    chain_deadline,
    shared_prefix,
    turn_chains,
)
from kairos.launcher.tinymodel import build_tiny_model
from kairos.sim.emulated_vllm import one_token_words
from kairos.traffic.requests import BLOCK_TOKENS, RequestSpec
from kairos.traffic.traces import mooncake_block_hashes
from kairos.traffic.workloads import ConversationSpec, Geometric, LogNormal, generate_conversations, make_workload

# Small conversations: shared system prompts (one of them not a whole number of blocks), long
# enough to span many blocks, several turns each.
SMALL = ConversationSpec(
    name="small",
    turns=Geometric(p=0.3),
    max_turns=6,
    first_message=LogNormal(mu=math.log(300), sigma=0.6, hi=3000.5),
    next_message=LogNormal(mu=math.log(60), sigma=0.6, hi=600.5),
    answer=Geometric(p=1 / 40),
    think_mean_s=2.0,
    system_prompts=(512, 200),
    system_share=0.8,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return PromptTokenizer.from_dir(build_tiny_model(tmp_path_factory.getbasetemp() / "replay-tiny"))


@pytest.fixture(scope="module")
def builder(tok: PromptTokenizer) -> PromptBuilder:
    return PromptBuilder(Vocabulary.from_tokenizer(tok), tok)


def node_answer(tok: PromptTokenizer, tokens: int) -> str:
    """The text an emulated node streams for ``tokens`` output tokens."""
    words = one_token_words(tok)
    return "".join(words[(i - 1) % len(words)] for i in range(1, tokens + 1))


def full_blocks(n: int) -> int:
    return n // BLOCK_TOKENS * BLOCK_TOKENS


# ---------------------------------------------------------------------------------------------
# Prompt text and ids
# ---------------------------------------------------------------------------------------------
def test_the_vocabulary_is_one_token_words_after_the_bos(builder: PromptBuilder, tok: PromptTokenizer) -> None:
    vocab = builder.vocab
    assert vocab.head == (tok.bos_token_id,) and len(vocab.words) >= 1000
    for word, token_id in zip(vocab.words[:200], vocab.ids[:200], strict=True):
        assert word[0] == " " and word[1:].isalpha()
        assert tok.encode(word, add_special_tokens=False) == [token_id]


def test_text_prompts_tokenize_to_their_ids_and_exact_length(builder: PromptBuilder, tok: PromptTokenizer) -> None:
    specs = make_workload("bursty", rps=4.0, num_requests=40, seed=3)
    specs += [RequestSpec("one", 0.0, 1, 1), RequestSpec("two", 0.0, 2, 1), RequestSpec("block", 0.0, 16, 1)]
    for spec in specs:
        ids = builder.ids(spec)
        assert len(ids) == spec.prompt_tokens
        assert tok.completion_prompt_ids(builder.text(spec)) == ids
        assert tok.count_completion_prompt(builder.text(spec)) == spec.prompt_tokens


def test_prompts_share_exactly_the_blocks_their_hashes_share(builder: PromptBuilder) -> None:
    """Every pair of first turns: the leading equal token blocks are the leading equal hashes
    (shared system prompts are shared, sessions are not), and the shared part of the text is the
    same bytes."""
    heads = [c[0].spec for c in turn_chains(generate_conversations(SMALL, rps=4.0, num_requests=80, seed=2))]
    assert len({h.block_hashes[0] for h in heads}) >= 3  # two system prompts and sessions without one
    ids = {h.request_id: builder.ids(h) for h in heads}
    word_of = dict(zip(builder.vocab.ids, builder.vocab.words, strict=True))
    pairs = 0
    for i, a in enumerate(heads):
        for b in heads[i + 1 :]:
            blocks = min(a.prompt_tokens, b.prompt_tokens) // BLOCK_TOKENS
            same_hashes = shared_prefix(a.block_hashes[:blocks], b.block_hashes[:blocks])
            same_ids = shared_prefix(ids[a.request_id], ids[b.request_id])
            assert same_ids // BLOCK_TOKENS == same_hashes, (a.request_id, b.request_id)
            if same_hashes:
                pairs += 1
                shared = ids[a.request_id][len(builder.vocab.head) : same_hashes * BLOCK_TOKENS]
                shared_text = "".join(word_of[t] for t in shared)
                assert builder.text(a).startswith(shared_text) and builder.text(b).startswith(shared_text)
    assert pairs > 0


def test_requests_without_hashes_share_no_block(builder: PromptBuilder) -> None:
    specs = make_workload("bursty", rps=4.0, num_requests=60, seed=5)
    first_blocks = {tuple(builder.ids(s)[:BLOCK_TOKENS]) for s in specs if s.prompt_tokens >= BLOCK_TOKENS}
    assert len(first_blocks) == sum(s.prompt_tokens >= BLOCK_TOKENS for s in specs)


def test_mooncake_hash_ids_give_shared_prefixes(builder: PromptBuilder) -> None:
    tokens = 3 * 512 + 100
    a = RequestSpec("a", 0.0, tokens, 5, block_hashes=mooncake_block_hashes([7, 8, 9, 10], tokens))
    b = RequestSpec("b", 1.0, tokens, 5, block_hashes=mooncake_block_hashes([7, 8, 11, 12], tokens))
    assert shared_prefix(builder.ids(a), builder.ids(b)) == 2 * 512


def test_a_later_turn_starts_with_the_previous_prompt_ids_block_for_block(
    builder: PromptBuilder, tok: PromptTokenizer
) -> None:
    """Turn k's prompt = turn k-1's prompt + the node's answer + a new message: its token ids
    start with turn k-1's, every full 16-token block (and all the rest), and it is as long as the
    workload says."""
    chains = [c for c in turn_chains(generate_conversations(SMALL, rps=4.0, num_requests=120, seed=4)) if len(c) > 1]
    assert sum(len(c) - 1 for c in chains) >= 30
    for chain in chains:
        text = builder.text(chain[0].spec)
        ids = tok.completion_prompt_ids(text)
        for previous, turn in itertools.pairwise(chain):
            text = builder.continuation(text, node_answer(tok, previous.spec.output_tokens), turn)
            new_ids = tok.completion_prompt_ids(text)
            blocks = full_blocks(len(ids))
            assert new_ids[:blocks] == ids[:blocks], turn.spec.request_id
            assert new_ids[: len(ids)] == ids
            assert len(new_ids) == turn.spec.prompt_tokens
            ids = new_ids


def test_an_answer_that_merges_into_the_last_word_is_what_shared_prefix_sees(
    builder: PromptBuilder, tok: PromptTokenizer
) -> None:
    """The join's one hazard, measured as the replay measures it: an answer starting with
    letters that extend the prompt's last word into a longer token glues onto it, so the token
    prefix ends before that word; the same answer after a space keeps it all."""
    word_of = dict(zip(builder.vocab.ids, builder.vocab.words, strict=True))
    for i in range(100):
        spec = RequestSpec(f"s{i}-t1", 0.0, 64, 4, session_id=f"s{i}", turn=1)
        last = word_of[builder.ids(spec)[-1]]
        longer = next((w for w in builder.vocab.words if w.startswith(last) and len(w) > len(last)), None)
        if longer is not None:
            break
    assert longer is not None
    suffix = longer[len(last) :]
    nxt = Turn(RequestSpec(f"s{i}-t2", 1.0, 100, 4, session_id=f"s{i}", turn=2, after=spec.request_id), 32)
    ids = builder.ids(spec)
    glued = tok.completion_prompt_ids(builder.continuation(builder.text(spec), suffix, nxt))
    assert shared_prefix(ids, glued) == len(ids) - 1
    spaced = tok.completion_prompt_ids(builder.continuation(builder.text(spec), " " + suffix, nxt))
    assert shared_prefix(ids, spaced) == len(ids)


def test_messages_are_their_own_text(builder: PromptBuilder, tok: PromptTokenizer) -> None:
    a, b = builder.message("r1", 40), builder.message("r2", 40)
    assert a != b and builder.message("r1", 40) == a
    assert tok.count_tokens(a, add_special_tokens=False) == 40


def test_without_a_tokenizer_prompts_are_ids_and_conversations_are_refused() -> None:
    plain = PromptBuilder(Vocabulary.fallback())
    spec = RequestSpec("r", 0.0, 50, 3)
    ids = plain.ids(spec)
    assert len(ids) == 50 and tuple(ids[:1]) == FALLBACK_HEAD and set(ids[1:]) <= set(FALLBACK_IDS)
    with pytest.raises(ConfigError, match="model-dir"):
        plain.text(spec)
    with pytest.raises(ConfigError, match="model-dir"):
        plain.prompt_ids("text")


def test_a_tokenizer_that_merges_words_gives_id_prompts_only(tok: PromptTokenizer) -> None:
    class Merging(PromptTokenizer):
        def completion_prompt_ids(self, prompt: str | Sequence[int], limit: int | None = None) -> list[int]:
            ids = super().completion_prompt_ids(prompt, limit)
            return [*ids[:-2], ids[-1]]

    vocab = Vocabulary.from_tokenizer(Merging(tok.raw_tokenizer))
    assert not vocab.has_text and vocab.head == (tok.bos_token_id,) and len(vocab.ids) >= 1000
    builder = PromptBuilder(vocab)
    assert len(builder.ids(RequestSpec("r", 0.0, 40, 2))) == 40
    with pytest.raises(ConfigError, match="merges or splits"):
        builder.text(RequestSpec("r", 0.0, 40, 2))


def test_a_tokenizer_without_one_token_words_gives_id_prompts_only() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "the": 1, "cat": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    vocab = Vocabulary.from_tokenizer(PromptTokenizer(raw))
    assert not vocab.has_text and vocab.ids == FALLBACK_IDS and vocab.head == ()
    with pytest.raises(ConfigError, match="one-token words"):
        PromptBuilder(vocab).message("r", 3)


# ---------------------------------------------------------------------------------------------
# Turn chains and release
# ---------------------------------------------------------------------------------------------
def test_the_multiturn_workload_chains_its_sessions_closed_loop() -> None:
    reqs = make_workload("multiturn", rps=8.0, duration_s=60.0, seed=1)
    chains = turn_chains(reqs)
    assert sum(len(c) for c in chains) == len(reqs)
    assert [c[0].spec.arrival_s for c in chains] == sorted(c[0].spec.arrival_s for c in chains)
    by_id = {r.request_id: r for r in reqs}
    for chain in chains:
        head = chain[0]
        assert head.spec.turn == 1 and head.spec.after is None and head.message_tokens == 0
        assert len({t.spec.session_id for t in chain}) == 1
        for k, turn in enumerate(chain[1:], start=2):
            prev = by_id[turn.spec.after or ""]
            assert turn.spec.turn == k and turn.closed_loop and prev is chain[k - 2].spec
            assert turn.message_tokens == turn.spec.prompt_tokens - prev.prompt_tokens - prev.output_tokens >= 1
    assert max(len(c) for c in chains) >= 3


def test_session_and_turn_ids_alone_chain_open_loop() -> None:
    reqs = [
        RequestSpec("a1", 0.0, 100, 10, session_id="a", turn=1),
        RequestSpec("b1", 0.5, 50, 10, session_id="b", turn=1),
        RequestSpec("a2", 3.0, 150, 10, session_id="a", turn=2),
        RequestSpec("x", 1.0, 70, 5),
    ]
    chains = turn_chains(reqs)
    assert [[t.spec.request_id for t in c] for c in chains] == [["a1", "a2"], ["b1"], ["x"]]
    assert chains[0][1] == Turn(reqs[2], message_tokens=40, closed_loop=False)


def test_a_turn_whose_predecessor_is_not_replayed_heads_its_own_chain() -> None:
    late = RequestSpec("s-t3", 9.0, 400, 10, session_id="s", turn=3, after="s-t2", think_s=1.0)
    assert turn_chains([late]) == [[Turn(late)]]


@pytest.mark.parametrize(
    ("reqs", "match"),
    [
        (
            [
                RequestSpec("a", 0.0, 100, 10),
                RequestSpec("b", 1.0, 200, 10, after="a"),
                RequestSpec("c", 2.0, 300, 10, after="a"),
            ],
            "both continue a",
        ),
        ([RequestSpec("a", 0.0, 100, 10), RequestSpec("b", 1.0, 110, 10, after="a")], "must be longer"),
        ([RequestSpec("a", 0.0, 100, 10, after="b"), RequestSpec("b", 1.0, 300, 10, after="a")], "cycle"),
    ],
)
def test_chains_that_cannot_be_replayed_are_refused(reqs: list[RequestSpec], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        turn_chains(reqs)


def test_release_after_think_time_or_at_arrival_never_before_the_answer() -> None:
    spec = RequestSpec("t2", 20.0, 300, 10, think_s=6.0, after="t1")
    closed = Turn(spec, 100, closed_loop=True)
    assert closed.release(previous_end=10.0, arrival=99.0, scale=2.0) == 13.0  # think 6 s model = 3 s wall
    open_loop = Turn(dataclasses.replace(spec, after=None), 100, closed_loop=False)
    assert open_loop.release(previous_end=10.0, arrival=12.0, scale=2.0) == 12.0
    assert open_loop.release(previous_end=15.0, arrival=12.0, scale=2.0) == 15.0


def test_chain_deadline_bounds_every_turn_at_the_timeout() -> None:
    t1 = RequestSpec("t1", 0.0, 100, 10)
    t2 = RequestSpec("t2", 5.0, 200, 10, after="t1", think_s=4.0)
    t3 = RequestSpec("t3", 50.0, 300, 10)
    chain = [Turn(t1), Turn(t2, 90, True), Turn(t3, 90, False)]
    # t1 ends by 100 + 30; t2 sent 4/2 s later, ends by 162; t3 at max(its arrival 125, 162), ends by 192.
    assert chain_deadline(chain, 100.0, [100.0, 102.5, 125.0], 2.0, 30.0) == 192.0


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def _done(rid: str, turn: int, ttft: float, route: str, prompt: int, cached: int | None) -> RequestResult:
    r = RequestResult(rid, 0.0, prompt, 4, status=200, route=route, ttft_s=ttft, e2e_s=ttft + 0.3, turn=turn)
    r.tbt_ms, r.tokens = [10.0, 10.0, 10.0], 4
    r.usage = {"prompt_tokens": prompt, "completion_tokens": 4}
    r.cached_tokens = cached
    return r


def test_the_summary_splits_first_and_later_turns_and_gives_hit_rates_per_route() -> None:
    results = [
        _done("a1", 1, 1.0, "keep", 1000, 0),
        _done("b1", 1, 2.0, "keep", 1000, 500),
        _done("a2", 2, 0.2, "deflect", 2000, 1500),
        _done("b2", 2, 0.4, "deflect", 2000, None),
    ]
    results[2].previous_prompt_tokens, results[2].prefix_tokens = 1010, 1010
    results[3].previous_prompt_tokens, results[3].prefix_tokens = 1010, 990  # lost the block 992..1007
    s = summarize(results, ReplayConfig())
    assert s["p95_ttft_turn1_s"] == pytest.approx(1.95) and s["p95_ttft_turn2plus_s"] == pytest.approx(0.39)
    assert s["cached_tokens_reported"] == 3 and s["prefix_hit_rate"] == pytest.approx(2000 / 4000)
    assert s["per_route"]["keep"]["prefix_hit_rate"] == pytest.approx(500 / 2000)
    assert s["per_route"]["deflect"]["prefix_hit_rate"] == pytest.approx(1500 / 2000)
    assert s["per_route"]["deflect"]["p95_ttft_turn1_s"] is None
    assert s["later_turns_sent"] == 2 and s["later_turns_prefix_broken"] == 1
    text = format_summary(s)
    assert "T2+ P95" in text and "later turns sent 2: 1 kept" in text


def test_without_conversations_or_reported_hits_the_figures_are_none() -> None:
    s = summarize([_done("r", 0, 1.0, "keep", 100, None)], ReplayConfig())
    assert s["p95_ttft_turn1_s"] is s["p95_ttft_turn2plus_s"] is s["prefix_hit_rate"] is None
    assert s["later_turns_sent"] == 0 and "T2+ P95" not in format_summary(s)


def test_cached_tokens_are_read_from_the_usage_details() -> None:
    from kairos.launcher.replay import _cached_tokens

    assert _cached_tokens({"prompt_tokens_details": {"cached_tokens": 48}}) == 48
    assert _cached_tokens({"prompt_tokens_details": None}) is None
    assert _cached_tokens({"prompt_tokens_details": {"cached_tokens": True}}) is None
    assert _cached_tokens({}) is None
