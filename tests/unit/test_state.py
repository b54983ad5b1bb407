"""The decision state's values: a prefill node's queue as the decision reads it, and the checks
that keep a malformed state out of a decision."""

from __future__ import annotations

import pytest

from kairos.core.state import DecodeNodeState, PrefillNodeState, prompt_attention_tokens


def test_a_prefill_state_from_a_queue_holds_its_count_tokens_and_squares() -> None:
    state = PrefillNodeState.from_queue("p0", [3000, 500, 7], chunk_tokens=2048, reported_at=1.5)
    attention = sum(prompt_attention_tokens(n, 0, 2048) for n in (3000, 500, 7))
    assert state == PrefillNodeState("p0", 3, 3507, 3000**2 + 500**2 + 7**2, 2048, 1.5, attention)
    assert PrefillNodeState.from_queue("p0", iter(()), 2048, 0.0).outstanding_tokens == 0  # any iterable


@pytest.mark.parametrize("remaining", [1, 100, 1000, 2047, 2048, 3000, 3569, 10_000])
def test_a_prompts_attention_is_its_computed_prefix_and_its_chunks_mean_over_their_boundaries(remaining: int) -> None:
    """Each chunk's tokens times the prompt's tokens before it, summed: exact for the computed
    prefix, the chunks' own part the mean over a uniform offset of the step boundaries (chi =
    2048; the integer offsets' mean is within 0.2% of the continuous one)."""

    def chunks_part(offset: int) -> int:
        total, before, left, room = 0, 0, remaining, 2048 - offset
        while left:
            n = min(left, room)
            total, before, left, room = total + n * before, before + n, left - n, 2048
        return total

    mean = sum(chunks_part(x) for x in range(2048)) / 2048
    assert prompt_attention_tokens(remaining, 0, 2048) == pytest.approx(mean, rel=2e-3, abs=1e-3)  # continuous mean
    assert prompt_attention_tokens(remaining, 500, 2048) == pytest.approx(mean + 500 * remaining, rel=2e-3, abs=1e-3)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((0, 0, 0, 0), "chunk_tokens must be >= 1, got 0"),
        ((-1, 0, 0, 2048), "must be >= 0"),
        ((1, -5, 25, 2048), "must be >= 0"),
        ((1, 5, -25, 2048), "must be >= 0"),
    ],
)
def test_a_prefill_state_with_an_impossible_queue_is_refused(fields: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefillNodeState("p0", *fields, reported_at=0.0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"decode_tokens": -1}, "must be >= 0"),
        ({"kv_tokens": -1}, "must be >= 0"),
        ({"step_calibration": 0.0}, "step_calibration must be > 0"),
        ({"step_calibration": float("inf")}, "step_calibration must be > 0"),
    ],
)
def test_a_decode_state_with_impossible_load_is_refused(changes: dict[str, float], message: str) -> None:
    fields = {"decode_tokens": 4, "kv_tokens": 1000, "kv_capacity_tokens": 10_000, "reported_at": 0.0, **changes}
    with pytest.raises(ValueError, match=message):
        DecodeNodeState("d0", **fields)  # type: ignore[arg-type]
