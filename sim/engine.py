"""A vLLM-like continuous-batching engine model: one instance per node.

The engine never reads a clock. A driver asks it for the next step (``plan_step``), lets the
step's duration pass in its own time base (virtual time in the simulator, wall time in the
emulated vLLM server), then applies the step (``finish_step``). The step duration comes from a
:class:`StepTimer`, so the same engine runs on the clean latency model or on a noisy
"ground truth".

Scheduling follows vLLM v1 with chunked prefill:
- running decodes first, one token each;
- then prefills in FIFO order within the step's token budget; a request that carries a chunk
  schedule (a deflected prefill) gets exactly its schedule's next size (the last size repeats),
  and at most one scheduled prefill advances per step, so deflected prefills on a node run one
  after another, which is what the dispatcher's TTFT prediction assumes;
- KV capacity in tokens: a waiting request is admitted only when its whole prompt fits; decodes
  that were admitted keep growing (no preemption is modelled);
- prefix caching (vLLM's default), block by block (:mod:`kairos.sim.prefix_cache`): a request
  that carries block hashes starts from its longest cached prefix and computes only the rest;
  its full blocks stay cached after it finishes, count against the same KV capacity, and the
  least recently freed are evicted when an admission, a transfer or a decode needs the room. A
  request takes its hit (and pins those blocks) when it is queued, where vLLM takes it when it
  schedules the request: the queue a heartbeat reports is then the uncached work, and a queued
  request's prefix is never evicted under it. A request without hashes never hits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from kairos.common import defaults
from kairos.common.contracts import EngineStep, Role, StepChunk
from kairos.common.kv_events import KvEvent, KvEventBatch
from kairos.core.calibration import StepCalibration, predicted_step_s
from kairos.core.latency import LatencyModels, StepGuard
from kairos.core.slo import tau_scaled_budget_s, tightest_tpot_s, tpot_or_default
from kairos.core.state import prompt_attention_tokens
from kairos.sim.prefix_cache import PrefixCache, hit_blocks_cap


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One node's engine limits."""

    node_id: str
    role: Role
    max_step_tokens: int = 2048  # token budget per step (vLLM's max_num_batched_tokens)
    kv_capacity_tokens: int = defaults.KV_CAPACITY_TOKENS  # KV-cache size in tokens (A100 80 GB, DeepSeek-V2-Lite)
    max_running: int = defaults.MAX_RUNNING_REQUESTS  # most sequences resident at once (vLLM's max_num_seqs)
    block_tokens: int = defaults.KV_BLOCK_TOKENS  # KV block size (vLLM's --block-size)
    prefix_caching: bool = True  # vLLM's default; False: no request ever hits

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1 or self.kv_capacity_tokens < 1 or self.max_running < 1 or self.block_tokens < 1:
            raise ValueError(
                f"engine {self.node_id}: max_step_tokens={self.max_step_tokens}, "
                f"kv_capacity_tokens={self.kv_capacity_tokens}, max_running={self.max_running}, "
                f"block_tokens={self.block_tokens} must be >= 1"
            )


@dataclass(slots=True, eq=False)
class Sequence:
    """A request resident on one engine. Mutable: the engine advances it step by step."""

    request_id: str
    prompt_tokens: int
    output_tokens: int  # tokens to generate on this engine (1 for a prefill-only hop)
    schedule: tuple[int, ...] = ()  # prefill tokens per step for a deflected prefill; () = budget
    # With a schedule: the longest step it may cause. The node shrinks (or defers) a chunk
    # whose step its own latency model predicts over this, given the batch it actually has.
    step_budget_s: float | None = None
    # Its TPOT SLO (kairos.core.slo; None: the cluster's default): the node's step guard holds
    # chunks to the tightest among its running decodes, and its snapshot reports the tightest.
    tpot_slo_s: float | None = None
    computed: int = 0  # prompt tokens prefilled so far (or received by KV transfer)
    generated: int = 0  # output tokens produced on this engine
    schedule_index: int = 0
    first_chunk_at: float | None = None  # start time of its first prefill step on this engine
    first_token_at: float | None = None
    first_decode_step: int = -1  # engine step index that produced its first token
    finished_at: float | None = None
    hold_kv: bool = False  # keep the KV after finishing, until ``release`` (a prefill hop's transfer)
    tag: object = None  # the driver's own handle (the simulator's request record, an HTTP stream)
    # Chained hashes of the full blocks of prompt + output (RequestSpec.block_hashes); () never hits.
    block_hashes: tuple[int, ...] = ()
    # The token ids of prompt + output, when the driver has them (the emulated node): its KV
    # events carry each stored block's tokens, as vLLM's do. The simulator's requests have none.
    token_ids: SequenceOf[int] = ()
    cached_hit: int = 0  # prompt tokens this engine had cached when the sequence arrived
    cache_refs: list[int] | tuple[()] = ()  # cached blocks it references, prefix order

    @property
    def prefill_remaining(self) -> int:
        return self.prompt_tokens - self.computed

    @property
    def kv_tokens(self) -> int:
        return self.computed + self.generated

    def next_chunk(self) -> int:
        if not self.schedule:
            return self.prefill_remaining
        size = self.schedule[min(self.schedule_index, len(self.schedule) - 1)]
        return min(size, self.prefill_remaining)


@dataclass(frozen=True, slots=True)
class Chunk:
    seq: Sequence
    tokens: int  # prompt tokens processed in this step
    cached: int  # this sequence's prompt tokens already computed before the step


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The composition of one engine step."""

    index: int  # engine step counter
    start: float
    decode_tokens: int  # B
    kv_tokens: int  # K at the start of the step
    chunks: tuple[Chunk, ...]
    new_decoders: int  # decodes producing their first token in this step (not a TBT sample)
    prefill_tokens: int  # the chunks' tokens, summed once: the timer and the metrics read it

    @property
    def step_tokens(self) -> int:
        return self.decode_tokens + self.prefill_tokens

    def record(self, duration: float, node: str | None = None, role: Role | None = None) -> EngineStep:
        """The step's record (encode it with ``kairos.common.contracts.encode_step_record``)."""
        chunks = tuple(StepChunk(c.seq.request_id, c.tokens, c.cached) for c in self.chunks)
        return EngineStep(self.index, self.start, duration, self.decode_tokens, self.kv_tokens, chunks, node, role)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a finished step produced."""

    plan: StepPlan
    duration: float
    first_tokens: tuple[Sequence, ...]  # sequences that emitted their first token this step
    finished: tuple[Sequence, ...]  # sequences that completed on this engine this step
    tokens_emitted: tuple[Sequence, ...] = ()  # every sequence that emitted a token (if tracked)


StepTimer = Callable[[Role, StepPlan], float]


def model_step_time(models: LatencyModels) -> StepTimer:
    """Step duration from the latency models (``predicted_step_s``): the prefill model on a
    prefill node's prefill-only steps, T0 + Delta T (Eq. 4) on every step that has decodes or
    runs on a decode node."""

    def timer(role: Role, plan: StepPlan) -> float:
        return predicted_step_s(models, role, plan.decode_tokens, plan.kv_tokens, plan.chunks)

    return timer


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What a heartbeat reports."""

    node_id: str
    role: Role
    decode_tokens: int  # running decodes
    kv_tokens: int  # KV tokens in use
    kv_capacity_tokens: int
    queued_prefill_tokens: tuple[int, ...]  # remaining prefill tokens, unscheduled prefills, FIFO
    scheduled_prefill_tokens: tuple[int, ...]  # remaining prefill tokens of deflected prefills, FIFO
    max_step_tokens: int
    step_calibration: float | None = None  # the engine's, when it measures its steps
    # Per scheduled_prefill_tokens entry: its prompt tokens computed already (chunks run, or a prefix hit)
    scheduled_prefill_computed_tokens: tuple[int, ...] = ()
    # Decode nodes: the tightest TPOT SLO among the requests in flight (None: none)
    tpot_slo_s: float | None = None
    queued_prefill_computed_tokens: tuple[int, ...] = ()  # likewise, per queued_prefill_tokens entry
    # How long the step in flight had run at the snapshot (None: none in flight, or no time given)
    running_step_elapsed_s: float | None = None


@dataclass(slots=True)
class _PrefillQueue:
    """The prefills of one kind (with a schedule or without) on an engine, FIFO: the admitted
    ones, then the waiting ones. ``tokens`` holds each one's remaining prompt tokens in that
    order, which is what a heartbeat reports."""

    tokens: list[int] = field(default_factory=list)  # a list: a heartbeat copies it with one memcpy
    computed: list[int] = field(default_factory=list)  # each one's prompt tokens computed already, as tokens
    admitted: list[Sequence] = field(default_factory=list)  # the first len(admitted) of tokens
    total: int = 0  # sum(tokens)
    squared: int = 0  # sum(n * n for n in tokens): Eq. 2's, kept so that a heartbeat never loops
    chunk_tokens: int = 0  # the engine's step tokens, for attention (0: not kept)
    attention: float = 0.0  # sum of prompt_attention_tokens over the queue: the keep path's estimate's

    def _attention(self, remaining: int, computed: int) -> float:
        return prompt_attention_tokens(remaining, computed, self.chunk_tokens) if self.chunk_tokens else 0.0

    def add(self, seq: Sequence, at: int | None = None) -> None:
        """``seq`` joins the queue: behind the waiting ones, or admitted already, at place ``at``
        among the admitted ones (ahead of any still waiting)."""
        n = seq.prefill_remaining
        if at is not None:
            self.tokens.insert(at, n)
            self.computed.insert(at, seq.computed)
            self.admitted.insert(at, seq)
        else:
            self.tokens.append(n)
            self.computed.append(seq.computed)
        self.total += n
        self.squared += n * n
        self.attention += self._attention(n, seq.computed)

    def advance(self, seq: Sequence, tokens: int) -> None:
        """``seq`` (admitted) prefilled ``tokens`` more; it leaves once its prompt is done."""
        i = self.admitted.index(seq)  # the head, but for a chunk the step guard deferred
        self.total -= tokens
        before = self.tokens[i]
        self.squared -= before * before - (before - tokens) * (before - tokens)
        self.attention -= self._attention(before, self.computed[i])
        if seq.prefill_remaining == 0:
            del self.admitted[i]
            del self.tokens[i]
            del self.computed[i]
        else:
            self.tokens[i] -= tokens
            self.computed[i] += tokens
            self.attention += self._attention(self.tokens[i], self.computed[i])
        if not self.tokens:
            self.attention = 0.0  # no rounding left over from the sums


@dataclass
class Engine:
    """The step loop of one node. See the module docstring for the scheduling rules."""

    config: EngineConfig
    timer: StepTimer
    guard: LatencyModels | None = None  # the node's latency model, enforcing chunk step budgets
    track_tokens: bool = False  # report every token emission (the HTTP server streams them)
    # Measures each step's duration against ``guard``'s prediction (a decode node's step
    # calibration, reported in its snapshot); None: not measured.
    calibration: StepCalibration | None = None
    waiting: deque[Sequence] = field(default_factory=deque)  # not yet admitted, FIFO
    prefilling: list[Sequence] = field(default_factory=list)  # admitted, prompt not done, FIFO
    decoding: list[Sequence] = field(default_factory=list)  # in every step's batch
    joining: list[Sequence] = field(default_factory=list)  # arrived by transfer, join next step
    kv_used: int = 0  # KV tokens held by resident sequences (computed + generated)
    kv_reserved: int = 0  # tokens promised to incoming KV transfers
    kv_prefill_pending: int = 0  # prompt tokens admitted prefills will still add
    kv_pinned: int = 0  # cached prompt tokens of sequences not yet resident (queued, or awaiting a transfer)
    step_index: int = 0
    step_started_at: float | None = None  # the start of the step planned and not yet finished (None: none)
    unstarted_decodes: int = 0  # in ``decoding`` with no token yet (joined by transfer, no step since)
    # Remaining prompt tokens of the prefills without and with a schedule, kept as they change,
    # so a heartbeat of a long queue costs one C-level copy, not a Python loop.
    _unscheduled: _PrefillQueue = field(default_factory=_PrefillQueue)
    _scheduled: _PrefillQueue = field(default_factory=_PrefillQueue)
    cache: PrefixCache | None = field(init=False, default=None)
    kv_seq: int | None = None  # the number of the last KV-event batch published (None: none yet)
    # How many requests in flight hold each TPOT SLO (tpot_or_default): a heartbeat reads their
    # tightest as the min of a few keys, never walking the batch.
    _tpots: dict[float, int] = field(default_factory=dict)
    _kv_events: list[KvEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._unscheduled.chunk_tokens = self.config.max_step_tokens
        if self.config.prefix_caching:
            self.cache = PrefixCache(self.config.block_tokens)

    def record_kv_events(self) -> None:
        """From now on, record the cache's changes for ``publish_kv_events`` (what vLLM
        publishes with ``--kv-events-config``)."""
        if self.cache is not None:
            self.cache.events = self._kv_events

    def publish_kv_events(self, now: float) -> tuple[int, KvEventBatch] | None:
        """The cache's changes since the last batch, as vLLM's scheduler hands them to its
        publisher, with the number the publisher gives the batch (0, 1, ... for the engine's
        life); None: nothing changed. ``now``: the batch's timestamp."""
        if not self._kv_events:
            return None
        self.kv_seq = 0 if self.kv_seq is None else self.kv_seq + 1
        batch = KvEventBatch(now, tuple(self._kv_events))
        self._kv_events.clear()
        return self.kv_seq, batch

    # -- prefix cache ----------------------------------------------------------------------
    def prefix_hit(self, block_hashes: tuple[int, ...], prompt_tokens: int) -> int:
        """Prompt tokens a request with these hashes would find cached here now."""
        if self.cache is None or not block_hashes:
            return 0
        bs = self.config.block_tokens
        return self.cache.match(block_hashes, hit_blocks_cap(prompt_tokens, bs)) * bs

    def _pin(self, seq: Sequence) -> None:
        """Take the sequence's cached prefix: it starts computed, its blocks referenced."""
        cache = self.cache
        if cache is None or not seq.block_hashes:
            return
        n = cache.match(seq.block_hashes, hit_blocks_cap(seq.prompt_tokens, self.config.block_tokens))
        if n:
            refs = list(seq.block_hashes[:n])
            cache.acquire(refs)
            seq.cache_refs = refs
            seq.cached_hit = seq.computed = n * self.config.block_tokens
            self.kv_pinned += seq.cached_hit

    def _cache_blocks(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache the sequence's full blocks ``start:end`` (vLLM's ``cache_full_blocks``); the
        ones newly cached."""
        assert self.cache is not None
        hashes = seq.block_hashes[start:end]
        if not hashes:
            return []
        bs = self.config.block_tokens
        tokens = seq.token_ids[start * bs : end * bs] if len(seq.token_ids) >= end * bs else ()
        return self.cache.insert(hashes, seq.block_hashes[start - 1] if start else None, tokens)

    def _cache_prompt(self, seq: Sequence) -> None:
        """The sequence's prompt KV is complete here: its full blocks become cached."""
        if self.cache is not None and seq.block_hashes:
            added = self._cache_blocks(seq, len(seq.cache_refs), seq.prompt_tokens // self.config.block_tokens)
            if added:
                seq.cache_refs = [*seq.cache_refs, *added]

    def _uncache_refs(self, seq: Sequence) -> None:
        """The sequence leaves: the full blocks its output completed are cached too (vLLM caches
        blocks as decoding fills them; the last token's KV is never computed), then every block
        it references is released to the free queue."""
        if self.cache is None or not seq.block_hashes:
            return
        bs = self.config.block_tokens
        done = (seq.prompt_tokens + seq.generated - 1) // bs
        refs = list(seq.cache_refs)
        if done > seq.prompt_tokens // bs:
            refs.extend(self._cache_blocks(seq, seq.prompt_tokens // bs, done))
        self.cache.release(refs)
        seq.cache_refs = ()

    def _make_room(self) -> None:
        """Evict free cached blocks until what is held and promised fits the capacity."""
        cache = self.cache
        if cache is None or not cache.free_queue:
            return  # nothing cached is free: nothing to evict
        over = cache.free_tokens - self.free_kv_tokens
        if over > 0:
            bs = self.config.block_tokens
            cache.evict(-(-over // bs))

    # -- admission -------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """A request that needs prefill on this engine (a prefill hop, or a deflected prefill)."""
        if seq.block_hashes:
            self._pin(seq)
        self._hold_tpot(seq, 1)
        self.waiting.append(seq)
        (self._scheduled if seq.schedule else self._unscheduled).add(seq)

    def reserve_kv(self, tokens: int) -> bool:
        """Reserve room for an incoming KV transfer; False when the node is too full now."""
        if self.free_kv_tokens < tokens:
            return False
        self.kv_reserved += tokens
        self._make_room()
        return True

    def reserve_transfer(self, seq: Sequence, transfer_tokens: int | None = None) -> int | None:
        """Reserve room for ``seq``'s prompt KV, taking the prefix this node already caches: the
        tokens to transfer (NixlConnector pulls only the blocks the decode side's own cache lacks),
        or None when the node is too full now. ``transfer_tokens``: the prompt's leading tokens
        whose KV comes by transfer (a split's k; the node prefills the rest itself, and the room
        for it is reserved too); None: the whole prompt. Pass the tokens returned as
        ``reserved_tokens`` to ``accept_transferred``, or the split's k to ``accept_partial``."""
        if self.free_kv_tokens < seq.prompt_tokens:
            return None
        if seq.block_hashes:
            self._pin(seq)
        upto = seq.prompt_tokens if transfer_tokens is None else min(transfer_tokens, seq.prompt_tokens)
        self.kv_reserved += seq.prompt_tokens - seq.computed
        self._make_room()
        return max(0, upto - seq.computed)

    def unreserve_transfer(self, seq: Sequence) -> None:
        """Undo ``reserve_transfer``: the transfer will not happen (the pull failed). Its
        reservation is the whole prompt past the node's cached prefix (a split's rest too), as
        ``accept_partial`` takes it back, whatever part of it was to come by transfer."""
        self.kv_reserved -= seq.prompt_tokens - seq.computed
        if seq.cache_refs:
            self.kv_pinned -= seq.cached_hit
            assert self.cache is not None
            self.cache.release(seq.cache_refs)
            seq.cache_refs = ()
        seq.cached_hit = seq.computed = 0

    def accept_transferred(self, seq: Sequence, reserved_tokens: int) -> None:
        """A request whose prompt KV arrived by transfer: it decodes from the next step."""
        self.kv_reserved -= reserved_tokens
        self.kv_pinned -= seq.cached_hit
        seq.computed = seq.prompt_tokens
        self.kv_used += seq.kv_tokens
        if seq.block_hashes:
            self._cache_prompt(seq)
        self._hold_tpot(seq, 1)
        self.joining.append(seq)

    def accept_partial(self, seq: Sequence, transferred_tokens: int) -> None:
        """A split request (``reserve_transfer`` with ``transfer_tokens``) whose first
        ``transferred_tokens`` prompt tokens' KV arrived: admitted at once, as a transferred request
        joins, it prefills the rest here by its ``schedule`` (behind the admitted scheduled
        prefills, ahead of any still waiting for KV room), then decodes."""
        self.kv_reserved -= seq.prompt_tokens - seq.computed
        self.kv_pinned -= seq.cached_hit
        seq.computed = max(seq.computed, transferred_tokens)
        self.kv_used += seq.computed
        self.kv_prefill_pending += seq.prefill_remaining
        self._hold_tpot(seq, 1)
        self.prefilling.append(seq)
        queue = self._scheduled if seq.schedule else self._unscheduled
        queue.add(seq, at=len(queue.admitted))

    @property
    def free_kv_tokens(self) -> int:
        """KV tokens neither held by a request nor promised to one (free cached blocks count as
        free: they are evicted when the room is needed). Blocks several requests share count once."""
        shared = self.cache.shared_blocks * self.config.block_tokens if self.cache is not None else 0
        return (
            self.config.kv_capacity_tokens
            - self.kv_used
            - self.kv_reserved
            - self.kv_prefill_pending
            - self.kv_pinned
            + shared
        )

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self.joining)

    def _admit(self) -> None:
        resident = len(self.prefilling) + len(self.decoding)
        while self.waiting and resident < self.config.max_running:
            head = self.waiting[0]
            if self.free_kv_tokens < head.prefill_remaining + 1:
                break  # FIFO: later requests wait behind the head (vLLM's default)
            self.waiting.popleft()
            self.kv_used += head.computed
            self.kv_pinned -= head.cached_hit
            self.kv_prefill_pending += head.prefill_remaining
            self._make_room()
            self.prefilling.append(head)
            (self._scheduled if head.schedule else self._unscheduled).admitted.append(head)
            resident += 1

    # -- the step loop ---------------------------------------------------------------------
    def plan_step(self, now: float) -> StepPlan | None:
        """Compose the next step, or None when there is nothing to run."""
        if self.joining:
            self.unstarted_decodes += sum(1 for s in self.joining if s.generated == 0)
            self.decoding.extend(self.joining)
            self.joining.clear()
        self._admit()
        b = len(self.decoding)
        budget = self.config.max_step_tokens - b
        chunks: list[Chunk] = []
        prefill = 0
        scheduled_taken = False
        # The budget protects running decodes' TBT: with none running it does not apply (as in
        # the vLLM plugin), so a deflected prefill on an idle node never waits forever.
        guard = StepGuard(self.guard, b, self.kv_used) if self.guard is not None and b > 0 and self.prefilling else None
        running_tpot: float | None = None  # the decodes' tightest TPOT, once a budgeted chunk asks
        for seq in self.prefilling:
            if budget <= 0:
                break
            if seq.schedule:
                if scheduled_taken:
                    continue  # one deflected prefill at a time
                scheduled_taken = True
            n = min(seq.next_chunk(), budget)
            if guard is not None:  # every token of the step against its deflected chunks' budgets
                budget_s = seq.step_budget_s
                if budget_s is not None:  # at the tau of the decodes it runs beside
                    if running_tpot is None:
                        running_tpot = tightest_tpot_s(s.tpot_slo_s for s in self.decoding)
                    budget_s = tau_scaled_budget_s(budget_s, seq.tpot_slo_s, running_tpot)
                n = guard.take(n, seq.computed, budget_s)
                if n == 0:
                    continue  # not even one token fits this step: wait for the batch to shrink
            chunks.append(Chunk(seq, n, seq.computed))
            budget -= n
            prefill += n
        if b == 0 and not chunks:
            return None
        self.step_started_at = now
        return StepPlan(self.step_index, now, b, self.kv_used, tuple(chunks), self.unstarted_decodes, prefill)

    def step_duration(self, plan: StepPlan) -> float:
        return self.timer(self.config.role, plan)

    def finish_step(self, plan: StepPlan, now: float, duration: float, measured_s: float | None = None) -> StepOutcome:
        """Apply a planned step that ended at ``now``. Sequences that joined while it ran
        (``joining``) are not part of it. ``measured_s``: the step as its tokens' readers saw
        it, when that is not ``duration`` (a node in real time wakes late on a busy host); the
        calibration learns from it."""
        if self.calibration is not None and self.guard is not None:
            predicted = predicted_step_s(self.guard, self.config.role, plan.decode_tokens, plan.kv_tokens, plan.chunks)
            self.calibration.observe(predicted, duration if measured_s is None else measured_s)
        first: list[Sequence] = []
        done: list[Sequence] = []
        emitted: list[Sequence] = []
        if plan.decode_tokens:
            self.kv_used += plan.decode_tokens
            self.unstarted_decodes = 0  # every decode in the batch gets a token now
            for seq in self.decoding:
                if seq.generated == 0:
                    seq.first_token_at = now
                    seq.first_decode_step = plan.index
                    first.append(seq)
                seq.generated += 1
                if seq.generated >= seq.output_tokens:
                    done.append(seq)
            if self.track_tokens:
                emitted.extend(self.decoding)
            if done:
                for seq in done:
                    seq.finished_at = now
                    self._hold_tpot(seq, -1)
                    self.kv_used -= seq.kv_tokens
                    if seq.block_hashes:
                        self._uncache_refs(seq)
                self.decoding = [s for s in self.decoding if s.finished_at is None]
        # Prefill chunks: the step that completes a prompt also samples its first token.
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.first_chunk_at is None:
                seq.first_chunk_at = plan.start
            seq.computed += chunk.tokens
            seq.schedule_index += 1
            self.kv_used += chunk.tokens
            self.kv_prefill_pending -= chunk.tokens
            (self._scheduled if seq.schedule else self._unscheduled).advance(seq, chunk.tokens)
            if seq.prefill_remaining == 0:
                self.prefilling.remove(seq)
                if seq.block_hashes:
                    self._cache_prompt(seq)
                seq.generated = 1
                seq.first_token_at = now
                seq.first_decode_step = plan.index
                self.kv_used += 1
                first.append(seq)
                if self.track_tokens:
                    emitted.append(seq)
                if seq.output_tokens <= 1:
                    seq.finished_at = now
                    self._hold_tpot(seq, -1)
                    done.append(seq)
                    if not seq.hold_kv:
                        self.kv_used -= seq.kv_tokens
                        if seq.block_hashes:
                            self._uncache_refs(seq)
                else:
                    self.decoding.append(seq)
        cache = self.cache
        if cache is not None and cache.free_queue and plan.decode_tokens:
            self._make_room()  # the decodes' new tokens may need a free cached block's room
        self.step_index += 1
        self.step_started_at = None
        return StepOutcome(plan, duration, tuple(first), tuple(done), tuple(emitted))

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's KV that the engine kept (a prefill node holds a prefilled
        request's KV until its transfer to the decode node completes)."""
        self.kv_used -= seq.kv_tokens
        if seq.block_hashes:
            self._uncache_refs(seq)

    # -- reporting -------------------------------------------------------------------------
    def queue_load(self) -> tuple[int, int, int, float]:
        """The unscheduled prefills as a decision reads them (the simulator's heartbeat of a
        prefill node): how many, their remaining tokens, the sum of those squared and their
        attention work (``kairos.core.state.prompt_attention_tokens``), kept as the queue
        changes, so that a heartbeat never walks a queue of thousands."""
        queue = self._unscheduled
        return len(queue.tokens), queue.total, queue.squared, queue.attention

    def running_step_elapsed_s(self, now: float) -> float | None:
        """How long the step in flight has run at ``now`` (the driver's time base); None: no step
        in flight (the engine is idle, or between a step's end and the next one's plan)."""
        started = self.step_started_at
        return None if started is None else max(0.0, now - started)

    def snapshot(self, now: float | None = None) -> EngineSnapshot:
        """What a heartbeat reports; with ``now``, how long the step in flight has run by then."""
        return EngineSnapshot(
            node_id=self.config.node_id,
            role=self.config.role,
            decode_tokens=len(self.decoding) + len(self.joining),
            kv_tokens=self.kv_used,
            kv_capacity_tokens=self.config.kv_capacity_tokens,
            queued_prefill_tokens=tuple(self._unscheduled.tokens),
            scheduled_prefill_tokens=tuple(self._scheduled.tokens),
            max_step_tokens=self.config.max_step_tokens,
            step_calibration=None if self.calibration is None else self.calibration.value,
            scheduled_prefill_computed_tokens=tuple(self._scheduled.computed),
            tpot_slo_s=self.tightest_tpot_s() if self.config.role is Role.DECODE else None,
            queued_prefill_computed_tokens=tuple(self._unscheduled.computed),
            running_step_elapsed_s=None if now is None else self.running_step_elapsed_s(now),
        )

    def tightest_tpot_s(self) -> float | None:
        """The tightest TPOT SLO among the requests in flight here (waiting, prefilling, decoding
        or joining; None: none), what a decode node's heartbeat reports."""
        return min(self._tpots, default=None)

    def _hold_tpot(self, seq: Sequence, change: int) -> None:
        tpot = tpot_or_default(seq.tpot_slo_s)
        left = self._tpots.get(tpot, 0) + change
        if left:
            self._tpots[tpot] = left
        else:
            del self._tpots[tpot]
