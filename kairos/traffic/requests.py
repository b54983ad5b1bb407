"""The unit of work every workload, trace and simulator run shares, and the block hashes by which
a request names its prompt's content to the engines' prefix caches."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from kairos.common import defaults

BLOCK_TOKENS = defaults.KV_BLOCK_TOKENS
# The parent hash of a chain's first block (vLLM seeds it from a random NONE_HASH per process;
# a fixed seed keeps runs reproducible, and only equality between hashes matters).
ROOT_HASH = 0


def chain_hashes(keys: Iterable[Hashable], parent: int = ROOT_HASH) -> tuple[int, ...]:
    """One hash per block, each covering the one before it: ``h_i = hash((h_{i-1}, key_i))``.

    ``key_i`` names the block's tokens. Keys must be ints or tuples of ints: Python hashes those
    the same in every process, where a ``str`` hash changes with ``PYTHONHASHSEED``.
    """
    out: list[int] = []
    h = parent
    for key in keys:
        h = hash((h, key))
        out.append(h)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as a workload or trace describes it (no routing state)."""

    request_id: str  # unique within a run, e.g. "bursty-000042"
    arrival_s: float  # seconds since the start of the run, non-decreasing in a trace
    prompt_tokens: int  # >= 1
    output_tokens: int  # >= 1, the completion length including the first token
    # What the engines' prefix caches key on, instead of token ids: the chained hashes
    # (:func:`chain_hashes`) of the full KV blocks of the prompt, then of the output where the
    # workload knows what the output is (a conversation's answer, which its next turn resends).
    # () never hits a cache.
    block_hashes: tuple[int, ...] = field(default=(), repr=False)
    session_id: str | None = None  # the conversation it belongs to, if any
    turn: int = 0  # its turn in that conversation, from 1; 0 outside any conversation
    # Closed-loop release: the request (the previous turn) that must finish before this one is
    # sent, think_s later. A driver that releases requests only open-loop uses arrival_s, the
    # workload's estimate of that instant.
    after: str | None = None
    think_s: float = 0.0
    # Its own SLOs (the x-slo-ttft-ms / x-slo-tpot-ms headers a client sends; kairos.core.slo) and
    # vLLM's priority; None: the run's cluster-wide SLO. Attainment judges it by them, and an
    # SLO-aware policy decides it by them.
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"{self.request_id}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"{self.request_id}: output_tokens must be >= 1, got {self.output_tokens}")
        if self.arrival_s < 0:
            raise ValueError(f"{self.request_id}: arrival_s must be >= 0, got {self.arrival_s}")
        if self.turn < 0 or self.think_s < 0:
            raise ValueError(f"{self.request_id}: turn={self.turn} and think_s={self.think_s} must be >= 0")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, name)
            if value is not None and not (0 < value < float("inf")):
                raise ValueError(f"{self.request_id}: {name} must be > 0, got {value}")
        if self.after == self.request_id:
            raise ValueError(f"{self.request_id}: a request cannot wait for itself")
