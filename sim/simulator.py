"""The discrete-event simulator of a disaggregated cluster under a routing policy.

An event loop of ``(time, seq, kind, payload)``: arrivals, engine step ends, KV transfer ends
and heartbeats. Nodes run the shared :class:`~kairos.sim.engine.Engine`; the dispatcher is the same
policy code the gateway runs, reading heartbeats that are up to one period old (the Oracle
reads the engines directly).

Only a decision reads a heartbeat, and each node's next heartbeat replaces its last one, so a
heartbeat followed by another of its node before the next arrival is never read: the loop
steps over such runs of heartbeats (to the same times, by the same additions) and takes only
the last one before each arrival: about two thirds of them on an hour of Bursty at 10 RPS
on 2P2D, and all after the last arrival. (Not in a closed-loop run: there a turn's arrival is
known only once the turn before it ends, so every heartbeat is taken.)

Closed-loop release: a request with ``after`` (a conversation's next turn) arrives ``think_s``
after that request's last token, not at its ``arrival_s``; its record carries the instant it
really arrived. One whose ``after`` is not in the run arrives at its ``arrival_s``.

Prefix caching: every node's engine caches blocks (vLLM's default); a request's block hashes
decide what it hits. A prefix-aware policy (``policy.prefix_aware``) is told each node's hit
for the request: read from the engines themselves (the truth), or, with ``prefix_index``, from
the gateway's own index of the nodes' KV-cache events (:class:`~kairos.core.prefix_index.PrefixIndex`
fed through :class:`~kairos.core.kv_event_sync.EventStreamSync`, as the dispatcher's subscriber
feeds it), which each node publishes with its heartbeat (so the index lags the caches by up to a
heartbeat period, as the load state does).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from kairos.common import defaults
from kairos.common.contracts import HEARTBEAT_PERIOD_S, Role
from kairos.core.calibration import StepCalibration, prior_from_mape
from kairos.core.decision import Route
from kairos.core.kv_event_sync import EventStreamSync
from kairos.core.latency import LatencyModels
from kairos.core.policies import Policy
from kairos.core.prefix_index import PrefixIndex
from kairos.core.slo import RequestSLO, tightest_tpot_s, tpot_or_default
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.core.view import ClusterTracker
from kairos.sim.engine import Engine, EngineConfig, EngineSnapshot, StepPlan, StepTimer, model_step_time
from kairos.sim.engine import Sequence as EngineSeq
from kairos.sim.metrics import RequestRecord, SimMetrics, summarize
from kairos.sim.prefix_cache import hit_blocks_cap
from kairos.traffic.requests import RequestSpec


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Topology and node limits of the simulated cluster."""

    prefill_nodes: int = 2
    decode_nodes: int = 2
    prefill_step_tokens: int = defaults.PREFILL_STEP_TOKENS  # chi_p: the prefill nodes' token budget per step
    decode_step_tokens: int = defaults.DECODE_STEP_TOKENS  # decode nodes' budget per step (>= B + the largest chunk)
    kv_capacity_tokens: int = defaults.KV_CAPACITY_TOKENS  # per node
    heartbeat_s: float = HEARTBEAT_PERIOD_S  # Delta_h
    error: float = 0.0  # mean absolute relative error of the true step time vs the model
    seed: int = 0  # seeds the ground-truth error
    # "iid": every step's error drawn alone; "correlated": a per-node bias (drawn once per node)
    # plus per-step noise, with error_bias_share of the error's variance in the bias.
    error_form: str = "iid"
    error_bias_share: float = defaults.SIM_ERROR_BIAS_SHARE
    # The quantile of actual / predicted step time the decode nodes report (kairos.core.calibration);
    # the default is the guard's, a setting here only to measure the trade-off.
    calibration_quantile: float = defaults.CALIBRATION_QUANTILE
    prefix_index: bool = False  # prefix hits from the nodes' KV events (True) or the caches' truth

    def __post_init__(self) -> None:
        if self.prefill_nodes < 1 or self.decode_nodes < 1:
            raise ValueError(f"need >= 1 prefill and >= 1 decode node, got {self.prefill_nodes}P{self.decode_nodes}D")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if not 0.0 <= self.error < 1.0:
            raise ValueError(f"error must be in [0, 1), got {self.error}")
        if self.error_form not in ERROR_FORMS:
            raise ValueError(f"error_form must be one of {list(ERROR_FORMS)}, got {self.error_form!r}")
        if not 0.0 <= self.error_bias_share <= 1.0:
            raise ValueError(f"error_bias_share must be in [0, 1], got {self.error_bias_share}")


class _Ev(IntEnum):
    # Order matters for simultaneous events: finish work before new arrivals see the state.
    STEP_END = 0
    TRANSFER_END = 1
    HEARTBEAT = 2
    ARRIVAL = 3


# As plain ints: the event loop compares and pushes them for every event.
_STEP_END, _TRANSFER_END, _HEARTBEAT, _ARRIVAL = (int(e) for e in _Ev)


ERROR_FORMS = ("iid", "correlated")


def noisy_timer(base: StepTimer, error: float, seed: int) -> StepTimer:
    """Ground truth = model x a seeded random factor with E|factor - 1| = ``error``
    (a normal with sigma = error x sqrt(pi/2), floored so no step is shorter than 10% of
    the model's)."""
    if error == 0:
        return base
    rng = np.random.default_rng(seed)
    sigma = error * math.sqrt(math.pi / 2)
    block: list[float] = []

    def timer(role: Role, plan: StepPlan) -> float:
        if not block:
            block.extend(np.maximum(0.1, 1.0 + rng.normal(0.0, sigma, 4096)).tolist())
        return base(role, plan) * block.pop()

    return timer


def correlated_timers(
    base: StepTimer, error: float, seed: int, node_ids: Sequence[str], bias_share: float
) -> dict[str, StepTimer]:
    """Ground truth with a correlated error: node n's steps take model x (1 + bias_n + noise),
    bias_n ~ N(0, sigma^2 x bias_share) drawn once per node (in ``node_ids`` order, from its own
    seeded stream), noise ~ N(0, sigma^2 x (1 - bias_share)) per step, sigma = error x sqrt(pi/2):
    over nodes and steps, E|factor - 1| = ``error`` as in :func:`noisy_timer`, but a node's
    steps err together (a profile measured on other hardware, a throttled GPU), the case a
    per-node calibration is for. Floored at 0.1 as there."""
    if error == 0:
        return {n: base for n in node_ids}
    sigma = error * math.sqrt(math.pi / 2)
    biases = np.random.default_rng([seed, 1]).normal(0.0, sigma * math.sqrt(bias_share), len(node_ids))
    noise_sigma = sigma * math.sqrt(1.0 - bias_share)
    rng = np.random.default_rng(seed)
    block: list[float] = []

    def one(bias: float) -> StepTimer:
        def timer(role: Role, plan: StepPlan) -> float:
            if not block:
                block.extend(rng.normal(0.0, noise_sigma, 4096).tolist())
            return base(role, plan) * max(0.1, 1.0 + bias + block.pop())

        return timer

    return {n: one(float(b)) for n, b in zip(node_ids, biases, strict=True)}


@dataclass
class _Link:
    """The inbound KV link of one decode node: FIFO, one transfer at a time, and a transfer
    starts only once the decode node can hold the KV."""

    queue: deque[RequestRecord] = field(default_factory=deque)
    busy: bool = False
    current_tokens: int = 0  # the running transfer's prompt tokens (0: none)
    current_started: float = 0.0  # when the running transfer started
    current_tpot_s: float | None = None  # the running transfer's request's TPOT SLO

    def tightest_tpot_s(self) -> float | None:
        """The tightest TPOT SLO among the requests whose KV the node is pulling (None: none)."""
        queued = tightest_tpot_s(rec.tpot_slo_s for rec in self.queue) if self.queue else None
        if not self.busy:
            return queued
        current = tpot_or_default(self.current_tpot_s)
        return current if queued is None else min(current, queued)

    def pending_tokens(self) -> tuple[int, ...]:
        """Prompt tokens of each transfer running or queued, FIFO: the node's KV pulls to come."""
        queued = tuple(rec.split_tokens or rec.spec.prompt_tokens for rec in self.queue)
        return (self.current_tokens, *queued) if self.busy else queued


class Simulator:
    """One run of one policy over one list of requests."""

    def __init__(
        self,
        requests: Sequence[RequestSpec],
        policy: Policy,
        models: LatencyModels,
        cluster: ClusterConfig | None = None,
        tbt_slo_s: float = defaults.TBT_SLO_S,
        ttft_slo_s: float = defaults.TTFT_SLO_S,
    ) -> None:
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.policy = policy
        self.models = models
        self.cluster = cluster or ClusterConfig()
        self.tbt_slo_s = tbt_slo_s
        self.ttft_slo_s = ttft_slo_s
        c = self.cluster
        prefill_ids = [f"p{i}" for i in range(c.prefill_nodes)]
        decode_ids = [f"d{i}" for i in range(c.decode_nodes)]
        if c.error_form == "iid":
            timer = noisy_timer(model_step_time(models), c.error, c.seed)
            timers = dict.fromkeys((*prefill_ids, *decode_ids), timer)
        else:
            timers = correlated_timers(
                model_step_time(models), c.error, c.seed, (*prefill_ids, *decode_ids), c.error_bias_share
            )
        prior = prior_from_mape(models.mixed.mape)
        self.prefill = [
            Engine(EngineConfig(n, Role.PREFILL, c.prefill_step_tokens, c.kv_capacity_tokens), timers[n])
            for n in prefill_ids
        ]
        # Decode nodes hold the model (their step guard) and calibrate their steps against it.
        self.decode = [
            Engine(
                EngineConfig(n, Role.DECODE, c.decode_step_tokens, c.kv_capacity_tokens),
                timers[n],
                models,
                calibration=StepCalibration(quantile=c.calibration_quantile, prior=prior),
            )
            for n in decode_ids
        ]
        self.engines: dict[str, Engine] = {e.config.node_id: e for e in (*self.prefill, *self.decode)}
        self.prefix_index: PrefixIndex | None = None
        self._kv_streams: dict[str, EventStreamSync] = {}
        if c.prefix_index:
            # Room for every block a node can hold: the index never drops one the node still has.
            block_tokens = self.prefill[0].config.block_tokens
            self.prefix_index = PrefixIndex(c.kv_capacity_tokens // block_tokens + 1, defaults.STALE_AFTER_S)
            for node_id, engine in self.engines.items():
                engine.record_kv_events()
                self.prefix_index.add_node(node_id, 0.0)
                self._kv_streams[node_id] = EventStreamSync(self.prefix_index, node_id)
        self.links: dict[str, _Link] = {e.config.node_id: _Link() for e in self.decode}
        self.tracker = ClusterTracker(link=models.transfer)
        own_tpots = tuple(dict.fromkeys(r.tpot_slo_s for r in self.requests if r.tpot_slo_s is not None))
        self.metrics = SimMetrics(
            decode_nodes=[e.config.node_id for e in self.decode], tbt_slo_s=tbt_slo_s, request_tbt_slos=own_tpots
        )
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._inflight: dict[str, StepPlan] = {}
        self._records: list[RequestRecord] = []
        self._arrived = 0  # arrivals handled so far: self.requests[self._arrived] is the next
        ids = {r.request_id for r in self.requests}
        # Closed-loop turns by the request whose end releases them.
        self._waiting_for: dict[str, list[RequestSpec]] = {}
        self._open_loop = [r for r in self.requests if r.after is None or r.after not in ids]
        for r in self.requests:
            if r.after is not None and r.after in ids:
                self._waiting_for.setdefault(r.after, []).append(r)
        self._closed_loop = bool(self._waiting_for)
        self._prefix_aware = bool(getattr(policy, "prefix_aware", False))
        # A policy that decides each request by its own SLOs gets them, and the decode node is told
        # the request's TPOT, as the gateway's sidecar tells it; any other runs on the run's SLOs.
        self._slo_aware = bool(getattr(policy, "slo_aware", False))

    # -- event plumbing ----------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    def run(self, progress: Callable[[float], None] | None = None) -> SimMetrics:
        # The open-loop arrivals, known up front, wait in order beside the event heap, not in it:
        # the heap then holds only the few events in flight (steps, transfers, heartbeats,
        # released turns), and an hour's 36,000 arrivals no longer deepen every push and pop.
        # Each keeps the event's (time, kind, seq) key, so events come in the same order.
        arrivals: list[tuple[float, int, int, object]] = []
        for spec in self._open_loop:
            self._seq += 1
            arrivals.append((spec.arrival_s, _ARRIVAL, self._seq, spec))
        arrivals.sort()  # by key: the sequence numbers are unique, so no spec is ever compared
        n = len(self.engines)
        for i, node_id in enumerate(self.engines):
            self._report(node_id, 0.0)  # nodes register before traffic starts
            # Stagger heartbeats across the period, as independent node agents would be.
            self._push(self.cluster.heartbeat_s * (i + 1) / n, _HEARTBEAT, node_id)
        pending = len(self.requests)
        done_reported = 0
        events, next_arrival = self._events, 0
        while (events or next_arrival < len(arrivals)) and (pending > 0 or self._busy()):
            if next_arrival < len(arrivals) and (not events or arrivals[next_arrival] < events[0]):
                t, kind, _, payload = arrivals[next_arrival]
                next_arrival += 1
            else:
                t, kind, _, payload = heapq.heappop(events)
            if kind == _STEP_END:
                pending -= self._on_step_end(t, payload)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:
                self._on_arrival(t, payload)  # type: ignore[arg-type]
            elif kind == _TRANSFER_END:
                self._on_transfer_end(t, payload)  # type: ignore[arg-type]
            else:
                self._on_heartbeat(t, payload)  # type: ignore[arg-type]
            if progress is not None and len(self.requests) - pending - done_reported >= 500:
                done_reported = len(self.requests) - pending
                progress(done_reported / max(1, len(self.requests)))
        if pending:
            raise RuntimeError(f"simulation ended with {pending} unfinished requests")
        summary = summarize(self._records, self.metrics, self.tbt_slo_s, self.ttft_slo_s)
        self.metrics.summary = summary
        return self.metrics

    def _busy(self) -> bool:
        return bool(self._inflight) or any(link.busy or link.queue for link in self.links.values())

    # -- dispatch ----------------------------------------------------------------------------
    def _fresh_view(self, now: float) -> ClusterView:
        return ClusterView(
            prefill=tuple(_prefill_state(e, now) for e in self.prefill),
            decode=tuple(_decode_state(e.snapshot(now), now, self.links[e.config.node_id]) for e in self.decode),
        )

    def _on_arrival(self, now: float, spec: RequestSpec) -> None:
        self._arrived += 1
        view = self._fresh_view(now) if self.policy.fresh_state else self.tracker.view()
        slo = self._request_slo(spec)
        extra: dict[str, object] = {} if slo is None else {"slo": slo}
        if self._prefix_aware and spec.block_hashes:
            if self.prefix_index is not None and not self.policy.fresh_state:
                hits = self._indexed_hits(spec, now)
            else:
                hits = {
                    node_id: engine.prefix_hit(spec.block_hashes, spec.prompt_tokens)
                    for node_id, engine in self.engines.items()
                }
            decision = self.policy.decide(spec.prompt_tokens, view, now, cached=hits, **extra)  # type: ignore[call-arg]
        else:
            decision = self.policy.decide(spec.prompt_tokens, view, now, **extra)  # type: ignore[arg-type]
        self.tracker.record(decision, now)
        rec = RequestRecord(
            spec=spec,
            route=decision.route,
            decode_node=decision.decode_node,
            prefill_node=decision.prefill_node,
            predicted_ttft_s=(
                decision.predicted_ttft_prefill_s if decision.route is Route.KEEP else decision.predicted_ttft_decode_s
            ),
            tpot_slo_s=self.tbt_slo_s if slo is None else slo.tpot_s,
            split_tokens=decision.split_tokens,
            schedule=decision.chunk_sizes if decision.route is Route.SPLIT else (),
            step_budget_s=decision.step_budget_s if decision.route is Route.SPLIT else None,
        )
        self._records.append(rec)
        if decision.route is Route.DEFLECT:
            self.metrics.deflections += 1
            engine = self.engines[decision.decode_node]
            seq = EngineSeq(
                spec.request_id,
                spec.prompt_tokens,
                spec.output_tokens,
                schedule=decision.chunk_sizes,
                step_budget_s=decision.step_budget_s,
                tpot_slo_s=rec.tpot_slo_s,
                tag=rec,
                block_hashes=spec.block_hashes,
            )
        else:  # keep, or a split's first k tokens: a prefill hop of that prompt (its full blocks' hashes)
            assert decision.prefill_node is not None
            engine = self.engines[decision.prefill_node]
            on_prefill = decision.split_tokens or spec.prompt_tokens
            hashes = spec.block_hashes
            if decision.split_tokens:
                hashes = hashes[: on_prefill // engine.config.block_tokens]
                self.metrics.splits += 1
            seq = EngineSeq(spec.request_id, on_prefill, 1, hold_kv=True, tag=rec, block_hashes=hashes)
        rec.seq = seq
        engine.submit(seq)
        rec.cached_tokens = seq.cached_hit
        self._kick(engine, now)

    def _request_slo(self, spec: RequestSpec) -> RequestSLO | None:
        """The request's own SLOs, for a policy that reads them (the run's where it has none)."""
        if not self._slo_aware:
            return None
        return RequestSLO(
            self.ttft_slo_s if spec.ttft_slo_s is None else spec.ttft_slo_s,
            self.tbt_slo_s if spec.tpot_slo_s is None else spec.tpot_slo_s,
            spec.priority,
        )

    def _indexed_hits(self, spec: RequestSpec, now: float) -> dict[str, int]:
        """The nodes that hold a cached prefix of the request, by the event index: tokens in
        full blocks, never the prompt's last token (vLLM computes it)."""
        assert self.prefix_index is not None
        block_tokens = self.prefill[0].config.block_tokens
        keys = spec.block_hashes[: hit_blocks_cap(spec.prompt_tokens, block_tokens)]
        hits = self.prefix_index.longest_prefix_tokens({block_tokens: keys}, now)
        return {node_id: tokens for node_id, tokens in hits.items() if tokens}

    # -- engines -----------------------------------------------------------------------------
    def _kick(self, engine: Engine, now: float) -> None:
        node_id = engine.config.node_id
        if node_id in self._inflight:
            return
        plan = engine.plan_step(now)
        if plan is None:
            return
        self._inflight[node_id] = plan
        self._push(now + engine.step_duration(plan), _STEP_END, node_id)

    def _on_step_end(self, now: float, node_id: str) -> int:
        engine = self.engines[node_id]
        plan = self._inflight.pop(node_id)
        outcome = engine.finish_step(plan, now, now - plan.start)
        finished = 0
        if engine.config.role is Role.PREFILL:
            for seq in outcome.first_tokens:
                rec: RequestRecord = seq.tag  # type: ignore[assignment]
                rec.prefill_start = seq.first_chunk_at
                rec.prefill_end = now
                rec.prefill_seq = seq
                self.links[rec.decode_node].queue.append(rec)
                self._start_transfer(rec.decode_node, now)
        else:
            self.metrics.record_decode_step(node_id, plan, now - plan.start)
            for seq in outcome.first_tokens:
                rec = seq.tag  # type: ignore[assignment]
                rec.first_token = now
                if rec.route is Route.DEFLECT:
                    rec.prefill_start = seq.first_chunk_at
                    rec.prefill_end = now
                rec.first_token_step = seq.first_decode_step
            for seq in outcome.finished:
                rec = seq.tag  # type: ignore[assignment]
                rec.finished = now
                rec.last_step = plan.index
                finished += 1
                for turn in self._waiting_for.pop(rec.spec.request_id, ()):
                    at = now + turn.think_s
                    self._push(at, _ARRIVAL, dataclasses.replace(turn, arrival_s=at))
            if outcome.finished and self.links[node_id].queue:
                self._start_transfer(node_id, now)  # KV freed: a waiting transfer may fit now
        self._kick(engine, now)
        return finished

    # -- KV transfer -------------------------------------------------------------------------
    def _start_transfer(self, decode_id: str, now: float) -> None:
        link = self.links[decode_id]
        if link.busy or not link.queue:
            return
        rec = link.queue[0]
        spec = rec.spec
        seq = EngineSeq(
            spec.request_id,
            spec.prompt_tokens,
            spec.output_tokens,
            schedule=rec.schedule,  # a split's rest, prefilled on the node once its first k have landed
            step_budget_s=rec.step_budget_s,
            tpot_slo_s=rec.tpot_slo_s,
            tag=rec,
            block_hashes=spec.block_hashes,
        )
        # Only the blocks the node lacks, of the prompt or of a split's first k tokens.
        missing = self.engines[decode_id].reserve_transfer(seq, rec.split_tokens or None)
        if missing is None:
            return  # decode-side memory pressure: wait until a decode finishes
        link.queue.popleft()
        link.busy = True
        link.current_tokens = rec.split_tokens or rec.spec.prompt_tokens
        link.current_tpot_s = rec.tpot_slo_s
        link.current_started = now
        rec.transfer_start = now
        rec.seq = seq
        rec.transfer_tokens = missing
        self._push(now + self.models.kv_transfer_s(missing), _TRANSFER_END, rec)

    def _on_transfer_end(self, now: float, rec: RequestRecord) -> None:
        rec.transfer_end = now
        assert rec.prefill_node is not None and rec.prefill_seq is not None
        self.engines[rec.prefill_node].release(rec.prefill_seq)
        decode = self.engines[rec.decode_node]
        assert rec.seq is not None
        if rec.split_tokens:
            decode.accept_partial(rec.seq, rec.split_tokens)
        else:
            decode.accept_transferred(rec.seq, reserved_tokens=rec.transfer_tokens)
        self.links[rec.decode_node].busy = False
        self.links[rec.decode_node].current_tokens = 0
        self._start_transfer(rec.decode_node, now)
        self._kick(decode, now)
        self._kick(self.engines[rec.prefill_node], now)  # freed KV may admit a waiting prompt

    # -- heartbeats --------------------------------------------------------------------------
    def _on_heartbeat(self, now: float, node_id: str) -> None:
        period = self.cluster.heartbeat_s
        if self._arrived == len(self.requests):
            return  # no decision is left to read a heartbeat
        if self._closed_loop:  # the next arrival may not be known yet
            self._report(node_id, now)
            self._push(now + period, _HEARTBEAT, node_id)
            return
        # Heartbeats at equal times come before arrivals (_Ev), so one at the arrival's time is read.
        next_arrival = self.requests[self._arrived].arrival_s
        upcoming = now + period
        if upcoming <= next_arrival:  # the node beats again before anyone reads this one
            while upcoming + period <= next_arrival:
                upcoming += period
            self._push(upcoming, _HEARTBEAT, node_id)
            return
        self._report(node_id, now)
        self._push(upcoming, _HEARTBEAT, node_id)

    def _report(self, node_id: str, now: float) -> None:
        engine = self.engines[node_id]
        if self.prefix_index is not None:  # the KV events published since the last beat
            published = engine.publish_kv_events(now)
            if published is not None:
                replay = self._kv_streams[node_id].on_live(*published, now)
                assert replay is None, "a node's batches reach the simulated dispatcher in order"
            self.prefix_index.touch(node_id, now)  # the heartbeat: nothing else was published
        if engine.config.role is Role.PREFILL:
            self.tracker.update_prefill(_prefill_state(engine, now))
        else:
            self.tracker.update_decode(_decode_state(engine.snapshot(now), now, self.links[node_id]))


def _prefill_state(engine: Engine, now: float) -> PrefillNodeState:
    count, tokens, squared, attention = engine.queue_load()
    return PrefillNodeState(
        engine.config.node_id,
        count,
        tokens,
        squared,
        engine.config.max_step_tokens,
        now,
        attention_tokens=attention,
        running_step_elapsed_s=engine.running_step_elapsed_s(now),
    )


def _decode_state(snap: EngineSnapshot, now: float, link: _Link) -> DecodeNodeState:
    return DecodeNodeState(
        node_id=snap.node_id,
        decode_tokens=snap.decode_tokens,
        kv_tokens=snap.kv_tokens,
        kv_capacity_tokens=snap.kv_capacity_tokens,
        reported_at=now,
        prefill_backlog_tokens=snap.scheduled_prefill_tokens,
        prefill_backlog_computed_tokens=snap.scheduled_prefill_computed_tokens,
        step_calibration=1.0 if snap.step_calibration is None else snap.step_calibration,
        pending_kv_pull_tokens=link.pending_tokens(),
        tpot_slo_s=_tighter(snap.tpot_slo_s, link.tightest_tpot_s()),
        running_step_elapsed_s=snap.running_step_elapsed_s,
        running_kv_pull_elapsed_s=now - link.current_started if link.busy else None,
    )


def _tighter(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
