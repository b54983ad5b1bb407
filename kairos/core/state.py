"""The cluster state a decision reads: what each node last reported, plus the dispatcher's own
dispatches since then. Plain frozen values so the core stays pure and testable."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class PrefillNodeState:
    """A prefill node as of its last heartbeat (plus dispatches since, if tracked).

    Its queue as the decision reads it: how many prompts, their remaining tokens and the sum of
    their squares (Eq. 2's cached length), not each prompt's tokens. Under overload a queue holds
    thousands of prompts, and a state is built at every heartbeat and every dispatch: a per-prompt
    tuple made both cost as much as the queue is long. The heartbeat carries the per-prompt list;
    :meth:`from_queue` sums it once."""

    node_id: str
    queue_length: int  # queued or prefilling requests
    outstanding_tokens: int  # their remaining prefill tokens, all together
    squared_tokens: int  # the sum of each one's remaining tokens squared
    chunk_tokens: int  # chi_p: the node's token budget per step (max_num_batched_tokens)
    reported_at: float  # time of the heartbeat, seconds on the decider's clock
    # The queue's attention work, tokens^2: each chunk's tokens times the tokens of its prompt
    # computed before it, summed over every chunk still to run (prompt_attention_tokens), what
    # the prefill model's cached term prices. 0.0 where not worked out (Eq. 2 does not read it).
    attention_tokens: float = 0.0
    # Of outstanding_tokens, those the dispatcher sent since the heartbeat (the view's overlay):
    # the node has been running only the rest since it reported.
    overlay_tokens: int = 0
    # How long the node had been running its step in flight at the heartbeat (reported_at): the
    # queue still counts that step's tokens. None: none in flight, or not reported (a node older
    # than the field): the keep estimate takes it as half done.
    running_step_elapsed_s: float | None = None
    # What the decider derives from this state alone (kairos.core.algorithm fills it on first
    # use, as DecodeNodeState.derived). Not part of the state's value.
    derived: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"prefill node {self.node_id}: chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.queue_length < 0 or self.outstanding_tokens < 0 or self.squared_tokens < 0:
            raise ValueError(
                f"prefill node {self.node_id}: queue_length={self.queue_length}, outstanding_tokens="
                f"{self.outstanding_tokens}, squared_tokens={self.squared_tokens} must be >= 0"
            )
        if not (self.attention_tokens >= 0 and 0 <= self.overlay_tokens <= self.outstanding_tokens):
            raise ValueError(
                f"prefill node {self.node_id}: attention_tokens={self.attention_tokens} must be >= 0 and "
                f"overlay_tokens={self.overlay_tokens} within 0..outstanding_tokens={self.outstanding_tokens}"
            )
        _check_elapsed(self.node_id, "prefill", self.running_step_elapsed_s)

    @classmethod
    def from_queue(
        cls,
        node_id: str,
        queued_prefill_tokens: Iterable[int],
        chunk_tokens: int,
        reported_at: float,
        computed_tokens: Sequence[int] = (),
        running_step_elapsed_s: float | None = None,
    ) -> PrefillNodeState:
        """The state of a node whose queue holds these remaining prefill tokens, one per request,
        each over the prompt tokens ``computed_tokens`` says it computed already (none where the
        list is shorter), running a step for ``running_step_elapsed_s`` (None: not known)."""
        queue = tuple(queued_prefill_tokens)
        attention = sum(
            prompt_attention_tokens(n, computed_tokens[i] if i < len(computed_tokens) else 0, chunk_tokens)
            for i, n in enumerate(queue)
        )
        return cls(
            node_id,
            len(queue),
            sum(queue),
            sum(n * n for n in queue),
            chunk_tokens,
            reported_at,
            attention,
            running_step_elapsed_s=running_step_elapsed_s,
        )


def _check_elapsed(node_id: str, role: str, elapsed: float | None, name: str = "running_step_elapsed_s") -> None:
    if elapsed is not None and not (0 <= elapsed < math.inf):
        raise ValueError(f"{role} node {node_id}: {name} must be a number >= 0, got {elapsed}")


def prompt_attention_tokens(remaining: int, computed: int, chunk_tokens: int) -> float:
    """The attention work, tokens^2, of a prompt's ``remaining`` tokens over the ``computed``
    before them, run in a FIFO queue that packs ``chunk_tokens`` per step: the sum over its
    chunks of each chunk's tokens times the prompt's tokens before it. That is
    ``remaining x computed + (remaining^2 - sum of its chunks' squares) / 2``; where the step
    boundaries fall in the prompt depends on the prompts ahead, so the chunks' part is its mean
    over a uniform offset of the boundaries: r^3 / (6 chi) below one step's tokens, else
    r^2 / 2 - r chi / 2 + chi^2 / 6."""
    r, chi = remaining, chunk_tokens
    chunks = r * r * r / (6 * chi) if r < chi else r * r / 2 - r * chi / 2 + chi * chi / 6
    return r * computed + chunks


@dataclass(frozen=True, slots=True, eq=False)
class IncomingLink:
    """A decode node's incoming keeps as their KV will cross its inbound link, FIFO by when their
    prefill is predicted to end, in the closed form of a FIFO queue: the link clears the first m of
    them, if it is free from ``c``, at ``max(c + sums[m-1] - base, departures[m-1])``.

    Entries ``lo`` to ``hi`` of the lists, which no one changes (the view appends after ``hi``, or
    starts new lists): a state carries its node's queue without copying it, however many keeps are
    on their way. ``arrivals[i]``: (when keep i's prefill is predicted to end, on the decider's
    clock; its prompt tokens), sorted. ``sums[i]``: its transfer time plus those of the keeps
    before it in the lists (``base``: the part of that sum the keeps before ``lo`` account for).
    ``departures[i]``: when keep i's transfer would end on a link free before the lists' first,
    ``max(departures[i-1], arrivals[i][0]) + transfer_i``; kept as keeps leave the front, whose
    transfers the node's heartbeat then reports as its pulls."""

    arrivals: list[tuple[float, int]]
    sums: list[float]
    departures: list[float]
    base: float
    lo: int
    hi: int

    @classmethod
    def of(cls, arrivals: Iterable[tuple[float, int]], transfer_s: Callable[[int], float]) -> IncomingLink:
        """The link of these (arrival, tokens), sorted here; ``transfer_s``: one transfer's time."""
        ordered = sorted(arrivals)
        sums: list[float] = []
        departures: list[float] = []
        total, free = 0.0, -math.inf
        for at, tokens in ordered:
            x = transfer_s(tokens)
            total += x
            free = max(free, at) + x
            sums.append(total)
            departures.append(free)
        return cls(ordered, sums, departures, 0.0, 0, len(ordered))

    @property
    def entries(self) -> tuple[tuple[float, int], ...]:
        """The (arrival, tokens) of the keeps it holds, in order."""
        return tuple(self.arrivals[self.lo : self.hi])

    def clear_s(self, free_at: float, until: float) -> float:
        """When the link, free from ``free_at``, has carried the keeps that arrive by ``until``."""
        m = bisect.bisect_right(self.arrivals, (until, math.inf), self.lo, self.hi)
        if m == self.lo:
            return free_at
        return max(free_at + self.sums[m - 1] - self.base, self.departures[m - 1])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IncomingLink):
            return NotImplemented
        mine, theirs = slice(self.lo, self.hi), slice(other.lo, other.hi)
        return (
            self.arrivals[mine] == other.arrivals[theirs]
            and [s - self.base for s in self.sums[mine]] == [s - other.base for s in other.sums[theirs]]
            and self.departures[mine] == other.departures[theirs]
        )

    def __hash__(self) -> int:
        return hash(self.entries)


@dataclass(frozen=True, slots=True)
class DecodeNodeState:
    """A decode node as of its last heartbeat (plus dispatches since, if tracked)."""

    node_id: str
    decode_tokens: int  # B: running decodes, one token each per step
    kv_tokens: int  # K: KV-cache tokens in use
    kv_capacity_tokens: int  # total KV-cache tokens the node can hold
    reported_at: float  # time of the heartbeat, seconds on the decider's clock
    # Remaining prefill tokens of deflected prefills on the node (running or queued), including
    # the ones this dispatcher sent since the heartbeat, which the heartbeat cannot show yet.
    prefill_backlog_tokens: tuple[int, ...] = ()
    # Prompts of keep-path requests this dispatcher sent to the node whose prefill still runs on
    # a prefill node: each joins the node's batch, with its KV, when its prefill is done. The
    # heartbeat cannot show them until then; without them every keep in a burst would pick the
    # same least-loaded node (and its one KV link).
    incoming_keeps: int = 0
    incoming_keep_tokens: int = 0  # their prompt tokens, all together
    # The incoming keeps' KV as it will queue on the node's inbound link, in closed form
    # (IncomingLink): None where the view keeps no link model.
    incoming_link: IncomingLink | None = None
    # The node's step calibration from its heartbeat: the upper quantile of its actual / predicted
    # step times (kairos.core.calibration). The decider plans its steps to beta x tau / this;
    # 1.0 (a node that does not report one) plans to beta x tau, the paper's Eq. 5.
    step_calibration: float = 1.0
    # Prompt tokens of each KV transfer queued on or running over the node's inbound link
    # (prefilled keep-path requests whose KV the node has yet to pull), FIFO, as its heartbeat
    # reports them. The keep path's TTFT estimate queues a new transfer behind them.
    pending_kv_pull_tokens: tuple[int, ...] = ()
    # Per prefill_backlog_tokens entry, in the same order: the prompt tokens that deflected prefill
    # has computed already (its chunks run, or its prefix cache hit), which its remaining chunks
    # attend to; taken to be held in kv_tokens. Shorter than the backlog (a node that does not
    # report them): the rest computed nothing.
    prefill_backlog_computed_tokens: tuple[int, ...] = ()
    # The tightest TPOT SLO among the node's requests in flight (its heartbeat's, and those this
    # dispatcher sent since): Eq. 5's tau on the node for a request whose own TPOT is looser, so
    # a batch request never loosens the steps an interactive one runs in. None: none known (the
    # node holds nothing, or reports none): the request's own TPOT alone.
    tpot_slo_s: float | None = None
    # How long the node had been running its step in flight at the heartbeat (reported_at): a
    # deflection joins the node's batch when it ends. None: none in flight, or not reported (a
    # node older than the field): taken as half done.
    running_step_elapsed_s: float | None = None
    # Of prefill_backlog_tokens, the last ones were sent since the heartbeat (the view's overlay):
    # none of them was running then.
    overlay_backlog: int = 0
    # How long the first of pending_kv_pull_tokens had been crossing the link at the heartbeat.
    # None: none in flight, or not reported: taken as half done.
    running_kv_pull_elapsed_s: float | None = None
    # What the decider derives from this state alone (kairos.core.algorithm fills it on first
    # use): a state lives from one heartbeat or dispatch to the next, and every decision in
    # between reads it. Not part of the state's value: equality, repr and replace() ignore it.
    derived: Any = field(default=None, init=False, repr=False, compare=False)
    # free_kv_tokens once worked out (-1: not yet): every decision reads it for every node, and a
    # heartbeat builds every node's state at once, so it is worked out on the first read.
    _free_kv: int = field(default=-1, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.decode_tokens < 0 or self.kv_tokens < 0 or self.kv_capacity_tokens < 0:
            raise ValueError(
                f"decode node {self.node_id}: decode_tokens={self.decode_tokens}, kv_tokens={self.kv_tokens}, "
                f"kv_capacity_tokens={self.kv_capacity_tokens} must be >= 0"
            )
        if not (0 < self.step_calibration < float("inf")):
            raise ValueError(f"decode node {self.node_id}: step_calibration must be > 0, got {self.step_calibration}")
        tpot = self.tpot_slo_s
        if tpot is not None and not (0 < tpot < float("inf")):
            raise ValueError(f"decode node {self.node_id}: tpot_slo_s must be > 0, got {tpot}")
        _check_elapsed(self.node_id, "decode", self.running_step_elapsed_s)
        _check_elapsed(self.node_id, "decode", self.running_kv_pull_elapsed_s, "running_kv_pull_elapsed_s")
        if not 0 <= self.overlay_backlog <= len(self.prefill_backlog_tokens):
            raise ValueError(
                f"decode node {self.node_id}: overlay_backlog={self.overlay_backlog} must be within "
                f"0..{len(self.prefill_backlog_tokens)} (the backlog's entries)"
            )
        computed = self.prefill_backlog_computed_tokens
        if len(computed) > len(self.prefill_backlog_tokens) or any(c < 0 for c in computed):
            raise ValueError(
                f"decode node {self.node_id}: prefill_backlog_computed_tokens={computed} must be >= 0, at most one "
                f"per backlog entry ({len(self.prefill_backlog_tokens)})"
            )

    def backlog_computed(self, i: int) -> int:
        """The prompt tokens backlog entry ``i`` has computed already (0 when not reported)."""
        computed = self.prefill_backlog_computed_tokens
        return computed[i] if i < len(computed) else 0

    @property
    def free_kv_tokens(self) -> int:
        """KV-cache tokens left once the backlog, the KV being pulled and the incoming keeps hold theirs."""
        free = self._free_kv
        if free < 0:
            promised = sum(self.prefill_backlog_tokens) + sum(self.pending_kv_pull_tokens) + self.incoming_keep_tokens
            free = max(0, self.kv_capacity_tokens - self.kv_tokens - promised)
            object.__setattr__(self, "_free_kv", free)
        return free


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Everything a decision needs to know about the cluster at one instant."""

    prefill: tuple[PrefillNodeState, ...] = field(default_factory=tuple)
    decode: tuple[DecodeNodeState, ...] = field(default_factory=tuple)
